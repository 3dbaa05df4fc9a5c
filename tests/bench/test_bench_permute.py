"""The benchmark suite: the CPU quick run works end to end in seconds and writes what perf.md asks
for; its torch-eager peers compute the op; a wrong result is reported instead of timed."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_permute as bp
from bench import harness
from moe_kernels.ops.permute import permute_reference, unpermute_reference
from moe_kernels.testing import assert_exact, random_routing

ROOT = Path(__file__).resolve().parents[2]
OPS = {"permute_fwd", "unpermute_fwd", "permute_bwd", "unpermute_bwd", "permute_quantize_fp8"}
PEER = {"permute_quantize_fp8": "moe_kernels_unfused"}  # the others' peer: torch_eager
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
        assert PEER.get(r["op"], "torch_eager") in r["speedup"] and all(s > 0 for s in r["speedup"].values())
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()
    # The capable user's compositions (perf.md): every variant is timed and recorded; the peer's time is
    # the fastest one's.
    variants = {"permute_fwd": {"argsort_index_select"},
                "unpermute_fwd": {"index_add_fp32", "gather_sum_fp32", "gather_bmm_fp32"},
                "permute_bwd": {"argsort_index_select", "gather_bwd_fp32", "gather_bwd_bmm"},
                "unpermute_bwd": {"index_add_fp32", "gather_sum_fp32", "gather_bmm_fp32"}}
    for r in results:
        if r["op"] not in variants:
            continue
        times = {key[len("torch_eager["):-len("]_us")]: us for key, us in r["extra"].items()
                 if key.startswith("torch_eager[")}
        assert set(times) == variants[r["op"]], (r["op"], times)
        assert r["peer_variant"]["torch_eager"] == min(times, key=times.get), r
        assert r["peer_us"]["torch_eager"] == min(times.values())


def test_png_and_stdout(quick_run):
    out, stdout = quick_run
    assert (out / "bench_permute.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bench_permute.json").read_text())
    result_lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(result_lines) == len(data["results"])
    for line in result_lines:
        op = line.split()[1]
        assert "us=" in line and "GB/s=" in line and f"{PEER.get(op, 'torch_eager')}=" in line, line
    assert any(line.startswith("HEADLINE permute_quantize_fp8 ") for line in stdout.splitlines())
    assert any(line.startswith("HEADLINE permute_fwd ") for line in stdout.splitlines())
    n_cases = len(bp.cases(harness.Context(torch.device("cpu"), quick=True, out_dir=out)))
    for op in OPS:  # every case in the summaries (geomean and worst), not only the headline's
        peer = PEER.get(op, "torch_eager")
        assert any(re.match(rf"(GEOMEAN|SUMMARY) {op} vs {peer}\b", line) for line in stdout.splitlines()), op
        summary = data["summary"][op]["speedup"][peer]
        assert summary["cases"] == n_cases and summary["worst"] <= summary["geomean"], summary


@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("align", [1, 4])
def test_eager_peers_match_reference(align, k):
    T, H, E = 37, 24, 6 if k < 6 else 16
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = random_routing(T, E, k, kind="zipf", drop=0.2, seed=align)
    ref_perm, ref_map, ref_sizes = permute_reference(x, idx, E, align)
    x_perm, row_map, sizes = bp.eager_permute(x, idx, E, align)
    n = int(ref_sizes.sum())
    assert x_perm.shape == ref_perm.shape
    assert_exact(row_map, ref_map, "row_map")
    assert_exact(sizes, ref_sizes, "group_sizes")
    assert_exact(x_perm[:n], ref_perm[:n], "x_perm")
    # Unpermute's input: independent random rows (x_perm's k copies of one token would hide cancellation).
    y = torch.randn(ref_perm.shape, dtype=torch.bfloat16)
    w = torch.randn(T, k).softmax(-1)
    ref = unpermute_reference(y, ref_map, w)
    for fn in (bp.eager_unpermute_index_add, bp.eager_unpermute_gather_sum, bp.eager_unpermute_gather_bmm):
        harness.check_peer(fn.__name__, fn(y, ref_map, w), ref)
    # The atomics-free permute backwards: dx is the unweighted unpermute of d x_perm, one fp32 sum per token.
    ref_dx = unpermute_reference(y, ref_map)
    for bwd in (bp.eager_permute_bwd_gather_sum, bp.eager_permute_bwd_gather_bmm):
        xg = x.clone().requires_grad_()
        x_perm, *_ = bp.eager_permute_with_backward(bwd)(xg, idx, E, align)
        assert_exact(x_perm[:n], ref_perm[:n], f"{bwd.__name__} x_perm")
        (dx,) = torch.autograd.grad(x_perm, xg, y)
        harness.check_peer(bwd.__name__, dx, ref_dx)


def test_bf16_bmm_would_not_pass_as_the_unpermute_peer():
    # Why gather_bmm_fp32 multiplies in fp32: bf16 operands round the routing weights, and where a token's
    # k terms cancel, its output is off by more than bf16 precision.
    T, k, H = 512, 8, 256
    g = torch.Generator().manual_seed(0)
    y = torch.randn(T * k, H, generator=g).to(torch.bfloat16)
    row_map = torch.randperm(T * k, generator=g).view(T, k).int()
    w = torch.randn(T, k, generator=g).softmax(-1)
    ref = unpermute_reference(y, row_map, w)
    harness.check_peer("fp32 bmm", bp.eager_unpermute_gather_bmm(y, row_map, w), ref)
    gathered = y.index_select(0, row_map.reshape(-1).long()).view(T, k, H)
    bf16 = torch.bmm(w.to(torch.bfloat16).view(T, 1, k), gathered).view(T, H)
    with pytest.raises(AssertionError):
        harness.check_peer("bf16 bmm", bf16, ref)


def test_a_wrong_peer_backward_fails_the_case(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = bp.peer_impls

    def half_dx(d_x_perm, row_map):
        return bp.eager_permute_bwd_gather_sum(d_x_perm, row_map) * 0.5

    def peers(ctx):
        out = real(ctx)
        out["torch_eager"]["gather_bwd_fp32"] = bp.Impl(bp.eager_permute_with_backward(half_dx), None,
                                                        backward=True, forward=False, check_backward=True)
        return out

    monkeypatch.setattr(bp, "peer_impls", peers)
    with pytest.raises(AssertionError, match=r"gather_bwd_fp32\] permute dx"):
        bp.run_case(ctx, bp.cases(ctx)[0])


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


def test_a_wrong_fused_quantization_fails_the_case(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = bp.fused_permute_quantize

    def off_by_one_scale(*args):
        q, scale, *rest = real(*args)
        return (q, scale * 1.0001, *rest)

    monkeypatch.setattr(bp, "fused_permute_quantize", off_by_one_scale)
    with pytest.raises(AssertionError, match="permute_quantize_fp8 scales"):
        bp.run_case(ctx, bp.cases(ctx)[0])
