"""bench_grouped_mm_fp8: the CPU quick run works end to end and checks ours before timing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_grouped_mm_fp8 as b8
from bench import harness

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "bench", "grouped_mm_fp8", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_grouped_mm_fp8.json").read_text())
    ops = ("grouped_mm_fp8_fwd", "grouped_mm_fp8_wgrad", "fp8_recipe_fwd_bwd")
    assert data["failures"] == [] and len(data["results"]) == 12
    for r in data["results"]:
        assert r["op"] in ops and r["shape"]["K"] % 128 == 0
        M, N, K = r["shape"]["M"], r["shape"]["N"], r["shape"]["K"]
        if r["op"] == "grouped_mm_fp8_fwd":
            assert r["flops"] == 2 * M * N * K
        else:  # wgrad and the recipe run on each group padded to 128 rows: Mp >= M, a multiple of 128
            gemms = 1 if r["op"] == "grouped_mm_fp8_wgrad" else 3
            Mp, rest = divmod(r["flops"], gemms * 2 * N * K)
            assert rest == 0 and Mp >= M and Mp % 128 == 0, (r["op"], Mp)
        assert set(r["speedup"]) == {"moe_kernels_bf16"}
    for op in ops:
        assert any(line.startswith(f"HEADLINE {op}") for line in proc.stdout.splitlines())


def test_a_wrong_product_fails_the_case(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = b8.moe_kernels.grouped_mm_fp8
    monkeypatch.setattr(b8.moe_kernels, "grouped_mm_fp8", lambda *a: real(*a) * 1.05)
    with pytest.raises(AssertionError, match="grouped_mm_fp8"):
        b8.run_case(ctx, b8.cases(ctx)[0])


def test_a_wrong_recipe_product_fails_the_case(monkeypatch):
    from moe_kernels.quant import recipe

    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = recipe.grouped_mm_fp8
    monkeypatch.setattr(recipe, "grouped_mm_fp8", lambda *a: real(*a) * 1.5)
    with pytest.raises(AssertionError, match="fp8 recipe: out"):
        b8.run_case(ctx, b8.cases(ctx)[0])


def test_a_wrong_wgrad_fails_the_case(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = b8.moe_kernels.grouped_mm_fp8_wgrad
    monkeypatch.setattr(b8.moe_kernels, "grouped_mm_fp8_wgrad", lambda *a: real(*a) * 1.01)
    with pytest.raises(AssertionError, match="grouped_mm_fp8_wgrad"):
        b8.run_case(ctx, b8.cases(ctx)[0])
