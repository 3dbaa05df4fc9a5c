"""The benchmark suite: the CPU quick run works end to end in seconds and writes what perf.md asks
for; its torch-eager peers compute the op; a wrong result is reported instead of timed."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import harness
from moe_kernels.nn import Router

ROOT = Path(__file__).resolve().parents[2]
OPS = {"permute_fwd", "unpermute_fwd", "permute_bwd", "unpermute_bwd"}
ROUTER_OPS = {"router_topk_fwd", "router_topk_fwd_bwd"}


# ---------------------------------------------------------------------------------------------------
# moe_layer

from bench import bench_moe_layer as bml  # noqa: E402
from bench import moe_layer_checks as bml_checks  # noqa: E402
from bench import moe_layer_peers as bml_peers  # noqa: E402

LAYER_OPS = {"moe_layer_fwd", "moe_layer_fwd_bwd"}


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory):
    pytest.importorskip("transformers", minversion="5.0")
    out = tmp_path_factory.mktemp("bench_moe_layer")
    cmd = [sys.executable, "-m", "bench", "moe_layer", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def _tiny_layer(name="tiny-qwen3-30b-a3b", routing="uniform"):
    spec = bml.CPU_MODELS[name]
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    cfg, _ = bml.fit_config(ctx, spec, 64)
    layer = bml.build_ours(ctx, cfg)
    x, dout = bml.make_inputs(ctx, cfg, 64, seed=5, shift=bml.routing_shift(ctx, layer, routing))
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
    assert bml.ROUTINGS == ("uniform", "zipf")
    assert {(r["case"], r["op"]) for r in results} == {(f"{m}/T{bml.CPU_TOKENS[0]}/{routing}", op)
                                                      for m in bml.CPU_MODELS for routing in bml.ROUTINGS
                                                      for op in LAYER_OPS}
    for r in results:
        s, spec = r["shape"], bml.CPU_MODELS[r["case"].split("/")[0]]
        assert r["case"].endswith("/" + r["routing"]) and r["routing"] in bml.ROUTINGS
        skew = r["routing_skew"]
        assert set(skew) == {"max_expert_frac", "max_over_mean", "empty_experts", "experts_for_half"}
        assert 0 < skew["max_expert_frac"] <= 1 and 1 <= skew["max_over_mean"] <= s["E"] / s["k"]
        assert skew["max_over_mean"] == pytest.approx(skew["max_expert_frac"] * s["E"] / s["k"])
        assert 0 <= skew["empty_experts"] < s["E"] and 1 <= skew["experts_for_half"] <= s["E"]
        assert set(s) == {"T", "H", "E", "k", "F", "F_shared"} and r["model"] == spec.preset
        for key in ("us", "p20_us", "p80_us", "bytes", "flops", "gbps", "tflops", "pct_of_ceiling", "tokens_per_s"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20_us"] <= r["us"] <= r["p80_us"] and r["bytes"] > 0 and r["tflops"] > 0
        fwd = 2 * s["T"] * (s["k"] * 3 * s["H"] * s["F"] + 3 * s["H"] * s["F_shared"] + s["H"] * s["E"])
        assert r["flops"] == (fwd if r["op"] == "moe_layer_fwd" else 3 * fwd)
        assert r["tokens_per_s"] == pytest.approx(s["T"] / (r["us"] * 1e-6))
        assert r["dtype"] == "bfloat16" and r["ceiling"] in ("copy", "matmul_bf16")
        assert (s["F_shared"] > 0) == (spec.preset == "deepseek-v3") and r["setup"]
        assert set(r["speedup"]) == set(bml_peers.PEERS) and r["peer_skipped"] == {}  # every peer runs on the CPU
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()
        assert all(v > 0 and math.isfinite(v) for v in r["speedup"].values())
        assert all(v >= 0 and math.isfinite(v) for v in r["peer_us"].values())
        assert 'experts_implementation="eager"' in r["peer_variant"]["hf_eager"]
        assert 'experts_implementation="grouped_mm"' in r["peer_variant"]["hf_grouped_mm"]
        assert set(r["routing_agreement"]) == set(bml_peers.PEERS)
        assert all(0.9 <= f <= 1 for f in r["routing_agreement"].values())
        assert r["reps"] == {p: 3 for p in ("ours", *bml_peers.PEERS)}  # the CPU quick run's reps
    by_case = {(r["case"], r["op"]): r for r in results}
    for case in {r["case"] for r in results}:  # fwd+bwd moves and computes more than the forward
        fwd_bwd, fwd = by_case[(case, "moe_layer_fwd_bwd")], by_case[(case, "moe_layer_fwd")]
        assert fwd_bwd["bytes"] > fwd["bytes"] and fwd_bwd["routing_skew"] == fwd["routing_skew"]
    for m in bml.CPU_MODELS:  # zipf is really skewed, with empty experts; uniform is not
        T = bml.CPU_TOKENS[0]
        uni = by_case[(f"{m}/T{T}/uniform", "moe_layer_fwd_bwd")]["routing_skew"]
        zipf = by_case[(f"{m}/T{T}/zipf", "moe_layer_fwd_bwd")]["routing_skew"]
        assert uni["empty_experts"] == 0 and uni["max_over_mean"] < 1.5, (m, uni)
        assert zipf["empty_experts"] >= 1 and zipf["max_over_mean"] >= 2.0, (m, zipf)
        assert zipf["max_expert_frac"] >= 0.5 > uni["max_expert_frac"], (m, uni, zipf)
        assert zipf["experts_for_half"] < uni["experts_for_half"], (m, uni, zipf)

    headline = data["headline"]
    T = bml.CPU_TOKENS[0]
    for preset in bml.HEADLINE_PRESETS:  # judged on uniform routing, zipf's speedup beside it
        for peer, bar in bml.BARS.items():
            lines = [line for line in headline if line.startswith("moe_layer_fwd_bwd tiny-")
                     and f"x {peer} (" in line and f"(bar: >= {bar:g}x {peer})" in line and preset in line]
            assert len(lines) == 1, (preset, peer)
            assert lines[0].startswith(f"moe_layer_fwd_bwd tiny-{preset}/T{T}/uniform: "), lines[0]
            zipf = by_case[(f"tiny-{preset}/T{T}/zipf", "moe_layer_fwd_bwd")]["speedup"][peer]
            assert f"zipf routing: {zipf:.2f}x at tiny-{preset}/T{T}/zipf;" in lines[0], lines[0]
    assert any(line.startswith("note: tiny-deepseek-v3: E=8 routed experts") for line in headline)
    assert any(line.startswith("note: routing agreement with ours") for line in headline)
    for m in bml.CPU_MODELS:
        assert sum(line.startswith(f"note: {m} routing skew") and f"T{T}/uniform " in line
                   and f"T{T}/zipf " in line for line in headline) == 1, m


def test_moe_layer_png_and_stdout(layer_run):
    out, stdout = layer_run
    assert (out / "bench_moe_layer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bench_moe_layer.json").read_text())
    lines = stdout.splitlines()
    result_lines = [line for line in lines if line.startswith("RESULT ")]
    assert len(result_lines) == len(data["results"])
    assert all("us=" in line and "TFLOP/s=" in line and all(f"{p}=" in line for p in bml_peers.PEERS)
               for line in result_lines)
    for op in LAYER_OPS:
        for p in bml_peers.PEERS:
            assert any(line.startswith(f"GEOMEAN {op} vs {p}:") for line in lines), (op, p)
    for preset in bml.HEADLINE_PRESETS:
        for peer in bml.BARS:
            assert any(line.startswith(f"HEADLINE moe_layer_fwd_bwd tiny-{preset}/") and f"x {peer} (" in line
                       for line in lines), (preset, peer)
    for m in bml.CPU_MODELS:
        for routing in bml.ROUTINGS:
            assert any(line.startswith(f"RESULT moe_layer_fwd_bwd {m}/T{bml.CPU_TOKENS[0]}/{routing} ")
                       for line in lines), (m, routing)
    assert not any(line.startswith("FAILED") for line in lines)


@pytest.mark.parametrize("routing", bml.ROUTINGS)
@pytest.mark.parametrize("name", list(bml.CPU_MODELS))
def test_moe_layer_peers_share_weights_and_agree(name, routing):
    pytest.importorskip("transformers", minversion="5.0")
    spec, cfg, layer, x, dout = _tiny_layer(name, routing)
    peers, skipped = bml_peers.build_peers(layer, spec)
    assert skipped == {} and set(peers) == set(bml_peers.PEERS)
    ours = {id(p) for p in layer.parameters()}
    for p, impl in peers.items():
        # the experts (and shared experts) are our tensors; only the Qwen3/Mixtral router is a bf16 copy
        others = {id(t) for t in impl.params()} - ours
        assert others == (set() if impl.fp32_router else {id(impl.router_weight)}), p
        assert {id(layer.experts.w13), id(layer.experts.w2)} <= {id(t) for t in impl.params()}, p
        assert (impl.router_weight is layer.router.weight) == impl.fp32_router, p
        assert bml_checks.check_peer(name, layer, impl, x, dout) >= 0.9
    assert peers["hf_eager"].module.experts.config._experts_implementation == "eager"
    assert peers["hf_grouped_mm"].module.experts.config._experts_implementation == "grouped_mm"


def test_moe_layer_check_catches_swapped_gate_up():
    pytest.importorskip("transformers", minversion="5.0")
    spec, cfg, layer, x, dout = _tiny_layer()
    peers, _ = bml_peers.build_peers(layer, spec)
    hf_peer = peers["hf_grouped_mm"]
    F_ = cfg.ffn_size
    w13 = layer.experts.w13.detach()
    hf_peer.module.experts.gate_up_proj = torch.nn.Parameter(torch.cat([w13[:, F_:], w13[:, :F_]], dim=1))
    with pytest.raises(AssertionError, match="output on the"):
        bml_checks.check_peer("tiny", layer, hf_peer, x, dout)


def test_moe_layer_close_policy():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(256, 512, generator=g)
    noise = ref + 2.0**-8 * torch.randn(256, 512, generator=g)  # bf16-rounding-sized differences
    bml_checks._close("noise", noise.to(torch.bfloat16), ref.to(torch.bfloat16))
    few = noise.clone()
    few[0, :5] += 0.05  # 5 of 131072 elements just past the elementwise bound: allowed
    bml_checks._close("few", few, ref)
    with pytest.raises(AssertionError, match="worst"):
        far = noise.clone()
        far[3, 7] += 1.0  # one element far off
        bml_checks._close("far", far, ref)
    with pytest.raises(AssertionError, match="relative L2 error"):
        wrong = noise.clone()
        wrong[:, :16] = 0  # a slice of the output lost
        bml_checks._close("wrong", wrong, ref)
    with pytest.raises(AssertionError):
        bml_checks._close("nan", torch.where(ref > 3, torch.nan, ref), ref)


def test_moe_layer_close_follows_the_local_scale():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(8, 64, 64, generator=g)
    ref[0] *= 20  # one hot expert's gradient
    hot = ref.clone()
    hot[0] += 20 * 2.0**-7 * torch.randn(64, 64, generator=g)  # bf16-sized there; beyond a global atol
    bml_checks._close("hot", hot, ref)
    cold = ref.clone()
    cold[1:] += 20 * 2.0**-7 * torch.randn(7, 64, 64, generator=g)  # as large on the small experts: wrong
    with pytest.raises(AssertionError, match="elements beyond"):
        bml_checks._close("cold", cold, ref)
    # a few input features much larger than the rest (zipf's shift): each column at its own scale
    wide = torch.randn(256, 512, generator=g) * torch.where(torch.arange(512) < 16, 10.0, 1.0)
    bml_checks._close("columns", wide + 2.0**-7 * wide.abs().mean(0) * torch.randn(256, 512, generator=g), wide)
    empty = torch.zeros(4, 8, 8)  # an empty expert's gradient must stay zero, up to the global floor
    empty[1:] = torch.randn(3, 8, 8, generator=g)
    off = empty.clone()
    off[0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match="worst"):
        bml_checks._close("empty expert", off, empty)


def test_moe_layer_zipf_shift_sets_the_logit_offsets():
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    spec = bml.MODELS["qwen3-30b-a3b"]
    cfg = bml._layer_config(spec)
    torch.manual_seed(0)
    router = Router(cfg.router)
    layer = SimpleNamespace(router=router, config=cfg)  # all routing_shift and routing_skew read
    assert bml.routing_shift(ctx, layer, "uniform") is None
    with pytest.raises(ValueError):
        bml.routing_shift(ctx, layer, "hot")
    v = bml.routing_shift(ctx, layer, "zipf")
    W = router.weight.detach().double()
    offsets = (W @ v.double()) / W.norm(dim=1)  # in logit standard deviations
    E, n_empty = cfg.num_experts, cfg.num_experts // bml.EMPTY_FRACTION
    ranks = torch.arange(1, E - n_empty + 1, dtype=torch.float64)
    live = bml.ZIPF_LOGIT_SCALE * -bml.ZIPF_EXPONENT * ranks.log()
    expected = torch.cat([live, torch.full((n_empty,), bml.EMPTY_LOGIT_OFFSET, dtype=torch.float64)])
    torch.testing.assert_close(offsets.sort(descending=True).values, expected, rtol=0, atol=1e-4)
    assert int(offsets.argmax()) != 0  # the ranks are shuffled over the experts
    torch.testing.assert_close(bml.routing_shift(ctx, layer, "zipf"), v, rtol=0, atol=0)  # seeded
    x, _ = bml.make_inputs(ctx, cfg, 2048, seed=3, shift=v)
    skew = bml.routing_skew(layer, x)
    assert skew["empty_experts"] == n_empty and skew["max_expert_frac"] > 0.5
    assert skew["experts_for_half"] <= 16 and skew["max_over_mean"] > 8


def test_moe_layer_checked_experts_take_the_busiest_and_the_empty():
    counts = torch.tensor([5, 0, 40, 7, 0, 9, 3, 30, 1, 2, 50, 6, 8, 4, 0, 20], dtype=torch.int32)
    assert bml_checks.CHECK_EXPERTS == 8
    assert bml_checks.checked_experts(counts).tolist() == [1, 2, 4, 7, 8, 10, 14, 15]  # 4 busiest, 4 least loaded
    assert bml_checks.checked_experts(counts[:8]).tolist() == list(range(8))


def test_moe_layer_wrong_result_is_reported_not_timed(monkeypatch, tmp_path):
    pytest.importorskip("transformers", minversion="5.0")

    class Off(bml_peers.Impl):
        def forward(self, x):
            out, aux = super().forward(x)
            return out * 1.1, aux

    # check_peer takes ours from ours_impl: ours 10% off
    monkeypatch.setattr(bml_checks, "ours_impl",
                        lambda layer: Off("ours", layer, "off by 10%", layer.router.weight, None))
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=tmp_path)
    rep = bml.run(ctx)
    assert rep.results == [] and len(rep.failures) == len(bml.CPU_MODELS) * len(bml.ROUTINGS)
    assert all("vs torch_native output on the" in f for f in rep.failures)
    assert all(line.startswith(("moe_layer_fwd_bwd", "note:")) for line in rep.headline)
    assert sum("no uniform case timed" in line for line in rep.headline) == len(bml.HEADLINE_PRESETS)
    json_path, png_path = harness.report(ctx, "moe_layer", rep)
    assert json.loads(json_path.read_text())["failures"] == rep.failures and png_path.exists()


def test_moe_layer_peer_left_out_with_reason(monkeypatch, tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    real = bml_peers.build_hf

    def no_grouped_mm(layer, family, implementation, bf16_router):
        if implementation == "grouped_mm":
            raise RuntimeError("grouped_mm experts unavailable here")
        return real(layer, family, implementation, bf16_router)

    monkeypatch.setattr(bml_peers, "build_hf", no_grouped_mm)
    monkeypatch.setattr(bml, "CPU_MODELS", {"tiny-qwen3-30b-a3b": bml.CPU_MODELS["tiny-qwen3-30b-a3b"]})
    rep = bml.run(harness.Context(torch.device("cpu"), quick=True, out_dir=tmp_path))
    assert rep.failures == [] and len(rep.results) == 2 * len(bml.ROUTINGS)
    for r in rep.results:
        assert set(r.speedup) == {"torch_native", "hf_eager"}
        assert r.peer_skipped == {"hf_grouped_mm": "RuntimeError: grouped_mm experts unavailable here"}
    assert any("hf_grouped_mm not timed (RuntimeError" in line and "(bar: >= 1.3x hf_grouped_mm)" in line
               for line in rep.headline)
    assert "note: hf_grouped_mm not timed at tiny-qwen3-30b-a3b/T64/uniform, tiny-qwen3-30b-a3b/T64/zipf: " \
           "RuntimeError: grouped_mm experts unavailable here" in rep.headline


def test_moe_layer_hf_semantics_refuses_other_routing():
    ds = bml._layer_config(bml.CPU_MODELS["tiny-deepseek-v3"])
    qwen = bml._layer_config(bml.CPU_MODELS["tiny-qwen3-30b-a3b"])
    assert bml_peers.hf_semantics(ds, "deepseek_v3")["n_shared_experts"] == 1
    assert bml_peers.hf_semantics(qwen, "qwen3_moe")["norm_topk_prob"] is True
    for cfg, family in ((ds, "qwen3_moe"), (qwen, "deepseek_v3"), (qwen.replace(router=qwen.router.__class__(
            **{**vars(qwen.router), "pre_softmax": True})), "mixtral")):
        with pytest.raises(ValueError):
            bml_peers.hf_semantics(cfg, family)
    # transformers scores a group by its top 2; another group_score_topk has no Hugging Face peer
    other = ds.replace(router=ds.router.__class__(**{**vars(ds.router), "group_score_topk": 1}))
    with pytest.raises(ValueError, match="top 2"):
        bml_peers.hf_semantics(other, "deepseek_v3")


def test_moe_layer_full_size_flops_and_setup():
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    cfg, setup = bml.fit_config(ctx, bml.MODELS["deepseek-v3"], 8192)
    assert cfg.num_experts == 256 and cfg.router.k == 8 and cfg.shared_ffn_size == 2048
    assert "E=256 routed experts" in setup and "EP=8 would hold 32 per GPU" in setup
    # 2*T*k*3*H*F routed + 2*T*3*H*F_shared + 2*T*H*E router
    assert bml.flops(cfg, 8192) == 2 * 8192 * (8 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 256)
    q, _ = bml.fit_config(ctx, bml.MODELS["qwen3-30b-a3b"], 8192)
    assert bml_peers.hf_semantics(q, "qwen3_moe") == dict(
        hidden_size=2048, num_experts_per_tok=8, hidden_act="silu", num_experts=128, moe_intermediate_size=768,
        norm_topk_prob=True)
