"""The benchmark suite: the CPU quick run works end to end in seconds and writes what perf.md asks
for; its torch-eager peers compute the op; a wrong result is reported instead of timed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import harness

ROOT = Path(__file__).resolve().parents[2]
OPS = {"permute_fwd", "unpermute_fwd", "permute_bwd", "unpermute_bwd"}
ROUTER_OPS = {"router_topk_fwd", "router_topk_fwd_bwd"}


# ---------------------------------------------------------------------------------------------------
# grouped_mm

from bench import bench_grouped_mm as bg  # noqa: E402
from moe_kernels.ops.grouped_mm import (grouped_mm_dgrad_reference, grouped_mm_reference,  # noqa: E402
                                        grouped_mm_wgrad_reference)

GMM_OPS = {"grouped_mm_fwd", "grouped_mm_dgrad", "grouped_mm_wgrad"}


def _cpu_ctx(out_dir=Path(".")):
    return harness.Context(torch.device("cpu"), quick=True, out_dir=out_dir)


@pytest.fixture(scope="module")
def gmm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_grouped_mm")
    cmd = [sys.executable, "-m", "bench", "grouped_mm", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_grouped_mm_json_has_metadata_and_results(gmm_run):
    out, _ = gmm_run
    data = json.loads((out / "bench_grouped_mm.json").read_text())
    meta = data["meta"]
    for key in ("date", "device_name", "driver", "cuda", "torch", "commit", "has_cuda_kernels", "ours"):
        assert key in meta, key
    assert data["suite"] == "grouped_mm" and meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["matmul_bf16_tflops"] > 0
    assert data["failures"] == []

    results = data["results"]
    assert {r["op"] for r in results} == GMM_OPS
    cases = bg.cases(_cpu_ctx(out))
    by_name = {c.name: c for c in cases}
    assert {(r["case"], r["op"]) for r in results} == {(c, op) for c in by_name for op in GMM_OPS}
    assert any(r["shape"]["empty"] > 0 for r in results)  # the zipf split includes empty experts
    torch_peer = bg.torch_peer_status(_cpu_ctx(out))
    for r in results:
        c = by_name[r["case"]]
        s = r["shape"]
        assert (s["E"], s["M"], s["N"], s["K"], s["EP"]) == (c.E, c.M, c.N, c.K, c.EP)
        assert set(s) == {"T", "EP", "E", "M", "N", "K", "min_rows", "max_rows", "empty"}
        assert (s["empty"] > 0) == ("/zipf/" in r["case"]) and s["min_rows"] <= s["max_rows"]
        for key in ("us", "p20_us", "p80_us", "bytes", "flops", "gbps", "tflops", "pct_of_ceiling", "pct_of_dense"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20_us"] <= r["us"] <= r["p80_us"]
        assert r["flops"] == 2 * s["M"] * s["N"] * s["K"] and r["tflops"] > 0 and r["bytes"] > 0
        assert r["dtype"] == "bfloat16" and r["ceiling"] in ("copy", "matmul_bf16")
        assert r["kernel_path"] == "reference"  # the CPU runs moe_kernels' reference
        assert {"expert_loop", "dense_mm", "reference"} <= set(r["speedup"])
        op = r["op"].removeprefix("grouped_mm_")
        if torch_peer[op] is None:
            assert "torch_grouped_mm" in r["speedup"] and r["peer_skipped"] == {}
        else:
            assert "torch_grouped_mm" not in r["speedup"] and r["peer_skipped"]["torch_grouped_mm"]
        assert all(v > 0 and math.isfinite(v) for v in r["speedup"].values())
        assert all(v >= 0 and math.isfinite(v) for v in r["peer_us"].values())
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()
        assert r["pct_of_dense"] == pytest.approx(100 * r["speedup"]["dense_mm"])

    headline = data["headline"]
    for op in GMM_OPS:
        assert sum(line.startswith(f"{op}: ") and bg.BAR_TORCH in line for line in headline) == 1, op
        assert sum(line.startswith(f"{op}: % of dense cuBLAS where groups hold >= ") and bg.BAR_DENSE in line
                   for line in headline) == 1, op
    if all(v is None for v in torch_peer.values()):
        assert all("x torch._grouped_mm geomean over" in line for line in headline if bg.BAR_TORCH in line)


def test_grouped_mm_png_and_stdout(gmm_run):
    out, stdout = gmm_run
    assert (out / "bench_grouped_mm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bench_grouped_mm.json").read_text())
    lines = stdout.splitlines()
    result_lines = [line for line in lines if line.startswith("RESULT ")]
    assert len(result_lines) == len(data["results"])
    assert all("us=" in line and "TFLOP/s=" in line and "expert_loop=" in line and "dense_mm=" in line
               for line in result_lines)
    for op in GMM_OPS:
        assert any(line.startswith(f"GEOMEAN {op} vs expert_loop") for line in lines), op
        assert any(line.startswith(f"HEADLINE {op}: ") and bg.BAR_TORCH in line for line in lines), op
        assert any(line.startswith(f"HEADLINE {op}: % of dense cuBLAS") for line in lines), op
    assert not any(line.startswith("FAILED") for line in lines)


@pytest.mark.parametrize("E,M", [(1, 7), (4, 64), (8, 1000), (128, 16384)])
def test_grouped_mm_splits(E, M):
    uniform = bg.split_rows(M, E, "uniform")
    assert sum(uniform) == M and len(uniform) == E and max(uniform) - min(uniform) <= 1
    zipf = bg.split_rows(M, E, "zipf", seed=3)
    assert sum(zipf) == M and len(zipf) == E and all(n >= 0 for n in zipf)
    assert zipf == bg.split_rows(M, E, "zipf", seed=3)  # seeded
    if E > 1:
        assert sum(n == 0 for n in zipf) >= max(1, E // bg.EMPTY_FRACTION)  # empty experts included
        assert max(zipf) > M / E  # a hot expert


def test_grouped_mm_peers_match_reference():
    sizes = (9, 0, 31, 24)
    gs = torch.tensor(sizes, dtype=torch.int32)
    E, M, N, K = len(sizes), sum(sizes) + 3, 32, 48  # three rows past the groups
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K) / K**0.5).to(torch.bfloat16)
    dout = torch.randn(M, N, dtype=torch.bfloat16)
    s = {"x": x, "w": w, "dout": dout, "offs": torch.cumsum(gs, 0, dtype=torch.int32)}
    refs = {"fwd": grouped_mm_reference, "dgrad": grouped_mm_dgrad_reference, "wgrad": grouped_mm_wgrad_reference}
    status = bg.torch_peer_status(_cpu_ctx())
    n = sum(sizes)
    for op in bg.OPS:
        a, b = bg._operands(op, s)
        ref = refs[op](a, b, gs)
        loop = bg.expert_loop(op, sizes)(a, b)
        if op == "wgrad":
            assert bool((loop[1] == 0).all())  # the empty expert's dw is zero
            harness.check_peer(f"expert_loop {op}", loop, ref)
        else:
            harness.check_peer(f"expert_loop {op}", loop[:n], ref[:n])
        if op == "dgrad":
            assert bool((loop[n:] == 0).all())
        if status[op] is None:
            out = bg.TORCH_GROUPED_MM[op](a, b, s["offs"])
            assert out.shape == ref.shape
            bg.check_close(f"torch._grouped_mm {op}", bg._rows(op, out, n), bg._rows(op, ref, n))
        fn, operands = bg.dense_mm(op)
        dense = fn(*operands({**s, "wd": w[0]}))
        inner = {"fwd": K, "dgrad": N, "wgrad": M}[op]
        assert 2 * dense.numel() * inner == 2 * M * N * K  # equal FLOPs (over all M rows here)


def test_grouped_mm_check_close_scales_with_magnitude():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 4096, dtype=torch.float64, generator=g) * 200  # wgrad-like magnitudes
    ref[0, :64] = 1e-4  # near-zero outputs, where an fp32 accumulation-order difference dominates
    near = ref.clone()
    near[0, :64] += 1e-3
    bg.check_close("noise", near.to(torch.bfloat16), ref.to(torch.bfloat16))
    with pytest.raises(AssertionError):  # torch's fixed bf16 atol of 1e-5 assumes outputs of magnitude ~1
        torch.testing.assert_close(near.to(torch.bfloat16), ref.to(torch.bfloat16))
    wrong = ref.to(torch.bfloat16).clone()
    wrong[5] = wrong[6]
    with pytest.raises(AssertionError, match=r"first at \(5, "):
        bg.check_close("row", wrong, ref.to(torch.bfloat16))


def test_grouped_mm_fp64_check():
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    w = (torch.randn(2, 16, 32) / 32**0.5).to(torch.bfloat16)
    gs = torch.tensor([15, 25], dtype=torch.int32)
    ref64 = grouped_mm_reference(x.double(), w.double(), gs)
    base = grouped_mm_reference(x, w, gs)
    bg.check_fp64("same", base, base, ref64)
    with pytest.raises(AssertionError, match="max error"):
        bg.check_fp64("off", (base.double() + 0.05).to(torch.bfloat16), base, ref64)


def test_grouped_mm_wrong_result_is_reported_not_timed(monkeypatch, tmp_path):
    def swapped_wgrad(dout, x, group_sizes):
        return grouped_mm_wgrad_reference(dout, x, group_sizes).flip(0)

    monkeypatch.setitem(bg.OURS, "wgrad", swapped_wgrad)
    ctx = _cpu_ctx(tmp_path)
    rep = bg.run(ctx)
    n = len(bg.cases(ctx))
    assert len(rep.failures) == n and all("grouped_mm_wgrad" in f and "vs " in f for f in rep.failures)
    assert {r.op for r in rep.results} == {"grouped_mm_fwd", "grouped_mm_dgrad"} and len(rep.results) == 2 * n
    assert any(line == f"grouped_mm_wgrad: no case timed (see FAILED) (bar: {bg.BAR_TORCH})" for line in rep.headline)
    json_path, png_path = harness.report(ctx, "grouped_mm", rep)
    assert json.loads(json_path.read_text())["failures"] == rep.failures and png_path.exists()


def test_grouped_mm_torch_peer_left_out_with_reason(monkeypatch, tmp_path):
    def unsupported(dout, w, offs):
        raise RuntimeError("grouped gemm is not supported here")

    monkeypatch.setitem(bg.TORCH_GROUPED_MM, "dgrad", unsupported)
    ctx = _cpu_ctx(tmp_path)
    assert bg.torch_peer_status(ctx)["dgrad"] == "RuntimeError: grouped gemm is not supported here"
    rep = bg.run(ctx)
    assert rep.failures == [] and len(rep.results) == 3 * len(bg.cases(ctx))
    for r in rep.results:
        if r.op == "grouped_mm_dgrad":
            assert "torch_grouped_mm" not in r.speedup and "not supported" in r.peer_skipped["torch_grouped_mm"]
            assert {"expert_loop", "dense_mm"} <= set(r.speedup)
    assert any(line.startswith("grouped_mm_dgrad: torch._grouped_mm not timed (RuntimeError") for line in rep.headline)
    assert "note: torch_grouped_mm not timed for grouped_mm_dgrad: RuntimeError: grouped gemm is not supported here" \
        in rep.headline


@pytest.mark.gpu
def test_grouped_mm_wgrad_expert_order_peer(cuda):
    """The expert-order peer (ours with group_order=0) computes wgrad: equal to ours bit for bit, zeros for the
    empty experts, whatever the fresh output held (on the CPU-executed build the portable kernel has no order,
    so this checks the launch; on an H100/H200 the CUTLASS scheduler's two orders)."""
    c = bg.Case("tiny", 64, *bg.CPU_MODELS["tiny"], "zipf", "w13")
    sizes = c.sizes(0)
    gs = torch.tensor(sizes, dtype=torch.int32, device=cuda)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(c.M, c.N, generator=g).to(torch.bfloat16).to(cuda)
    x = torch.randn(c.M, c.K, generator=g).to(torch.bfloat16).to(cuda)
    got = bg.wgrad_expert_order(c, gs)(dout, x)
    assert torch.equal(got, torch.ops.moe_kernels.grouped_mm_wgrad(dout, x, gs))
    ref = grouped_mm_wgrad_reference(dout.double(), x.double(), gs)
    # One bf16 rounding of each fp32 sum (relative 2^-9, rtol 10x that); the fp32 sums of <= 256 products of
    # unit normals err by ~1e-5, far below atol.
    assert torch.allclose(got.double(), ref, rtol=2e-2, atol=2e-2)
    for e in [e for e, n in enumerate(sizes) if n == 0]:
        assert bool((got[e] == 0).all())


@pytest.mark.long
@pytest.mark.gpu
def test_grouped_mm_expert_order_peer_and_headline(cuda, monkeypatch, tmp_path):
    """Where ours runs its kernels, wgrad gets the expert-order peer and one headline line per routing (here the
    CPU-executed kernels stand in for a GPU's: the kernel path is forced, so the code a GPU run takes runs)."""
    if cuda.type != "cpu":
        pytest.skip("a GPU runs this in the bench itself")
    monkeypatch.setattr(bg, "kernel_path", lambda *a: "portable")
    ctx = _cpu_ctx(tmp_path)
    rep = bg.run(ctx)
    assert rep.failures == []
    wgrad = [r for r in rep.results if r.op == "grouped_mm_wgrad"]
    assert wgrad and all("expert_order" in r.speedup and r.speedup["expert_order"] > 0 for r in wgrad)
    assert not any("expert_order" in r.speedup for r in rep.results if r.op != "grouped_mm_wgrad")
    assert all(r.speedup.get("portable_mma", 0) > 0 and r.speedup.get("portable_mma_2_stages", 0) > 0
               for r in rep.results), "the tensor-core portable kernel at its default and at 2 stages"
    lines = [line for line in rep.headline if "largest first vs expert order" in line]
    assert len(lines) == len(bg.ROUTINGS) and all("geomean over" in line for line in lines)
