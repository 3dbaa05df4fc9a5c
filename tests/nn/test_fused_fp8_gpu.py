"""The FP8 recipe's fused region (moe_kernels.nn.fused_fp8) against the recipe's functions it replaces: outputs and
gradients bit for bit, its launches, the weight cache and the gradient sinks as the recipe uses them, no host
sync, first derivatives only, and the recipe's functions wherever the region does not fit."""

import pytest
import torch

from moe_kernels.nn import PRESETS, MoELayer, fused_fp8, grad_sink
from moe_kernels.quant import Fp8BlockwiseRecipe, weight_cache
from moe_kernels.testing import assert_exact, extension_calls, no_host_sync

pytestmark = pytest.mark.gpu


def _layer(device, *, activation="swiglu", H=128, F=128, E=8, k=2, pow2=False, dtype=torch.bfloat16, recipe=None,
           **kw):
    torch.manual_seed(0)
    cfg = PRESETS["qwen3-30b-a3b"](hidden_size=H, ffn_size=F, num_experts=E, k=k, activation=activation,
                                   recipe=recipe or Fp8BlockwiseRecipe(pow2_scale=pow2), **kw)
    layer = MoELayer(cfg).to(device, dtype)
    layer.router.float()
    return layer


def _inputs(device, H, T=37, dtype=torch.bfloat16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, H, generator=gen).to(device, dtype)
    g = torch.randn(1, T, H, generator=gen).to(device)
    return x, g


def _step(layer, x, g, *, x_grad=True, autocast=False):
    """Forward + backward: [out, aux, dx (when x wants one), every parameter's grad]."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x_grad)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out, aux = layer(x)
    ((out.float() * g).sum() + aux).backward()
    return [out.detach(), aux.detach()] + ([x.grad] if x_grad else []) + [p.grad for p in layer.parameters()]


def _both(monkeypatch, layer, *args, **kw):
    """_step on the region and on the recipe's functions: (region results, recipe results, the region's
    extension calls, the recipe's); the layer's expert_path names each."""
    with extension_calls() as ext:
        region = _step(layer, *args, **kw)
    assert layer.expert_path == "fused_fp8"
    region_calls = dict(ext.calls)
    with monkeypatch.context() as m:
        m.setattr(fused_fp8, "fits", lambda *a: False)
        with extension_calls() as ext:
            recipe = _step(layer, *args, **kw)
    assert layer.expert_path == "recipe"
    return region, recipe, region_calls, dict(ext.calls)


def _assert_same(region, recipe, what):
    assert len(region) == len(recipe)
    for i, (a, b) in enumerate(zip(region, recipe)):
        if b is None:
            assert a is None, f"{what}: gradient {i} is None on the recipe's functions only"
        else:
            assert_exact(a, b, f"{what}: output/gradient {i}")


CASES = {
    # (activation, H, F, experts, k, tokens, pow2, more options): every producer at multiples of 128; codes
    # zero-padded to 128 along H and F; the squared ReLU (Nemotron-H's experts); power-of-two scales; most experts
    # empty; one token; slots dropped by the capacity (row_map -1: rows no slot maps to in both gathers).
    "swiglu": ("swiglu", 128, 128, 8, 2, 37, False, {}),
    "swiglu-off-128": ("swiglu", 144, 208, 8, 2, 37, False, {}),
    "squared-relu": ("squared_relu", 128, 208, 8, 2, 37, False, {}),
    "pow2": ("swiglu", 128, 80, 8, 2, 37, True, {}),
    "mostly-empty": ("swiglu", 128, 128, 32, 2, 5, False, {}),
    "one-token": ("squared_relu", 144, 128, 8, 1, 1, True, {}),
    "capacity": ("swiglu", 128, 128, 8, 2, 37, False, {"capacity_factor": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_region_equals_the_recipes_functions(cuda, monkeypatch, case):
    activation, H, F, E, k, T, pow2, kw = CASES[case]
    layer = _layer(cuda, activation=activation, H=H, F=F, E=E, k=k, pow2=pow2, **kw)
    x, g = _inputs(cuda, H, T)
    region, recipe, region_calls, recipe_calls = _both(monkeypatch, layer, x, g)
    _assert_same(region, recipe, case)
    assert all(t is not None for t in region), "every input and parameter gets its gradient"
    act_fwd, act_bwd = ("swiglu_fwd_fp8", "swiglu_bwd_fp8") if activation == "swiglu" else ("rows_fp8", "rows_fp8")
    want = {"permute_fwd": 1, "rows_to_tokens": 1, "unpermute_bwd_fp8": 2, "unpermute_fwd": 2, "unpermute_bwd": 1}
    want[act_fwd] = want.get(act_fwd, 0) + 1
    want[act_bwd] = want.get(act_bwd, 0) + 1
    assert {name: region_calls.get(name) for name in want} == want, region_calls
    assert "rows_to_tokens" not in recipe_calls, recipe_calls


def test_region_under_autocast_with_fp32_weights(cuda, monkeypatch):
    # fp32 parameters, bf16 compute: the tokens cast once by the layer, each weight gradient fp32 from the epilogue.
    layer = _layer(cuda, dtype=torch.float32)
    x, g = _inputs(cuda, 128, dtype=torch.float32)
    region, recipe, region_calls, _ = _both(monkeypatch, layer, x, g, autocast=True)
    _assert_same(region, recipe, "autocast")
    assert region_calls.get("rows_to_tokens") == 1
    assert layer.experts.w13.grad.dtype == torch.float32


@pytest.mark.parametrize("frozen", ["x", "router"])
def test_region_partial_gradients(cuda, monkeypatch, frozen):
    # x without a gradient (the first layer's input): no dgrad of the up projection nor permute backward; with the
    # router frozen too, no routing weights' gradient (no unpermute_bwd).
    layer = _layer(cuda)
    if frozen == "router":
        layer.router.requires_grad_(False)
    x, g = _inputs(cuda, 128)
    region, recipe, calls, _ = _both(monkeypatch, layer, x, g, x_grad=False)
    _assert_same(region, recipe, frozen)
    assert calls.get("rows_to_tokens") == 1
    assert ("unpermute_bwd" in calls) == (frozen != "router"), calls
    assert calls.get("unpermute_fwd") == 1, calls


def test_region_takes_the_weight_cache(cuda, monkeypatch):
    # With the cache on, a later micro-batch quantizes no weight, on the region as on the recipe's functions.
    layer = _layer(cuda)
    x, g = _inputs(cuda, 128)
    weight_cache.enable(True)
    try:
        for region in (True, False):
            if not region:
                monkeypatch.setattr(fused_fp8, "fits", lambda *a: False)
            weight_cache.clear()
            first = _step(layer, x, g)
            before = weight_cache.stats()
            with extension_calls() as ext:
                later = _step(layer, x, g)
            after = weight_cache.stats()
            assert after["quantized"] == before["quantized"] and after["hits"] == before["hits"] + 2
            assert "fp8_quantize_experts" not in ext.calls, ext.calls
            assert ("rows_to_tokens" in ext.calls) == region, ext.calls
            _assert_same(later, first, "cached tiles")
    finally:
        weight_cache.enable(False)


class _Sink:
    """An fp32 main gradient as moe_kernels.train.master keeps one."""

    def __init__(self, p):
        self.buf = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        self.marks = 0

    def buffer(self):
        return self.buf

    def written(self):
        return self.marks > 0

    def mark(self):
        self.marks += 1


def test_region_writes_the_gradient_sinks(cuda, monkeypatch):
    # Two micro-batches: the first product written into each expert weight's sink, the second added there by the
    # kernel; autograd gets no gradient for those weights. The same sums, bit for bit, as the recipe's functions.
    layer = _layer(cuda)
    experts = (layer.experts.w13, layer.experts.w2)
    sums = []
    for off in (False, True):
        if off:
            monkeypatch.setattr(fused_fp8, "fits", lambda *a: False)
        sinks = [_Sink(p) for p in experts]
        for p, sink in zip(experts, sinks):
            grad_sink.register(p, sink)
        try:
            for seed in (1, 2):
                x, g = _inputs(cuda, 128, seed=seed)
                grads = _step(layer, x, g)
                assert experts[0].grad is None and experts[1].grad is None
                assert all(t is not None for t in grads[:3])
        finally:
            for p in experts:
                grad_sink.unregister(p)
        assert [s.marks for s in sinks] == [2, 2]
        # written in place twice: the version counter says so (autograd's checks of saved tensors read it)
        assert [s.buf._version for s in sinks] == [2, 2]
        sums.append([s.buf for s in sinks])
    for a, b, name in zip(*sums, ("w13", "w2")):
        assert_exact(a, b, f"main gradient of {name}")
        assert a.abs().sum() > 0


def test_region_has_no_host_sync(cuda):
    layer = _layer(cuda)
    x, g = _inputs(cuda, 128)
    _step(layer, x, g)  # workspace sizes asked once
    with extension_calls() as ext, no_host_sync():
        _step(layer, x, g)
    assert ext.calls.get("rows_to_tokens") == 1


def test_region_has_first_derivatives_only(cuda):
    layer = _layer(cuda)
    x, _ = _inputs(cuda, 128)
    out, _ = layer(x.requires_grad_())
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(out.float().square().sum(), x, create_graph=True)


_NOT_FIT = {"no-fused-swiglu": dict(fused_swiglu=False), "no-fp8-dgrad": dict(fp8_dgrad=False),
            "no-fp8-wgrad": dict(fp8_wgrad=False), "no-fused-permute": dict(fused_permute=False)}


@pytest.mark.parametrize("why", ["fp16", "no-grad", "frozen-experts", "frozen-w2", "weights-in-activation",
                                 *_NOT_FIT])
def test_the_recipes_functions_where_the_region_does_not_fit(cuda, why):
    kw = {"weights_in_activation": True} if why == "weights-in-activation" else {}
    if why in _NOT_FIT:
        kw["recipe"] = Fp8BlockwiseRecipe(**_NOT_FIT[why])
    layer = _layer(cuda, dtype=torch.float16 if why == "fp16" else torch.bfloat16, **kw)
    if why == "frozen-experts":
        layer.experts.requires_grad_(False)
    if why == "frozen-w2":
        layer.experts.w2.requires_grad_(False)
    x, g = _inputs(cuda, 128, dtype=layer.experts.w13.dtype)
    with extension_calls() as ext:
        if why == "no-grad":
            with torch.no_grad():
                out, _ = layer(x)
            assert torch.isfinite(out).all()
        else:
            _step(layer, x, g)
    assert "rows_to_tokens" not in ext.calls, (why, ext.calls)
    assert layer.expert_path == ("ops" if why == "no-fused-permute" else "recipe")


def test_fits_refuses_what_the_region_cannot_take(cuda):
    # Inputs the layer does not make itself, refused before any launch: int64 or strided indices, no tokens, a
    # strided x, a recipe subclass (its methods may differ from the functions the region replaces).
    from moe_kernels.nn import fused

    class Recipe(Fp8BlockwiseRecipe):
        pass

    layer = _layer(cuda)
    w13, w2 = layer.experts.w13, layer.experts.w2
    x = torch.randn(16, 128, device=cuda, dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (16, 2), device=cuda, dtype=torch.int32)
    L, recipe = fused.launch_for(x), Fp8BlockwiseRecipe()
    assert L is not None and fused_fp8.fits(L, recipe, x, idx, w13, w2)
    refused = {"int64 indices": (recipe, x, idx.long()), "strided indices": (recipe, x, idx.t().contiguous().t()),
               "no tokens": (recipe, x[:0], idx[:0]), "strided x": (recipe, torch.randn(128, 16, device=cuda,
                                                                                       dtype=torch.bfloat16).t(), idx),
               "a recipe subclass": (Recipe(), x, idx)}
    for what, (r, xi, ii) in refused.items():
        assert not fused_fp8.fits(L, r, xi, ii, w13, w2), what


@pytest.mark.parametrize("reentrant", [False, True])
def test_region_under_activation_checkpointing(cuda, reentrant):
    # The layer recomputed in the backward (torch.utils.checkpoint): the same outputs and gradients as without.
    layer = _layer(cuda)
    x, g = _inputs(cuda, 128)
    want = _step(layer, x, g)
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    out, aux = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=reentrant)
    ((out.float() * g).sum() + aux).backward()
    _assert_same([out.detach(), aux.detach(), xi.grad] + [p.grad for p in layer.parameters()], want,
                 f"checkpointed (reentrant={reentrant})")
