"""bench_lora: the CPU quick run works end to end, and a fused path that computes something else is
reported instead of timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from bench import bench_lora as bl  # noqa: E402
from bench import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "bench", "lora", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_lora.json").read_text())
    assert data["failures"] == [] and len(data["results"]) == 1
    r = data["results"][0]
    assert r["op"] == "lora_fwd_bwd" and set(r["speedup"]) == {"peft_materialised"} and r["shape"]["r"] == bl.RANK
    assert r["extra"] == {}  # peak memory is measured on CUDA only
    assert any(line.startswith("HEADLINE lora_fwd_bwd") for line in proc.stdout.splitlines())


def test_a_wrong_low_rank_product_fails_the_case(monkeypatch):
    from moe_kernels.nn import experts as experts_mod

    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = experts_mod.grouped_mm_lora
    monkeypatch.setattr(experts_mod, "grouped_mm_lora",
                        lambda x, w, gs, terms, mm: real(x, w, gs, [(b, a, 1.1 * s) for b, a, s in terms], mm=mm))
    with pytest.raises(AssertionError, match="lora"):
        bl.run_case(ctx, bl.cases(ctx)[0])
