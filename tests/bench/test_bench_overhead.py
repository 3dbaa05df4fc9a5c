"""bench overhead: on the CPU it runs the CUDA code path with the launches stubbed out and counts what one
MoE layer fwd+bwd issues; without MOE_KERNELS_EMULATE it says what it needs instead of timing references."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, emulate: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOE_KERNELS_EMULATE": emulate}
    cmd = [sys.executable, "-m", "bench", "overhead", "--quick", "--device", "cpu", "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_overhead_without_emulation_says_what_it_needs(tmp_path):
    proc = _run(tmp_path, "0")
    assert proc.returncode == 1
    assert "FAILED overhead on the CPU needs the CUDA code path: run with MOE_KERNELS_EMULATE=1" in proc.stdout


@pytest.mark.gpu
def test_overhead_counts_the_fused_regions(tmp_path):
    from moe_kernels import _ext

    if _ext.emulation() is None:
        pytest.skip("the CPU run of bench overhead needs the CPU-executed kernels (MOE_KERNELS_EMULATE=1)")
    proc = _run(tmp_path, "1")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["model"]: r for r in json.loads((tmp_path / "overhead_table.json").read_text())["rows"]}
    assert set(rows) == {"qwen3-30b-a3b", "deepseek-v3"}
    # qwen3-30b-a3b (softmax, aux loss): router_fused_fwd / router_fused_bwd, then the routed experts as one
    # region, moe_fwd / moe_bwd.
    q = rows["qwen3-30b-a3b"]
    assert q["layer_fused_launches"] == 2 + 2
    # The registered ops: the same router kernel, and the experts as 2 grouped_mm + swiglu forward, 4 + swiglu_bwd
    # backward instead of one call each way.
    assert q["layer_registered_launches"] == 2 + 4 + 3 + 5
    assert q["layer_torch_launches"] == 0 and q["layer_torch_aten_ops"] > q["layer_fused_aten_ops"]
    for r in rows.values():
        for path in ("fused", "registered", "torch"):
            assert r[f"layer_{path}_host_us"] > 0
        assert r["layer_ratio"] == pytest.approx(r["layer_fused_host_us"] / r["layer_registered_host_us"])
    assert "HEADLINE qwen3-30b-a3b/T64 layer fwd+bwd host (CPU, launches stubbed)" in proc.stdout
    # The FP8 recipe's layer (weight cache hit, the FP8 GEMMs as on sm_90a): router 2, the routing-only permute 1,
    # the tokens' gather into both E4M3 layouts 1, six FP8 GEMMs (forward, dgrad, wgrad of both projections) each
    # with its one dequantization-scales launch 12, the SwiGLU's FP8 producers 2, the output's unpermute 1, its
    # backward's gather into E4M3 1 and the routing weights' gradient 1, permute's backward (an unpermute) 1: 22;
    # deepseek-v3 adds its shared expert's region (2). The recipe's functions launch the same kernels on their direct
    # calls and through the registered ops; the fused region launches them (and rows_to_tokens: each permuted row's
    # slot, which the recipe's functions compute with aten ops, once for each gather) from one extension call each
    # way, moe_fp8_fwd / moe_fp8_bwd: router 2 + 2.
    for model, shared in (("qwen3-30b-a3b", 0), ("deepseek-v3", 2)):
        r = rows[model]
        assert r["layer_fp8_recipe_launches"] == r["layer_fp8_registered_launches"] == 22 + shared, r
        assert r["layer_fp8_launches"] == 4 + shared, r
        for path in ("fp8", "fp8_recipe", "fp8_registered"):
            assert r[f"layer_{path}_host_us"] > 0
    assert "HEADLINE qwen3-30b-a3b/T64 FP8 recipe layer fwd+bwd host" in proc.stdout


@pytest.mark.gpu
def test_gpu_mode_cases_run(cuda, monkeypatch):
    # The GPU mode's two cases (layer paths with host / kernel / graph time, and the gating linear beside the
    # router region) at a token count the CPU-executed kernels manage; on a GPU at the perf.md sizes.
    from bench import bench_overhead as bo
    from bench import harness as h

    ctx = h.Context(device=cuda, quick=True, out_dir=None)
    if not ctx.is_cuda:  # the CPU-executed kernels run one CUDA thread at a time: 16 experts, not 128 (k stays 8)
        for sizes in ("CPU_SIZES", "FP8_CPU_SIZES"):
            monkeypatch.setattr(bo, sizes, dict(getattr(bo, sizes), num_experts=16))
    T = 8192 if ctx.is_cuda else 64
    row = bo._gpu_case(ctx, "qwen3-30b-a3b", T)
    assert row["layer_fused_launches"] == 4 and row["layer_registered_launches"] == 14
    assert all(row[f"layer_{p}_host_us"] > 0 for p in bo.PATHS)
    gating = bo._gating_case(ctx, T=16384 if ctx.is_cuda else 16)
    assert gating["gating_host_us"] > 0 and gating["router_host_us"] > 0
