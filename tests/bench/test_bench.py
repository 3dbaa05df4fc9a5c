"""The benchmark suite: the CPU quick run works end to end in seconds and writes what perf.md asks
for; its torch-eager peers compute the op; a wrong result is reported instead of timed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_permute as bp
from bench import bench_router as br
from bench import harness
from moe_kernels.ops.permute import permute_reference, unpermute_reference
from moe_kernels.ops.router import router_topk_bwd_reference
from moe_kernels.testing import assert_exact, random_routing

ROOT = Path(__file__).resolve().parents[2]
OPS = {"permute_fwd", "unpermute_fwd", "permute_bwd", "unpermute_bwd"}
ROUTER_OPS = {"router_topk_fwd", "router_topk_fwd_bwd"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "bench", "permute", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_json_has_metadata_and_results(quick_run):
    out, _ = quick_run
    data = json.loads((out / "bench_permute.json").read_text())
    meta = data["meta"]
    for key in ("date", "device_name", "driver", "cuda", "torch", "commit", "has_cuda_kernels", "ours"):
        assert key in meta, key
    assert meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["matmul_bf16_tflops"] > 0
    assert data["failures"] == []
    assert data["headline"] and data["headline"][0].startswith("permute_fwd ")

    results = data["results"]
    assert {r["op"] for r in results} == OPS
    cases = {r["case"] for r in results}
    assert any("/zipf" in c for c in cases) and any("/empty" in c for c in cases)
    assert any("/align128" in c for c in cases)
    for r in results:
        for key in ("us", "p20_us", "p80_us", "bytes", "gbps", "pct_of_ceiling"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20_us"] <= r["us"] <= r["p80_us"]
        assert r["bytes"] > 0 and r["ceiling"] == "copy" and r["dtype"] == "bfloat16"
        assert set(r["shape"]) == {"T", "H", "E", "k", "align"}
        assert "torch_eager" in r["speedup"] and all(s > 0 for s in r["speedup"].values())
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()


def test_png_and_stdout(quick_run):
    out, stdout = quick_run
    assert (out / "bench_permute.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bench_permute.json").read_text())
    result_lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(result_lines) == len(data["results"])
    assert all("us=" in line and "GB/s=" in line and "torch_eager=" in line for line in result_lines)
    assert any(line.startswith("HEADLINE permute_fwd ") for line in stdout.splitlines())
    assert any(line.startswith("GEOMEAN permute_fwd vs torch_eager") for line in stdout.splitlines())


@pytest.mark.parametrize("align", [1, 4])
def test_eager_peers_match_reference(align):
    T, H, E, k = 37, 24, 6, 3
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = random_routing(T, E, k, kind="zipf", drop=0.2, seed=align)
    ref_perm, ref_map, ref_sizes = permute_reference(x, idx, E, align)
    x_perm, row_map, sizes = bp.eager_permute(x, idx, E, align)
    n = int(ref_sizes.sum())
    assert x_perm.shape == ref_perm.shape
    assert_exact(row_map, ref_map, "row_map")
    assert_exact(sizes, ref_sizes, "group_sizes")
    assert_exact(x_perm[:n], ref_perm[:n], "x_perm")
    w = torch.rand(T, k)
    ref = unpermute_reference(ref_perm, ref_map, w)
    for fn in (bp.eager_unpermute_index_add, bp.eager_unpermute_gather_sum):
        harness.check_peer(fn.__name__, fn(ref_perm, ref_map, w), ref)


def test_wrong_result_is_reported_not_timed(monkeypatch, tmp_path):
    def shuffled_permute(x, indices, num_experts, align=1):
        x_perm, row_map, sizes = permute_reference(x, indices, num_experts, align)
        return x_perm.flip(0), row_map, sizes

    monkeypatch.setattr(bp, "OURS", bp.Impl(shuffled_permute, bp.OURS.unpermute, backward=True))
    ctx = harness.Context(device=torch.device("cpu"), quick=True, out_dir=tmp_path)
    rep = bp.run(ctx)
    assert rep.results == [] and len(rep.failures) == len(bp.cases(ctx))
    assert all("x_perm" in f for f in rep.failures)
    json_path, png_path = harness.report(ctx, "permute", rep)
    assert json.loads(json_path.read_text())["failures"] == rep.failures and png_path.exists()


# ---------------------------------------------------------------------------------------------------
# router


@pytest.fixture(scope="module")
def router_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_router")
    cmd = [sys.executable, "-m", "bench", "router", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_router_json_has_metadata_and_results(router_run):
    out, _ = router_run
    data = json.loads((out / "bench_router.json").read_text())
    meta = data["meta"]
    for key in ("date", "device_name", "driver", "cuda", "torch", "commit", "has_cuda_kernels", "ours"):
        assert key in meta, key
    assert data["suite"] == "router" and meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["matmul_bf16_tflops"] > 0
    assert data["failures"] == []
    headline = data["headline"][0]
    assert headline.startswith("router_topk_fwd_bwd ") and "x torch eager" in headline and br.BAR in headline

    results = data["results"]
    assert {r["op"] for r in results} == ROUTER_OPS
    cases = {r["case"] for r in results}
    assert cases == {c.name for c in br.cases(harness.Context(torch.device("cpu"), quick=True, out_dir=out))}
    assert {r["dtype"] for r in results} == {"float32", "bfloat16"}
    for r in results:
        for key in ("us", "p20_us", "p80_us", "bytes", "gbps", "pct_of_ceiling"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20_us"] <= r["us"] <= r["p80_us"]
        assert r["bytes"] > 0 and r["flops"] == 0 and r["tflops"] is None and r["ceiling"] == "copy"
        assert set(r["shape"]) == {"T", "E", "k", "groups", "group_topk"}
        assert set(r["speedup"]) == {"torch_eager", "reference"}
        assert all(s > 0 and math.isfinite(s) for s in r["speedup"].values())
        assert all(t >= 0 and math.isfinite(t) for t in r["peer_us"].values())
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()
    # fwd+bwd moves the forward's bytes and the backward's: strictly more than the forward alone.
    by_case = {(r["case"], r["op"]): r["bytes"] for r in results}
    assert all(by_case[(c, "router_topk_fwd_bwd")] > by_case[(c, "router_topk_fwd")] for c in cases)


def test_router_png_and_stdout(router_run):
    out, stdout = router_run
    assert (out / "bench_router.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bench_router.json").read_text())
    lines = stdout.splitlines()
    result_lines = [line for line in lines if line.startswith("RESULT ")]
    assert len(result_lines) == len(data["results"])
    assert all("us=" in line and "GB/s=" in line and "torch_eager=" in line for line in result_lines)
    assert any(line.startswith("HEADLINE router_topk_fwd_bwd ") for line in lines)
    assert any(line.startswith("GEOMEAN router_topk_fwd_bwd vs torch_eager") for line in lines)
    assert not any(line.startswith("FAILED") for line in lines)


@pytest.mark.parametrize("model", [*br.CPU_MODELS, *br.MODELS])
def test_eager_router_matches_reference(model):
    E, k, r = {**br.CPU_MODELS, **br.MODELS}[model]
    c = br.Case(model, 33, E, k, r)
    s = br.make_inputs(harness.Context(torch.device("cpu"), quick=True, out_dir=Path(".")), c, seed=3)
    ref_w, ref_idx = br.reference_router_topk(s["logits"], s["expert_bias"], k, r)
    x = s["logits"].clone().requires_grad_()
    w, idx = br.eager_router_topk(x, s["expert_bias"], k, r)
    assert_exact(idx.to(torch.int32), ref_idx, "indices")  # fp32 randn logits: no ties
    harness.check_peer("weights", w, ref_w)
    (g,) = torch.autograd.grad(w, x, s["grad_weights"])
    ref_g = router_topk_bwd_reference(s["grad_weights"], s["logits"], ref_idx, r.score, r.pre_softmax,
                                      r.normalize, r.scaling_factor)
    harness.check_peer("grad logits", g, ref_g)
    assert br.check(c, s, "torch_eager", br.Impl(br.eager_router_topk, backward=True)) == 0
    assert br.check(c, s, "ours", br.OURS) == 0


@pytest.mark.parametrize("model", [*br.CPU_MODELS, *br.MODELS])
def test_eager_router_bf16_logits(model):
    # bf16 logits tie often; torch.topk may break a tie differently, which check() allows for a peer.
    E, k, r = {**br.CPU_MODELS, **br.MODELS}[model]
    c = br.Case(model, 33, E, k, r, torch.bfloat16)
    s = br.make_inputs(harness.Context(torch.device("cpu"), quick=True, out_dir=Path(".")), c, seed=3)
    assert s["logits"].dtype == torch.bfloat16
    assert br.check(c, s, "torch_eager", br.Impl(br.eager_router_topk, backward=True)) < c.T
    assert br.check(c, s, "ours", br.OURS) == 0


def test_router_peer_may_break_exact_ties_only():
    E, k, r = br.CPU_MODELS["tiny-softmax"]
    c = br.Case("tiny-softmax", 4, E, k, r)
    logits = torch.randn(4, E)
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1  # an exact tie at the top: the reference takes 3 first
    s = {"logits": logits, "expert_bias": None, "grad_weights": torch.randn(4, k)}

    def tie_to_higher(x, bias, k, r):
        w, idx = br.reference_router_topk(x, bias, k, r)
        swap = torch.tensor([1, 0, *range(2, k)])
        return torch.cat([w[:1, swap], w[1:]]), torch.cat([idx[:1, swap], idx[1:]])

    def wrong(x, bias, k, r):
        w, idx = br.reference_router_topk(x, bias, k, r)
        return w, torch.cat([idx[:1, [0, 2, 1, *range(3, k)]], idx[1:]])

    assert br.check(c, s, "peer", br.Impl(tie_to_higher, backward=True)) == 1
    with pytest.raises(AssertionError, match="not tied"):
        br.check(c, s, "peer", br.Impl(wrong, backward=True))


def _swap_first_two_slots_of_token0(x, bias, k, r):
    w, idx = br.ours_router_topk(x, bias, k, r)
    swap = torch.tensor([1, 0, *range(2, k)])
    return torch.cat([w[:1, swap], w[1:]]), torch.cat([idx[:1, swap], idx[1:]])


def test_router_wrong_result_is_reported_not_timed(monkeypatch, tmp_path):
    monkeypatch.setattr(br, "OURS", br.Impl(_swap_first_two_slots_of_token0, backward=True))
    ctx = harness.Context(device=torch.device("cpu"), quick=True, out_dir=tmp_path)
    rep = br.run(ctx)  # T=64: a tolerance of 1e-4 of the tokens allows none
    assert rep.results == [] and rep.headline == [] and len(rep.failures) == len(br.cases(ctx))
    assert all("indices: 1 of 64 tokens differ" in f for f in rep.failures)
    json_path, png_path = harness.report(ctx, "router", rep)
    assert json.loads(json_path.read_text())["failures"] == rep.failures and png_path.exists()


def test_router_index_mismatch_within_tolerance_is_noted(monkeypatch, tmp_path):
    monkeypatch.setattr(br, "OURS", br.Impl(_swap_first_two_slots_of_token0, backward=True))
    monkeypatch.setattr(br, "IDX_TOKEN_TOL", 1 / 64)
    ctx = harness.Context(device=torch.device("cpu"), quick=True, out_dir=tmp_path)
    rep = br.run(ctx)
    assert rep.failures == [] and len(rep.results) == 2 * len(br.cases(ctx))
    assert rep.headline[0].startswith("router_topk_fwd_bwd ")
    notes = rep.headline[1:]
    assert len(notes) == len(br.cases(ctx))
    assert all(n.startswith("note: ") and "differ from the reference on 1 of 64 tokens" in n for n in notes)
    json_path, _ = harness.report(ctx, "router", rep)
    assert json.loads(json_path.read_text())["headline"] == rep.headline


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


# ---------------------------------------------------------------------------------------------------
# moe_layer

from bench import bench_moe_layer as bml  # noqa: E402

LAYER_OPS = {"moe_layer_fwd", "moe_layer_fwd_bwd"}


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory):
    pytest.importorskip("transformers", minversion="5.0")
    out = tmp_path_factory.mktemp("bench_moe_layer")
    cmd = [sys.executable, "-m", "bench", "moe_layer", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def _tiny_layer(name="tiny-qwen3-30b-a3b"):
    spec = bml.CPU_MODELS[name]
    ctx = _cpu_ctx()
    cfg, _ = bml.fit_config(ctx, spec, 64)
    layer = bml.build_ours(ctx, cfg)
    x, dout = bml.make_inputs(ctx, cfg, 64, seed=5)
    return spec, cfg, layer, x, dout


def test_moe_layer_json_has_metadata_and_results(layer_run):
    out, _ = layer_run
    data = json.loads((out / "bench_moe_layer.json").read_text())
    meta = data["meta"]
    for key in ("date", "device_name", "driver", "cuda", "torch", "commit", "has_cuda_kernels", "ours"):
        assert key in meta, key
    assert data["suite"] == "moe_layer" and meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["matmul_bf16_tflops"] > 0
    assert data["failures"] == []

    results = data["results"]
    assert {r["op"] for r in results} == LAYER_OPS
    assert {(r["case"], r["op"]) for r in results} == {(f"{m}/T{bml.CPU_TOKENS[0]}", op)
                                                      for m in bml.CPU_MODELS for op in LAYER_OPS}
    for r in results:
        s, spec = r["shape"], bml.CPU_MODELS[r["case"].split("/")[0]]
        assert set(s) == {"T", "H", "E", "k", "F", "F_shared"} and r["model"] == spec.preset
        for key in ("us", "p20_us", "p80_us", "bytes", "flops", "gbps", "tflops", "pct_of_ceiling", "tokens_per_s"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20_us"] <= r["us"] <= r["p80_us"] and r["bytes"] > 0 and r["tflops"] > 0
        fwd = 2 * s["T"] * (s["k"] * 3 * s["H"] * s["F"] + 3 * s["H"] * s["F_shared"] + s["H"] * s["E"])
        assert r["flops"] == (fwd if r["op"] == "moe_layer_fwd" else 3 * fwd)
        assert r["tokens_per_s"] == pytest.approx(s["T"] / (r["us"] * 1e-6))
        assert r["dtype"] == "bfloat16" and r["ceiling"] in ("copy", "matmul_bf16")
        assert (s["F_shared"] > 0) == (spec.preset == "deepseek-v3") and r["setup"]
        assert set(r["speedup"]) == set(bml.PEERS) and r["peer_skipped"] == {}  # every peer runs on the CPU
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()
        assert all(v > 0 and math.isfinite(v) for v in r["speedup"].values())
        assert all(v >= 0 and math.isfinite(v) for v in r["peer_us"].values())
        assert 'experts_implementation="eager"' in r["peer_variant"]["hf_eager"]
        assert 'experts_implementation="grouped_mm"' in r["peer_variant"]["hf_grouped_mm"]
        assert set(r["routing_agreement"]) == set(bml.PEERS)
        assert all(0.9 <= f <= 1 for f in r["routing_agreement"].values())
        assert r["reps"] == {p: 3 for p in ("ours", *bml.PEERS)}  # the CPU quick run's reps
    by_case = {(r["case"], r["op"]): r for r in results}
    for case in {r["case"] for r in results}:  # fwd+bwd moves and computes more than the forward
        assert by_case[(case, "moe_layer_fwd_bwd")]["bytes"] > by_case[(case, "moe_layer_fwd")]["bytes"]

    headline = data["headline"]
    for preset in bml.HEADLINE_PRESETS:
        for peer, bar in bml.BARS.items():
            assert sum(line.startswith(f"moe_layer_fwd_bwd tiny-{preset}/T") and f"x {peer} (" in line
                       and f"(bar: >= {bar:g}x {peer})" in line for line in headline) == 1, (preset, peer)
    assert any(line.startswith("note: tiny-deepseek-v3: E=8 routed experts") for line in headline)
    assert any(line.startswith("note: routing agreement with ours") for line in headline)


def test_moe_layer_png_and_stdout(layer_run):
    out, stdout = layer_run
    assert (out / "bench_moe_layer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bench_moe_layer.json").read_text())
    lines = stdout.splitlines()
    result_lines = [line for line in lines if line.startswith("RESULT ")]
    assert len(result_lines) == len(data["results"])
    assert all("us=" in line and "TFLOP/s=" in line and all(f"{p}=" in line for p in bml.PEERS)
               for line in result_lines)
    for op in LAYER_OPS:
        for p in bml.PEERS:
            assert any(line.startswith(f"GEOMEAN {op} vs {p}:") for line in lines), (op, p)
    for preset in bml.HEADLINE_PRESETS:
        for peer in bml.BARS:
            assert any(line.startswith(f"HEADLINE moe_layer_fwd_bwd tiny-{preset}/") and f"x {peer} (" in line
                       for line in lines), (preset, peer)
    assert not any(line.startswith("FAILED") for line in lines)


@pytest.mark.parametrize("name", list(bml.CPU_MODELS))
def test_moe_layer_peers_share_weights_and_agree(name):
    pytest.importorskip("transformers", minversion="5.0")
    spec, cfg, layer, x, dout = _tiny_layer(name)
    peers, skipped = bml.build_peers(layer, spec)
    assert skipped == {} and set(peers) == set(bml.PEERS)
    ours = {id(p) for p in layer.parameters()}
    for p, impl in peers.items():
        # the experts (and shared experts) are our tensors; only the Qwen3/Mixtral router is a bf16 copy
        others = {id(t) for t in impl.params()} - ours
        assert others == (set() if impl.fp32_router else {id(impl.router_weight)}), p
        assert {id(layer.experts.w13), id(layer.experts.w2)} <= {id(t) for t in impl.params()}, p
        assert (impl.router_weight is layer.router.weight) == impl.fp32_router, p
        assert bml.check_peer(name, layer, impl, x, dout) >= 0.9
    assert peers["hf_eager"].module.experts.config._experts_implementation == "eager"
    assert peers["hf_grouped_mm"].module.experts.config._experts_implementation == "grouped_mm"


def test_moe_layer_check_catches_swapped_gate_up():
    pytest.importorskip("transformers", minversion="5.0")
    spec, cfg, layer, x, dout = _tiny_layer()
    peers, _ = bml.build_peers(layer, spec)
    hf_peer = peers["hf_grouped_mm"]
    F_ = cfg.ffn_size
    w13 = layer.experts.w13.detach()
    hf_peer.module.experts.gate_up_proj = torch.nn.Parameter(torch.cat([w13[:, F_:], w13[:, :F_]], dim=1))
    with pytest.raises(AssertionError, match="output on the"):
        bml.check_peer("tiny", layer, hf_peer, x, dout)


def test_moe_layer_close_policy():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(256, 512, generator=g)
    noise = ref + 2.0**-8 * torch.randn(256, 512, generator=g)  # bf16-rounding-sized differences
    bml._close("noise", noise.to(torch.bfloat16), ref.to(torch.bfloat16))
    few = noise.clone()
    few[0, :5] += 0.05  # 5 of 131072 elements just past the elementwise bound: allowed
    bml._close("few", few, ref)
    with pytest.raises(AssertionError, match="worst"):
        far = noise.clone()
        far[3, 7] += 1.0  # one element far off
        bml._close("far", far, ref)
    with pytest.raises(AssertionError, match="relative L2 error"):
        wrong = noise.clone()
        wrong[:, :16] = 0  # a slice of the output lost
        bml._close("wrong", wrong, ref)
    with pytest.raises(AssertionError):
        bml._close("nan", torch.where(ref > 3, torch.nan, ref), ref)


def test_moe_layer_wrong_result_is_reported_not_timed(monkeypatch, tmp_path):
    pytest.importorskip("transformers", minversion="5.0")

    class Off(bml.Impl):
        def forward(self, x):
            out, aux = super().forward(x)
            return out * 1.1, aux

    monkeypatch.setattr(bml, "ours_impl", lambda layer: Off("ours", layer, "off by 10%", layer.router.weight, None))
    ctx = _cpu_ctx(tmp_path)
    rep = bml.run(ctx)
    assert rep.results == [] and len(rep.failures) == len(bml.CPU_MODELS)
    assert all("vs torch_native output on the" in f for f in rep.failures)
    assert all(line.startswith(("moe_layer_fwd_bwd", "note:")) for line in rep.headline)
    assert sum("no case timed" in line for line in rep.headline) == len(bml.HEADLINE_PRESETS)
    json_path, png_path = harness.report(ctx, "moe_layer", rep)
    assert json.loads(json_path.read_text())["failures"] == rep.failures and png_path.exists()


def test_moe_layer_peer_left_out_with_reason(monkeypatch, tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    real = bml.build_hf

    def no_grouped_mm(layer, family, implementation, bf16_router):
        if implementation == "grouped_mm":
            raise RuntimeError("grouped_mm experts unavailable here")
        return real(layer, family, implementation, bf16_router)

    monkeypatch.setattr(bml, "build_hf", no_grouped_mm)
    monkeypatch.setattr(bml, "CPU_MODELS", {"tiny-qwen3-30b-a3b": bml.CPU_MODELS["tiny-qwen3-30b-a3b"]})
    rep = bml.run(_cpu_ctx(tmp_path))
    assert rep.failures == [] and len(rep.results) == 2
    for r in rep.results:
        assert set(r.speedup) == {"torch_native", "hf_eager"}
        assert r.peer_skipped == {"hf_grouped_mm": "RuntimeError: grouped_mm experts unavailable here"}
    assert any("hf_grouped_mm not timed (RuntimeError" in line and "(bar: >= 1.3x hf_grouped_mm)" in line
               for line in rep.headline)
    assert "note: hf_grouped_mm not timed at tiny-qwen3-30b-a3b/T64: RuntimeError: grouped_mm experts " \
           "unavailable here" in rep.headline


def test_moe_layer_hf_semantics_refuses_other_routing():
    ds = bml._layer_config(bml.CPU_MODELS["tiny-deepseek-v3"])
    qwen = bml._layer_config(bml.CPU_MODELS["tiny-qwen3-30b-a3b"])
    assert bml.hf_semantics(ds, "deepseek_v3")["n_shared_experts"] == 1
    assert bml.hf_semantics(qwen, "qwen3_moe")["norm_topk_prob"] is True
    for cfg, family in ((ds, "qwen3_moe"), (qwen, "deepseek_v3"), (qwen.replace(router=qwen.router.__class__(
            **{**vars(qwen.router), "pre_softmax": True})), "mixtral")):
        with pytest.raises(ValueError):
            bml.hf_semantics(cfg, family)
    # transformers scores a group by its top 2; another group_score_topk has no Hugging Face peer
    other = ds.replace(router=ds.router.__class__(**{**vars(ds.router), "group_score_topk": 1}))
    with pytest.raises(ValueError, match="top 2"):
        bml.hf_semantics(other, "deepseek_v3")


def test_moe_layer_full_size_flops_and_setup():
    ctx = _cpu_ctx()
    cfg, setup = bml.fit_config(ctx, bml.MODELS["deepseek-v3"], 8192)
    assert cfg.num_experts == 256 and cfg.router.k == 8 and cfg.shared_ffn_size == 2048
    assert "E=256 routed experts" in setup and "EP=8 would hold 32 per GPU" in setup
    # 2*T*k*3*H*F routed + 2*T*3*H*F_shared + 2*T*H*E router
    assert bml.flops(cfg, 8192) == 2 * 8192 * (8 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 256)
    q, _ = bml.fit_config(ctx, bml.MODELS["qwen3-30b-a3b"], 8192)
    assert bml.hf_semantics(q, "qwen3_moe") == dict(
        hidden_size=2048, num_experts_per_tok=8, hidden_act="silu", num_experts=128, moe_intermediate_size=768,
        norm_topk_prob=True)
