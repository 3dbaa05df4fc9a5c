"""The benchmark suite: the CPU quick run works end to end in seconds and writes what perf.md asks
for; its torch-eager peers compute the op; a wrong result is reported instead of timed."""

import json
import math
import re
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
# Every peer but Liger's runs on the CPU; Liger's (Triton) is left out there with its reason.
CPU_PEERS = tuple(p for p in bml_peers.PEERS if p != "liger")
LIGER_CPU_REASONS = ("ImportError: liger_kernel's fused MoE not importable",
                     "RuntimeError: Liger's fused MoE runs Triton kernels on a GPU")


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
        assert set(r["speedup"]) == set(CPU_PEERS)
        assert set(r["peer_skipped"]) == {"liger"} and r["peer_skipped"]["liger"].startswith(LIGER_CPU_REASONS)
        assert r["speedup"].keys() == r["peer_us"].keys() == r["peer_variant"].keys()
        assert all(v > 0 and math.isfinite(v) for v in r["speedup"].values())
        assert all(v >= 0 and math.isfinite(v) for v in r["peer_us"].values())
        assert 'experts_implementation="eager"' in r["peer_variant"]["hf_eager"]
        assert 'experts_implementation="grouped_mm"' in r["peer_variant"]["hf_grouped_mm"]
        assert set(r["routing_agreement"]) == set(CPU_PEERS)
        # > 0: check_peer compares on agreeing tokens and fails the case unless every other token is a near-tie
        assert all(0 < f <= 1 for f in r["routing_agreement"].values())
        assert r["reps"] == {p: 3 for p in ("ours", *CPU_PEERS)}  # the CPU quick run's reps
    by_case = {(r["case"], r["op"]): r for r in results}
    for case in {r["case"] for r in results}:  # fwd+bwd moves and computes more than the forward
        fwd_bwd, fwd = by_case[(case, "moe_layer_fwd_bwd")], by_case[(case, "moe_layer_fwd")]
        assert fwd_bwd["bytes"] > fwd["bytes"] and fwd_bwd["routing_skew"] == fwd["routing_skew"]
    # Each case's skew is our router's on the case's first input set, its own routing's shift applied (the
    # same computation here: equal). How skewed each routing is: a property of the routing distribution,
    # asserted on a large sample (test_moe_layer_routing_cases_skew_as_documented); 64 tokens are one draw.
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    T = bml.CPU_TOKENS[0]
    for m, spec in bml.CPU_MODELS.items():
        cfg, _ = bml.fit_config(ctx, spec, T)
        layer = bml.build_ours(ctx, cfg)
        for routing in bml.ROUTINGS:
            shift = bml.routing_shift(ctx, layer, routing)
            x, _ = bml.make_inputs(ctx, cfg, T, ctx.seed + bml.INPUT_SEED_OFFSET, shift)
            assert by_case[(f"{m}/T{T}/{routing}", "moe_layer_fwd_bwd")]["routing_skew"] == bml.routing_skew(layer, x)

    headline = data["headline"]
    T = bml.CPU_TOKENS[0]
    for preset in bml.HEADLINE_PRESETS:  # judged on uniform routing, zipf's speedup beside it
        for (op, peer), bar in bml.BARS.items():
            judged = f"(bar: >= {bar:g}x {peer}" + (", forward only)" if op == "moe_layer_fwd" else ")")
            lines = [line for line in headline
                     if line.startswith(f"{op} tiny-{preset}/T{T}/uniform: ") and judged in line]
            assert len(lines) == 1, (preset, op, peer, headline)
            if peer == "liger":  # not on the CPU: the reason instead of a ratio
                assert lines[0].split(": ", 1)[1].startswith("liger not timed ("), lines[0]
                assert any(why in lines[0] for why in LIGER_CPU_REASONS), lines[0]
                continue
            zipf = by_case[(f"tiny-{preset}/T{T}/zipf", op)]["speedup"][peer]
            assert f"x {peer} (" in lines[0] and f"zipf routing: {zipf:.2f}x at tiny-{preset}/T{T}/zipf;" in lines[0]
            assert lines[0].endswith(("[meets bar]", "[below bar]")), lines[0]
        # The headline against the eager experts is forward-only; their fwd+bwd ratio is shown without a bar.
        eager = [line for line in headline if "x hf_eager (" in line and f"tiny-{preset}/T{T}/uniform" in line]
        assert [line.split()[0] for line in eager] == ["moe_layer_fwd", "moe_layer_fwd_bwd"], eager
        assert "(bar: >= 3x hf_eager, forward only)" in eager[0]
        assert "(no bar: its backward builds a full-size weight gradient per expert" in eager[1]
    # The TFLOP/s bar's case (qwen3-30b-a3b at 32768 tokens) runs on a GPU only: its line says so.
    assert bml.TFLOPS_BAR == ("qwen3-30b-a3b", 32768, 450)
    assert "moe_layer_fwd_bwd qwen3-30b-a3b/T32768/uniform: not run (the full GPU run only, or see FAILED) " \
           "(bar: >= 450 TFLOP/s)" in headline
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
    assert all("us=" in line and "TFLOP/s=" in line and all(f"{p}=" in line for p in CPU_PEERS)
               for line in result_lines)
    for op in LAYER_OPS:  # every case in the summaries (geomean and worst)
        for p in CPU_PEERS:
            assert any(re.match(rf"(GEOMEAN|SUMMARY) {op} vs {p}\b", line) for line in lines), (op, p)
            summary = data["summary"][op]["speedup"][p]
            assert summary["cases"] == len(bml.CPU_MODELS) * len(bml.ROUTINGS), (op, p, summary)
    for preset in bml.HEADLINE_PRESETS:
        for op, peer in bml.BARS:
            assert any(line.startswith(f"HEADLINE {op} tiny-{preset}/") and f"{peer} " in line
                       for line in lines), (preset, op, peer)
    for m in bml.CPU_MODELS:
        for routing in bml.ROUTINGS:
            assert any(line.startswith(f"RESULT moe_layer_fwd_bwd {m}/T{bml.CPU_TOKENS[0]}/{routing} ")
                       for line in lines), (m, routing)
    assert not any(line.startswith("FAILED") for line in lines)


SKEW_TOKENS = 16384  # the routing sample the skew claims are asserted on (router only: milliseconds)


@pytest.mark.parametrize("name", list(bml.CPU_MODELS))
def test_moe_layer_routing_cases_skew_as_documented(name):
    """zipf is really skewed, with (nearly) empty experts; uniform is not. Asserted on SKEW_TOKENS tokens of
    each case's routing (the bench's layer, ctx.seed's weights, its inputs and shift). Error model: each
    statistic is a mean over the tokens of per-token indicators, so its sampling error has a standard
    deviation <= sqrt(0.25 / T) = 0.004 at T = 16384 (in units of T tokens; max_over_mean is E/k = 4x
    max_expert_frac here), union over the E experts where it is a max. The population values of the CPU
    models (this seed; 2^17 tokens): busiest expert 0.56-0.59 of the tokens under zipf and 0.28-0.29 under
    uniform, least loaded uniform expert 0.196 (bound: a quarter of the mean, 0.0625); half of the 2T routed
    tokens on 3 zipf experts (1.27 T on them; deepseek: 2, 1.07 T) but 4 uniform ones (the busiest 3 take
    0.84 T); no token of 2^20 on a cold zipf expert (-6 logit standard deviations; bound 1e-3). Every bound
    is >= 13 standard deviations away, for every input seed tried."""
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    cfg, _ = bml.fit_config(ctx, bml.CPU_MODELS[name], SKEW_TOKENS)
    layer = bml.build_ours(ctx, cfg)
    E, k, T = cfg.num_experts, cfg.router.k, SKEW_TOKENS
    skew, share = {}, {}
    for routing in bml.ROUTINGS:
        shift = bml.routing_shift(ctx, layer, routing)
        x, _ = bml.make_inputs(ctx, cfg, T, ctx.seed + bml.INPUT_SEED_OFFSET, shift)
        skew[routing] = bml.routing_skew(layer, x)
        with torch.no_grad():
            counts = layer.router(x.detach().reshape(T, -1), seq_len=T).tokens_per_expert
        share[routing] = counts.double() / T  # each expert's fraction of the tokens
    uni, zipf = skew["uniform"], skew["zipf"]
    assert uni["max_over_mean"] < 1.5 and float(share["uniform"].min()) >= k / E / 4, (uni, share["uniform"])
    assert zipf["max_over_mean"] >= 2.0 and zipf["max_expert_frac"] >= 0.5 > uni["max_expert_frac"], (uni, zipf)
    assert zipf["experts_for_half"] < uni["experts_for_half"], (uni, zipf)
    n_cold = min(max(1, E // bml.EMPTY_FRACTION), E - k)
    assert float(share["zipf"].sort().values[:n_cold].sum()) <= 1e-3, share["zipf"]  # the cold experts


@pytest.mark.parametrize("routing", bml.ROUTINGS)
@pytest.mark.parametrize("name", list(bml.CPU_MODELS))
def test_moe_layer_peers_share_weights_and_agree(name, routing):
    pytest.importorskip("transformers", minversion="5.0")
    spec, cfg, layer, x, dout = _tiny_layer(name, routing)
    peers, skipped = bml_peers.build_peers(layer, spec)
    assert set(skipped) == {"liger"} and skipped["liger"].startswith(LIGER_CPU_REASONS)
    assert set(peers) == set(CPU_PEERS)
    ours = {id(p) for p in layer.parameters()}
    for p, impl in peers.items():
        # the experts (and shared experts) are our tensors; only the Qwen3/Mixtral router is a bf16 copy
        others = {id(t) for t in impl.params()} - ours
        assert others == (set() if impl.fp32_router else {id(impl.router_weight)}), p
        assert {id(layer.experts.w13), id(layer.experts.w2)} <= {id(t) for t in impl.params()}, p
        assert (impl.router_weight is layer.router.weight) == impl.fp32_router, p
        assert 0 < bml_checks.check_peer(name, layer, impl, x, dout) <= 1
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


def _rounded(ref, rel, g):
    """ref with a relative error of RMS `rel` per element (rounding noise, as bf16 roundings leave)."""
    return ref + rel * ref * torch.randn(ref.shape, generator=g, dtype=ref.dtype)


def test_moe_layer_compare_policy():
    # Each case's error is far from its bound (the relative L2 errors of 1.3e5 elements scatter by < 1%).
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(256, 512, generator=g, dtype=torch.float64)
    ours, peer = _rounded(ref, 2.0**-8, g), _rounded(ref, 2.0**-8, g)  # a few bf16 roundings each
    bml_checks._compare("noise", ours, peer, ref)
    bml_checks._compare("as large", _rounded(ref, 2.0**-7, g), _rounded(ref, 2.0**-7, g), ref)
    with pytest.raises(AssertionError, match="worst element"):
        far = ours.clone()
        far[3, 7] += 1.0  # one element far off
        bml_checks._compare("far", far, peer, ref)
    with pytest.raises(AssertionError, match="ours: relative L2 error"):
        wrong = ours.clone()
        wrong[:, :16] = 0  # a slice of the output lost
        bml_checks._compare("wrong", wrong, peer, ref)
    with pytest.raises(AssertionError, match="hf_eager: relative L2 error"):  # the peer is checked as well
        bml_checks._compare("peer wrong", ours, peer * 1.1, ref, peer_name="hf_eager")
    worse = ref + 2.0**-6 * torch.randn(ref.shape, generator=g, dtype=ref.dtype)  # 4x the peer's error, spread
    with pytest.raises(AssertionError, match="2 x peer's"):  # evenly: within bf16 precision, not the flash rule
        bml_checks._compare("worse", worse, peer, ref)
    with pytest.raises(AssertionError):
        bml_checks._compare("nan", torch.where(ref > 3, torch.nan, ours), peer, ref)


def test_moe_layer_compare_per_expert():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(8, 64, 64, generator=g, dtype=torch.float64)
    ref[0] *= 20  # one hot expert's gradient
    ref[5] = 0  # an empty expert's
    ours, peer = _rounded(ref, 2.0**-8, g), _rounded(ref, 2.0**-8, g)
    bml_checks._compare("experts", ours, peer, ref, per_expert=True)
    cold = ours.clone()
    cold[1:] += 20 * 2.0**-7 * torch.randn(7, 64, 64, generator=g, dtype=ref.dtype)  # the hot one's error size
    with pytest.raises(AssertionError, match="expert slice 1"):  # on the small experts: wrong
        bml_checks._compare("cold", cold, peer, ref, per_expert=True)
    off = ours.clone()
    off[5, 0, 0] = 1e-6  # an empty expert's gradient must stay zero
    with pytest.raises(AssertionError, match="expert slice 5"):
        bml_checks._compare("empty expert", off, peer, ref, per_expert=True)


def test_moe_layer_routing_near_ties_only():
    # A token routed to another expert set is accepted only where the router's rounding could have done it.
    spec = bml.CPU_MODELS["tiny-qwen3-30b-a3b"]
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    cfg, _ = bml.fit_config(ctx, spec, 64)
    layer = bml.build_ours(ctx, cfg)
    x, _ = bml.make_inputs(ctx, cfg, 64, seed=5)
    x2 = x.detach().reshape(64, -1)
    with torch.no_grad():
        ours = layer.router(x2, seq_len=64).indices.long().sort(-1).values
        logits = x2.double() @ layer.router.weight.detach().double().T
    bml_checks._check_routing("same", layer, x2, ours, ours, peer_bf16=True)
    gap = logits.sort(-1, descending=True).values  # the top-k boundary's gap per token
    t = int((gap[:, 1] - gap[:, 2]).argmax())  # the token farthest from a tie (k = 2)
    other = ours.clone()
    other[t] = logits[t].argsort(descending=True)[[0, 2]].sort().values  # its 3rd expert for its 2nd
    with pytest.raises(AssertionError, match="the peer routes 1 of 64 tokens to experts no rounding"):
        bml_checks._check_routing("moved", layer, x2, ours, other, peer_bf16=True)
    # A token moved along W[a] - W[b] until its 2nd and 3rd logits (a, b) tie: either pair is right.
    w = layer.router.weight.detach().double()
    for t in range(64):
        a, b = (int(e) for e in logits[t].argsort(descending=True)[1:3])
        d = w[a] - w[b]
        tied = x2.float().clone()
        tied[t] = (tied[t].double() - (d @ tied[t].double()) / (d @ d) * d).float()
        top = (tied[t].double() @ w.T).argsort(descending=True)
        if {int(top[1]), int(top[2])} == {a, b}:
            break
    else:
        pytest.fail("no token could be moved onto a tie of its 2nd and 3rd experts")
    with torch.no_grad():
        ours = layer.router(tied, seq_len=64).indices.long().sort(-1).values
    pairs = [torch.tensor(sorted((int(top[0]), int(e)))) for e in (a, b)]
    assert any(torch.equal(ours[t], p) for p in pairs)
    swapped = ours.clone()
    swapped[t] = next(p for p in pairs if not torch.equal(ours[t], p))  # the other one of the tied pair
    bml_checks._check_routing("tie", layer, tied, ours, swapped, peer_bf16=False)  # fp32's rounding suffices


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
    assert all(line.startswith(("moe_layer_fwd", "note:")) for line in rep.headline)
    assert sum("no uniform case timed" in line for line in rep.headline) == len(bml.HEADLINE_PRESETS) * len(bml.OPS)
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
        assert r.peer_skipped["hf_grouped_mm"] == "RuntimeError: grouped_mm experts unavailable here"
        assert set(r.peer_skipped) == {"hf_grouped_mm", "liger"}
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


def _liger_contract(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """What Liger's fused MoE computes, as its own tests state it: per token, sum over its k slots of
    weight x down_proj[e] @ (silu(gate) * up), gate and up the first and second half of gate_up_proj[e] @ x."""
    assert top_k_index.dtype == torch.int32 and gate_up_proj.dim() == down_proj.dim() == 3
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(gate_up_proj.shape[0]):
        tok, slot = (top_k_index == e).nonzero(as_tuple=True)
        if tok.numel():
            gate, up = (x[tok] @ gate_up_proj[e].T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ down_proj[e].T
            out.index_add_(0, tok, y.float() * top_k_weights[tok, slot, None])
    return out.to(x.dtype)


@pytest.mark.parametrize("name", list(bml.CPU_MODELS))
def test_moe_layer_liger_peer_wiring(name, monkeypatch):
    """The Liger peer's wiring on the CPU, Liger's kernel replaced by its documented contract: our weights,
    gate rows first, fp32 routing as int32 indices and fp32 weights, shared experts and aux loss; it passes
    the same check as every peer. A swapped gate/up would not."""
    spec, cfg, layer, x, dout = _tiny_layer(name)
    monkeypatch.setattr(bml_peers, "liger_fused_moe", lambda: (_liger_contract, "contract"))
    with pytest.raises(RuntimeError, match="Triton kernels on a GPU; this run is on cpu"):
        bml_peers.build_liger(layer)

    def route(x2):
        logits = bml_peers.torch_native.router_logits(x2, layer.router.weight)
        return bml_peers.torch_native.route(logits, cfg.router, layer.router.expert_bias)[1]

    impl = bml_peers.Impl("liger", bml_peers.LigerMoE(layer, _liger_contract).train(), "contract",
                          layer.router.weight, route)
    assert {id(p) for p in impl.params()} == {id(p) for p in layer.parameters()}  # our very tensors
    assert 0 < bml_checks.check_peer(name, layer, impl, x, dout) <= 1  # includes the aux loss (AUX_PEERS)

    def swapped(x, w13, w2, idx, w):
        F_ = w13.shape[1] // 2
        return _liger_contract(x, torch.cat([w13[:, F_:], w13[:, :F_]], dim=1), w2, idx, w)

    wrong = bml_peers.Impl("liger", bml_peers.LigerMoE(layer, swapped).train(), "swapped", layer.router.weight, route)
    with pytest.raises(AssertionError, match="output on the"):
        bml_checks.check_peer(name, layer, wrong, x, dout)


def test_moe_layer_token_counts_and_bars():
    gpu = harness.Context(torch.device("cuda"), quick=False, out_dir=Path("."))
    assert bml.token_counts(gpu, "qwen3-30b-a3b") == (4096, 8192, 16384, 32768)  # the TFLOP/s bar's count
    assert bml.token_counts(gpu, "deepseek-v3") == bml.TOKENS == (4096, 8192, 16384)
    gpu_quick = harness.Context(torch.device("cuda"), quick=True, out_dir=Path("."))
    assert bml.token_counts(gpu_quick, "qwen3-30b-a3b") == (bml.HEADLINE_T,)
    cpu = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    assert bml.token_counts(cpu, "tiny-qwen3-30b-a3b") == bml.CPU_TOKENS[:1]
    # perf.md's full-layer row: 3x hf_eager on the forward (the headline), 1.3x hf_grouped_mm and 1.0x Liger
    # on fwd+bwd, 450 TFLOP/s on qwen3-30b-a3b at 32768 tokens
    assert bml.BARS == {("moe_layer_fwd", "hf_eager"): 3, ("moe_layer_fwd_bwd", "hf_grouped_mm"): 1.3,
                        ("moe_layer_fwd_bwd", "liger"): 1.0}


def test_moe_layer_slow_implementations_keep_to_the_time_budget(monkeypatch):
    """One call is timed first; an implementation whose warmup + reps would overrun the budget gets fewer
    reps (never more than the run's, never fewer than MIN_REPS), and so do its time_modes passes."""
    gpu_quick = harness.Context(torch.device("cuda"), quick=True, out_dir=Path("."))
    gpu_full = harness.Context(torch.device("cuda"), quick=False, out_dir=Path("."))
    assert bml.time_budget_s(gpu_quick) == bml.QUICK_TIME_BUDGET_S < bml.time_budget_s(gpu_full) == bml.TIME_BUDGET_S
    seen = []
    monkeypatch.setattr(harness, "time_fn", lambda fn, **kw: seen.append((kw["warmup"], kw["reps"]))
                        or harness.Timing(1.0, 1.0, 1.0))
    for one, expected in ((0.001, (5, 30)), (0.3, (1, 9)), (2.0, (1, bml.MIN_REPS))):
        monkeypatch.setattr(bml, "one_call_s", lambda ctx, fn, inputs, one=one: one)
        _, reps, got_one = bml.time_impl(gpu_quick, None, [()])
        assert seen[-1] == expected and reps == expected[1] and got_one == one
        # hf_eager's fwd+bwd (~0.3 s a call on an H100) costs ~3.3 s a case instead of 35 calls' ~11 s
    assert bml.modes_reps(gpu_quick, 0.0057) == gpu_quick.reps  # ours at 8192: 3 x 30 calls fit 3 s
    assert bml.modes_reps(gpu_quick, 0.043) == 23  # torch-native at 32768
    assert bml.modes_reps(gpu_quick, 1.0) == bml.MIN_REPS
    cpu = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    monkeypatch.setattr(bml, "one_call_s", lambda ctx, fn, inputs: 10.0)
    assert bml.time_impl(cpu, None, [()])[1] == cpu.reps  # capped, but never above the run's reps


def test_moe_layer_prints_a_line_per_check_timing_and_mode(monkeypatch, tmp_path, capsys):
    pytest.importorskip("transformers", minversion="5.0")
    monkeypatch.setattr(bml, "CPU_MODELS", {"tiny-qwen3-30b-a3b": bml.CPU_MODELS["tiny-qwen3-30b-a3b"]})
    rep = bml.run(harness.Context(torch.device("cpu"), quick=True, out_dir=tmp_path, modes=True))
    assert rep.failures == [] and rep.skipped == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[moe_layer]")]
    for routing in bml.ROUTINGS:
        case = f"tiny-qwen3-30b-a3b/T64/{routing}"
        mine = [line for line in lines if line.startswith(f"[moe_layer] {case} ")]
        for what in ("check vs torch_native: ok", "check vs hf_eager: ok", "ours moe_layer_fwd:",
                     "ours moe_layer_fwd_bwd:", "hf_eager moe_layer_fwd_bwd:", "ours modes:", "torch_native modes:",
                     "case done"):
            assert any(f" {what}" in line for line in mine), (what, mine)
        assert all(re.search(r"\(\d+\.\d s\)$", line) for line in mine)  # each with its wall time


def test_moe_layer_case_out_of_memory_is_skipped(monkeypatch, tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    monkeypatch.setattr(bml, "CPU_MODELS", {"tiny-qwen3-30b-a3b": bml.CPU_MODELS["tiny-qwen3-30b-a3b"]})
    real = bml.run_case

    def oom_on_zipf(ctx, name, spec, cfg, setup, T, layer, peers, skipped, routing="uniform", shift=None):
        if routing == "zipf":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB.")
        return real(ctx, name, spec, cfg, setup, T, layer, peers, skipped, routing, shift)

    monkeypatch.setattr(bml, "run_case", oom_on_zipf)
    rep = bml.run(harness.Context(torch.device("cpu"), quick=True, out_dir=tmp_path))
    assert rep.failures == [] and {r.routing for r in rep.results} == {"uniform"}
    assert rep.skipped == ["tiny-qwen3-30b-a3b/T64/zipf: out of memory: CUDA out of memory. Tried to allocate 9.00 GiB."]
