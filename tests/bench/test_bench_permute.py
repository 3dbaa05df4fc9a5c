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


def test_a_wrong_fused_quantization_fails_the_case(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = bp.fused_permute_quantize

    def off_by_one_scale(*args):
        q, scale, *rest = real(*args)
        return (q, scale * 1.0001, *rest)

    monkeypatch.setattr(bp, "fused_permute_quantize", off_by_one_scale)
    with pytest.raises(AssertionError, match="permute_quantize_fp8 scales"):
        bp.run_case(ctx, bp.cases(ctx)[0])
