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


def test_tensor_core_peer_on_an_emulated_8_9_gpu(tmp_path):
    """Where the FP8 tensor-core portable kernel runs (here: the CPU-executed kernels of an emulated 8.9 GPU),
    the forward and wgrad rows time it by name as the `portable_mma` peer, after checking its output."""
    import os

    env = dict(os.environ, MOE_KERNELS_EMULATE="1", MOE_KERNELS_EMU_CAPABILITY="8.9")
    cmd = [sys.executable, "-m", "bench", "grouped_mm_fp8", "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_grouped_mm_fp8.json").read_text())
    assert data["failures"] == []
    for r in data["results"]:
        expected = {"moe_kernels_bf16", "portable_mma"} if r["op"] != "fp8_recipe_fwd_bwd" else {"moe_kernels_bf16"}
        assert set(r["speedup"]) == expected, (r["op"], r["speedup"])


@pytest.mark.parametrize("op", ["fwd", "wgrad"])
def test_a_wrong_tensor_core_product_fails_the_case(monkeypatch, op):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    monkeypatch.setattr(b8, "_tensor_core_kernel_runs", lambda ctx: True)
    if op == "fwd":
        monkeypatch.setattr(b8, "_tensor_core_fwd", lambda *a: b8.moe_kernels.grouped_mm_fp8(*a) * 1.05)
    else:
        monkeypatch.setattr(b8, "_tensor_core_fwd", lambda *a: b8.moe_kernels.grouped_mm_fp8(*a))
        monkeypatch.setattr(b8, "_tensor_core_wgrad", lambda *a: b8.moe_kernels.grouped_mm_fp8_wgrad(*a) * 1.01)
    with pytest.raises(AssertionError, match="FP8 tensor-core portable kernel"):
        b8.run_case(ctx, b8.cases(ctx)[0])


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


def test_instance_peers_launch_every_fp8_instance_of_the_product(monkeypatch):
    """On an H100/H200 the forward and wgrad rows time every FP8 instance of their product, forced by id
    (`instance:<name>` peers). Faked here: a Hopper capability, an extension whose kernel list is the real one,
    and a launcher that records what each timed call would run."""
    import importlib
    from types import SimpleNamespace

    from moe_kernels import _ext

    g8 = importlib.import_module("moe_kernels.ops.grouped_mm_fp8")  # the module, not the op of that name

    real = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    case = b8.cases(real)[0]
    sets = [b8._inputs(real, case, seed) for seed in (0, 1)]
    kernels = (_ext._C or _ext._EMU).grouped_mm_sm90_kernels()
    launched = []

    def launch(C, op, a, b, out, sfa, sfb, sizes, M, N, K, kernel=-1, raster=-1, accumulate=False, group_order=-1):
        launched.append((op, kernel, tuple(out.shape), out.dtype, (M, N, K), a.data_ptr()))
        return True

    monkeypatch.setattr(_ext, "_C", SimpleNamespace(grouped_mm_has_sm90=True, grouped_mm_sm90_kernels=lambda: kernels))
    monkeypatch.setattr(g8, "_launch_fp8", launch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ctx = SimpleNamespace(is_cuda=True, device=torch.device("cpu"),
                          time=lambda fn, inputs: [fn(*args) for args in inputs] and "timing")
    for op, out_dtype, out_code in ((0, torch.bfloat16, 2), (2, torch.float32, 0)):
        launched.clear()
        peers = b8._instance_peers(ctx, op, out_dtype, sets)
        serving = [i for i, k in enumerate(kernels) if (k["dtype"], k["op"], k["out"]) == (3, op, out_code)]
        assert set(peers) == {f"instance:{kernels[i]['name']}" for i in serving} and set(peers.values()) == {"timing"}
        assert any("pingpong" in p for p in peers) and len(peers) >= 2, peers
        assert [(k, o) for o, k, *_ in launched] == [(i, op) for i in serving for _ in sets]
        for (_, _, shape, dtype, (M, N, K), a_ptr), s in zip(launched, sets * len(serving)):
            if op == 0:
                xq, _, wq, _, _ = s["fp8"]
                assert (M, N, K) == (xq.shape[0], wq.shape[1], xq.shape[1]) and a_ptr == xq.data_ptr()
                assert shape == (M, N) and dtype == torch.bfloat16
            else:
                aq, _, bq, _, sizes = s["wgrad"]
                assert (M, N, K) == (aq.shape[1], aq.shape[0], bq.shape[0]) and a_ptr == aq.data_ptr()
                assert shape == (sizes.shape[0], N, K) and dtype == torch.float32
    # Off Hopper (or without the instances built) no instance is timed.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert b8._instance_peers(ctx, 0, torch.bfloat16, sets) == {}
