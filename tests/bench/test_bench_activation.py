"""bench_activation: the CPU quick run works end to end with its byte counts; a wrong activation is reported, not
timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_activation as ba
from bench import harness

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "bench", "activation", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_activation.json").read_text())
    assert data["suite"] == "activation" and data["failures"] == []
    F, k = ba.CPU_MODELS["tiny"]
    R = 64 * k
    passes = {"swiglu_fwd_bwd": 8, "squared_relu_fwd_bwd": 5}  # R F elements read or written, each
    assert {r["op"] for r in data["results"]} == set(passes)
    for r in data["results"]:
        assert r["shape"] == {"R": R, "F": F} and r["bytes"] == passes[r["op"]] * R * F * 2
        assert set(r["speedup"]) == {"torch_eager"}


@pytest.mark.parametrize(("name", "wrong"), [
    ("squared_relu", lambda real: lambda h: real(h) * 1.01),
    ("swiglu", lambda real: lambda h, *a: real(h, *a) * 1.01),
])
def test_a_wrong_activation_fails_the_case(monkeypatch, name, wrong):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    monkeypatch.setattr(ba, name, wrong(getattr(ba, name)))
    with pytest.raises(AssertionError):
        ba.run_case(ctx, ba.Case("tiny", 64, *ba.CPU_MODELS["tiny"]))
