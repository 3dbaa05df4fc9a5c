"""The FP8 recipe's fused region (moe_kernels.nn.fused_fp8) against the recipe's functions it replaces: outputs and
gradients bit for bit, its extension calls (one each way) and the kernels they launch, the weight cache and the
gradient sinks as the recipe uses them, no host sync, first derivatives only, and the recipe's functions wherever the
region does not fit.

The region needs an FP8 kernel for every expert GEMM (C.moe_fp8_path): the sm_90a kernels on an H100 / H200, the
tensor-core portable one on 8.9 and later with MOE_KERNELS_PORTABLE_MMA=1. Emulated, the GPU reports 8.0, so the tests
that run the region skip there and run in tests/ops/test_grouped_mm_fp8_mma_gpu.py's rerun on an emulated 8.9 with
that kernel; the tests of where the region does not fit run in both."""

import pytest
import torch

from moe_kernels.nn import PRESETS, MoELayer, fused_fp8, grad_sink
from moe_kernels.quant import Fp8BlockwiseRecipe, weight_cache
from moe_kernels.testing import assert_exact, extension_calls, kernel_launches, no_host_sync

pytestmark = pytest.mark.gpu


def _region_runs(device) -> bool:
    """Whether this GPU has an FP8 kernel for the region's GEMMs (at the tests' sizes: H, F multiples of 16)."""
    from moe_kernels import _ext

    C = _ext.kernels("grouped_mm_fp8", torch.empty(0, device=device))
    return C is not None and C.moe_fp8_path(384, 128, 128, fused_fp8.SWIGLU, 8, 0 if device.index is None
                                             else device.index)


@pytest.fixture
def region(cuda):
    """The device, for tests that run the region (skipped where it cannot run: the module docstring)."""
    if not _region_runs(cuda):
        pytest.skip("no FP8 kernel for the region's GEMMs on this GPU: tests/ops/test_grouped_mm_fp8_mma_gpu.py's "
                    "rerun on an emulated 8.9 runs this test with the tensor-core portable kernel")
    return cuda


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
    """_step on the region and on the recipe's functions: (region results, recipe results, the region's kernel
    launches, the recipe's); the layer's expert_path names each. The region makes one extension call each way (the
    first call at a shape asks for its workspace size first)."""
    with extension_calls() as ext, kernel_launches() as kernels:
        region = _step(layer, *args, **kw)
    assert layer.expert_path == "fused_fp8"
    assert ext.calls.get("moe_fp8_fwd") in (1, 2) and ext.calls.get("moe_fp8_bwd") in (1, 2), ext.calls
    per_kernel = {"permute_fwd", "rows_to_tokens", "unpermute_fwd", "unpermute_bwd_fp8", "grouped_mm",
                  "swiglu_fwd_fp8", "swiglu_bwd_fp8", "rows_fp8", "fp8_dequant_scales"}
    assert not per_kernel & set(ext.calls), ext.calls
    region_kernels = dict(kernels)
    with monkeypatch.context() as m:
        m.setattr(fused_fp8, "fits", lambda *a: False)
        with extension_calls() as ext, kernel_launches() as kernels:
            recipe = _step(layer, *args, **kw)
    assert layer.expert_path == "recipe"
    assert "moe_fp8_fwd" not in ext.calls, ext.calls
    return region, recipe, region_kernels, dict(kernels)


def _kernels_like(kernels: dict[str, int], prefix: str) -> int:
    """Launches of the kernels whose bare names start with `prefix` (a producer's variants)."""
    return sum(n for name, n in kernels.items() if name.startswith(prefix))


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
def test_region_equals_the_recipes_functions(region, monkeypatch, case):
    activation, H, F, E, k, T, pow2, kw = CASES[case]
    layer = _layer(region, activation=activation, H=H, F=F, E=E, k=k, pow2=pow2, **kw)
    x, g = _inputs(region, H, T)
    ours, recipe, ours_kernels, recipe_kernels = _both(monkeypatch, layer, x, g)
    _assert_same(ours, recipe, case)
    assert all(t is not None for t in ours), "every input and parameter gets its gradient"
    # The kernels of the recipe's functions, the same number of each: both gathers, the unpermute of the output
    # and of dx, the routing weights' gradient, both activation producers, and each GEMM's dequantization scales.
    want = {"rows_to_tokens_kernel": 1, "unpermute_bwd_fp8_kernel": 2, "unpermute_fwd_kernel": 2,
            "unpermute_bwd_kernel": 1, "dequant_scales_kernel": 6}
    assert {name: ours_kernels.get(name) for name in want} == want, ours_kernels
    if activation == "swiglu":
        assert (_kernels_like(ours_kernels, "swiglu_fp8"), _kernels_like(ours_kernels, "swiglu_bwd_fp8")) == (1, 1)
    else:
        assert _kernels_like(ours_kernels, "rows_fp8") == 2, ours_kernels
    assert "rows_to_tokens_kernel" not in recipe_kernels, recipe_kernels
    for name in ("unpermute_bwd_fp8_kernel", "unpermute_bwd_kernel", "dequant_scales_kernel"):
        assert recipe_kernels.get(name) == ours_kernels[name], (name, recipe_kernels)


def test_region_under_autocast_with_fp32_weights(region, monkeypatch):
    # fp32 parameters, bf16 compute: the tokens cast once by the layer, each weight gradient fp32 from the epilogue.
    layer = _layer(region, dtype=torch.float32)
    x, g = _inputs(region, 128, dtype=torch.float32)
    ours, recipe, kernels, _ = _both(monkeypatch, layer, x, g, autocast=True)
    _assert_same(ours, recipe, "autocast")
    assert kernels.get("rows_to_tokens_kernel") == 1
    assert layer.experts.w13.grad.dtype == torch.float32


@pytest.mark.parametrize("frozen", ["x", "router"])
def test_region_partial_gradients(region, monkeypatch, frozen):
    # x without a gradient (the first layer's input): no dgrad of the up projection nor permute backward; with the
    # router frozen too, no routing weights' gradient (no unpermute_bwd).
    layer = _layer(region)
    if frozen == "router":
        layer.router.requires_grad_(False)
    x, g = _inputs(region, 128)
    ours, recipe, kernels, _ = _both(monkeypatch, layer, x, g, x_grad=False)
    _assert_same(ours, recipe, frozen)
    assert kernels.get("rows_to_tokens_kernel") == 1
    assert ("unpermute_bwd_kernel" in kernels) == (frozen != "router"), kernels
    assert kernels.get("unpermute_fwd_kernel") == 1, kernels
    assert kernels.get("dequant_scales_kernel") == 5, kernels  # no dgrad of the up projection


def test_region_takes_the_weight_cache(region, monkeypatch):
    # With the cache on, a later micro-batch quantizes no weight, on the region as on the recipe's functions.
    layer = _layer(region)
    x, g = _inputs(region, 128)
    weight_cache.enable(True)
    try:
        for ours in (True, False):
            if not ours:
                monkeypatch.setattr(fused_fp8, "fits", lambda *a: False)
            weight_cache.clear()
            first = _step(layer, x, g)
            before = weight_cache.stats()
            with extension_calls() as ext:
                later = _step(layer, x, g)
            after = weight_cache.stats()
            assert after["quantized"] == before["quantized"] and after["hits"] == before["hits"] + 2
            assert "fp8_quantize_experts" not in ext.calls, ext.calls
            assert ("moe_fp8_fwd" in ext.calls) == ours, ext.calls
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


def test_region_writes_the_gradient_sinks(region, monkeypatch):
    # Two micro-batches: the first product written into each expert weight's sink, the second added there by the
    # kernel; autograd gets no gradient for those weights. The same sums, bit for bit, as the recipe's functions.
    layer = _layer(region)
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
                x, g = _inputs(region, 128, seed=seed)
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


def test_region_has_no_host_sync(region):
    # ... and, at a shape seen before, one extension call each way.
    layer = _layer(region)
    x, g = _inputs(region, 128)
    _step(layer, x, g)  # workspace sizes asked once
    with extension_calls() as ext, no_host_sync():
        _step(layer, x, g)
    assert (ext.calls.get("moe_fp8_fwd"), ext.calls.get("moe_fp8_bwd")) == (1, 1), ext.calls


def test_region_has_first_derivatives_only(region):
    layer = _layer(region)
    x, _ = _inputs(region, 128)
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
    assert "moe_fp8_fwd" not in ext.calls and "moe_fp8_bwd" not in ext.calls, (why, ext.calls)
    assert layer.expert_path == ("ops" if why == "no-fused-permute" else "recipe")


def test_fits_refuses_what_the_region_cannot_take(region):
    # Inputs the layer does not make itself, refused before any launch: int64 or strided indices, no tokens, a
    # strided x, a recipe subclass (its methods may differ from the functions the region replaces).
    from moe_kernels.nn import fused

    class Recipe(Fp8BlockwiseRecipe):
        pass

    layer = _layer(region)
    w13, w2 = layer.experts.w13, layer.experts.w2
    x = torch.randn(16, 128, device=region, dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (16, 2), device=region, dtype=torch.int32)
    L, recipe = fused.launch_for(x), Fp8BlockwiseRecipe()
    assert L is not None and fused_fp8.fits(L, recipe, x, idx, w13, w2)
    refused = {"int64 indices": (recipe, x, idx.long()), "strided indices": (recipe, x, idx.t().contiguous().t()),
               "no tokens": (recipe, x[:0], idx[:0]), "strided x": (recipe, torch.randn(128, 16, device=region,
                                                                                       dtype=torch.bfloat16).t(), idx),
               "a recipe subclass": (Recipe(), x, idx)}
    for what, (r, xi, ii) in refused.items():
        assert not fused_fp8.fits(L, r, xi, ii, w13, w2), what
    assert not fused_fp8.fits(L, recipe, x, idx, w13, w2, 4), "another expert count than the weights'"


def _extension(device):
    from moe_kernels import _ext

    return _ext.kernels("grouped_mm_fp8", torch.empty(0, device=device))


@pytest.mark.parametrize("act", [fused_fp8.SWIGLU, fused_fp8.SQUARED_RELU])
def test_moe_fp8_path_answers_as_the_gemms_choose(cuda, act):
    # The region's query against grouped_mm_path on each of its GEMMs (the up and down projections, both dgrads,
    # both wgrads in float32 and bfloat16): true exactly where every one has an FP8 kernel, whatever this GPU has.
    from moe_kernels.ops.grouped_mm_fp8 import _E4M3_CODE, _FP8_PATHS

    C = _extension(cuda)
    dev = 0 if cuda.index is None else cuda.index

    def has_kernel(op, M, N, K, out=0):
        # (op, dtype, num_groups, M, N, K, a, b, d, device, sfa, sfb, fp8_wgrad_out): aligned stand-in addresses
        return C.grouped_mm_path(op, _E4M3_CODE, E, M, N, K, 0, 0, 0, dev, 256, 256, out) in _FP8_PATHS

    def up(n):
        return -(-n // 128) * 128

    E = 8
    for R, H, F in [(384, 128, 128), (300, 144, 208), (1, 128, 80), (384, 0, 128), (384, 128, 0), (0, 128, 128),
                    (384, 132, 128), (384, 128, 36)]:
        W = 2 * F if act == fused_fp8.SWIGLU else F
        gemms = [(0, R, W, up(H)), (0, R, H, up(F)), (0, R, F, up(H)), (0, R, H, up(W))]
        gemms += [(2, up(R), N, K, out) for N, K in ((H, F), (W, H)) for out in (0, 2)]
        want = min(R, H, F) > 0 and all(has_kernel(*g) for g in gemms)
        assert C.moe_fp8_path(R, H, F, act, E, dev) == want, (R, H, F)


def test_the_recipes_functions_where_a_gemm_has_no_fp8_kernel(cuda, monkeypatch):
    # Where the query says no (on every GPU without an FP8 kernel: the dequantizing fallback), the layer runs the
    # recipe's functions.
    C = _extension(cuda)
    monkeypatch.setattr(C, "moe_fp8_path", lambda *a: False)
    layer = _layer(cuda)
    x, g = _inputs(cuda, 128)
    with extension_calls() as ext:
        grads = _step(layer, x, g)
    assert layer.expert_path == "recipe" and "moe_fp8_fwd" not in ext.calls, ext.calls
    assert all(t is not None and torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("why", ["no hidden size", "no FP8 kernel"])
def test_region_entries_refuse_what_they_cannot_run(cuda, why):
    # Called with a size the region never takes, or where a GEMM has no FP8 kernel (every shape on a GPU without
    # one), each entry raises before it launches anything, once its workspace is large enough.
    from moe_kernels import _ext

    C = _extension(cuda)
    dev = 0 if cuda.index is None else cuda.index
    T, k, R, H, F, E = 4, 2, 384, 0 if why == "no hidden size" else 128, 128, 8
    if why == "no FP8 kernel" and C.moe_fp8_path(R, H, F, 0, E, dev):
        pytest.skip("this GPU has an FP8 kernel for every GEMM of the region")
    buf, p = _ext.workspace(1 << 20, torch.empty(0, device=cuda))  # (256-byte aligned)
    buf.zero_()
    fwd = (p,) * 17 + (T, k, R, H, F, E, 128, 0, False)
    bwd = (p,) * 17 + (0, False, p, 0, False, p, T, k, R, H, F, E, 0, False)
    match = "must be positive" if why == "no hidden size" else "has no FP8 kernel"
    for name, args in (("moe_fp8_fwd", fwd), ("moe_fp8_bwd", bwd)):
        entry = getattr(C, name)
        need = 1 << 20 if H == 0 else entry(*args, 0, 0, dev, 0)
        assert 0 < need <= (1 << 20), (name, need)
        with pytest.raises(ValueError, match=match):
            entry(*args, p, need, dev, 0)
        assert not buf.any(), f"{name} wrote before it refused"


@pytest.mark.parametrize("reentrant", [False, True])
def test_region_under_activation_checkpointing(region, reentrant):
    # The layer recomputed in the backward (torch.utils.checkpoint): the same outputs and gradients as without.
    layer = _layer(region)
    x, g = _inputs(region, 128)
    want = _step(layer, x, g)
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    out, aux = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=reentrant)
    ((out.float() * g).sum() + aux).backward()
    _assert_same([out.detach(), aux.detach(), xi.grad] + [p.grad for p in layer.parameters()], want,
                 f"checkpointed (reentrant={reentrant})")


def test_region_refuses_weights_that_do_not_fit_the_activation(cuda):
    # SwiGLU's w13 [E, 2F, H] called as the squared ReLU's (h would be written at F rows' width), and the squared
    # ReLU's [E, F, H] as SwiGLU's: a ValueError before anything runs.
    from moe_kernels.nn import fused

    for activation, act in (("swiglu", fused_fp8.SQUARED_RELU), ("squared_relu", fused_fp8.SWIGLU)):
        layer = _layer(cuda, activation=activation)
        w13, w2 = layer.experts.w13, layer.experts.w2
        x = torch.randn(16, 128, device=cuda, dtype=torch.bfloat16)
        idx = torch.randint(0, 8, (16, 2), device=cuda, dtype=torch.int32)
        L = fused.launch_for(x)
        with pytest.raises(ValueError, match="does not fit the activation"):
            fused_fp8.moe_fp8_region(L, x, idx, None, w13, w2, 8, 128, Fp8BlockwiseRecipe(), act)
