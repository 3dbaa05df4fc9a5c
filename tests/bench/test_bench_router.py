"""The benchmark suite: the CPU quick run works end to end in seconds and writes what perf.md asks
for; its torch-eager peers compute the op; a wrong result is reported instead of timed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_router as br
from bench import harness
from moe_kernels.ops.router import router_topk_bwd_reference
from moe_kernels.testing import assert_exact

ROOT = Path(__file__).resolve().parents[2]
OPS = {"permute_fwd", "unpermute_fwd", "permute_bwd", "unpermute_bwd"}
ROUTER_OPS = {"router_topk_fwd", "router_topk_fwd_bwd"}


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
