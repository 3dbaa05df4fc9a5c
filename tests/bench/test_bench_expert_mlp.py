"""bench_expert_mlp: the CPU run works end to end, the kept-memory count follows its model at the perf.md
shapes, and a gathered path that computes something else is reported instead of timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_expert_mlp as be
from bench import harness

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "bench", "expert_mlp", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_expert_mlp.json").read_text())
    assert data["failures"] == [] and len(data["results"]) == 2
    for r in data["results"]:
        assert r["op"] == "expert_mlp_fwd_bwd" and set(r["speedup"]) == {"permuted"}
        x = r["extra"]
        assert x["saved_mib"] == pytest.approx(x["saved_mib_model"]) and x["saved_mib"] > 0
        assert "peak_mib" not in x  # measured on CUDA only
    memory = [line for line in proc.stdout.splitlines() if line.startswith("HEADLINE expert_mlp memory")]
    assert len(memory) == len(be.MEMORY_SHAPES)


def test_kept_bytes_at_a_perf_shape():
    """qwen3-30b-a3b at 8192 tokens: R = T k = 65536 rows, H 2048, F 768, bf16."""
    cfg = be.config("qwen3-30b-a3b")
    saved = be.kept_bytes(cfg, 8192, torch.bfloat16) - be.kept_bytes(cfg.replace(gather_experts=True), 8192,
                                                                       torch.bfloat16)
    assert saved == 65536 * (2048 + 768) * 2 - 4 * 65536


def test_a_wrong_gathered_path_fails_the_case(monkeypatch):
    from moe_kernels.ops import expert_mlp as em

    real = em._forward_reference
    monkeypatch.setattr(em, "_forward_reference", lambda *a: (lambda o, t, h: (o * 1.01, t, h))(*real(*a)))
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    with pytest.raises(AssertionError, match="permuted path"):
        be.run_case(ctx, be.cases(ctx)[0])
