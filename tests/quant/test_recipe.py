"""The FP8 blockwise recipe for the expert GEMMs: exact against its definition, close to the
high-precision product, and a training run that tracks the fp32 loss curve (specs/lowprec.md)."""

from __future__ import annotations

import functools

import pytest
import torch

from moe_kernels.models import PRESETS, build_model
from moe_kernels.nn import MoELayer
from moe_kernels.nn.moe import qwen3_30b_a3b
from moe_kernels.ops.grouped_mm import grouped_mm_reference
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8_reference, quantize_fp8_experts
from moe_kernels.ops.quant import dequantize_fp8, quantize_fp8
from moe_kernels.quant import RECIPES, Fp8BlockwiseRecipe, Nvfp4Recipe
from moe_kernels.testing import assert_tracks_loss_curve, assert_within_fp32_rounding, assert_within_rounding_to, quantized_sqnr_floor_db, sqnr_db
from moe_kernels.train.data import load_tokens


def _problem(M=300, N=384, K=256, sizes=(100, 0, 150, 50), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).requires_grad_()
    w = (torch.randn(len(sizes), N, K, generator=gen) * 0.05).requires_grad_()
    return x, w, torch.tensor(sizes, dtype=torch.int32), torch.randn(M, N, generator=gen)


@pytest.mark.parametrize("pow2", [False, True])
def test_forward_and_backward_follow_the_recipe(pow2):
    # Groups of any size (100, 150, 50 rows): the input-precision wgrad takes them.
    x, w, gs, dout = _problem()
    recipe = Fp8BlockwiseRecipe(pow2_scale=pow2, fp8_wgrad=False)
    out = recipe.grouped_mm(x, w, gs)
    dx, dw = torch.autograd.grad(out, (x, w), dout)
    rows = int(gs.sum())

    # Forward: E4M3 1x128 activations, 128x128 weight tiles, fp32 product, bf16 result.
    x_q, x_s = quantize_fp8(x.detach(), "block", pow2_scale=pow2)
    w_q, w_s = quantize_fp8_experts(w.detach(), pow2_scale=pow2)
    want = grouped_mm_fp8_reference(x_q, x_s, w_q, w_s, gs).to(torch.bfloat16).float()
    torch.testing.assert_close(out[:rows], want[:rows], rtol=0, atol=0)

    # dgrad: dout in E4M3 1x128 blocks along N times the forward's dequantized tiles (independent of the
    # transposed-tile reuse), bf16 result.
    d_q, d_s = quantize_fp8(dout, "block", pow2_scale=pow2)
    w_deq = torch.stack([dequantize_fp8(w_q[e], w_s[e], "tile", dtype=torch.float32) for e in range(len(gs))]).double()
    d_deq = dequantize_fp8(d_q, d_s, "block", dtype=torch.float32).double()
    want_dx = torch.cat([d_deq[a:b] @ w_deq[e] for e, (a, b) in enumerate(_ranges(gs))])
    magnitude = torch.cat([d_deq[a:b].abs() @ w_deq[e].abs() for e, (a, b) in enumerate(_ranges(gs))])
    # fp32 accumulation vs fp64, then both rounded to bf16: one bf16 ulp + fp32 rounding apart at most.
    assert_within_rounding_to(dx[:rows], want_dx.to(torch.bfloat16), magnitude, torch.bfloat16, "FP8 dgrad")

    # wgrad: the input precision, exactly the grouped wgrad.
    torch.testing.assert_close(dw, torch.ops.moe_kernels.grouped_mm_wgrad(dout, x.detach(), gs), rtol=0, atol=0)
    assert torch.all(dw[1] == 0)  # the empty expert

    # Against the exact product: two E4M3 operands, 3 mantissa bits each (moe_kernels.testing's quantization
    # error model: 1.5 x sqrt(2) x 0.0265 relative L2 error, 25.0 dB).
    exact = grouped_mm_reference(x.detach().double(), w.detach().double(), gs)
    assert sqnr_db(out[:rows], exact[:rows]) > quantized_sqnr_floor_db(2)
    exact_dx = torch.ops.moe_kernels.grouped_mm_dgrad(dout.double(), w.detach().double(), gs)
    assert sqnr_db(dx[:rows], exact_dx[:rows]) > quantized_sqnr_floor_db(2)


def _ranges(gs):
    ends = torch.cumsum(gs, 0).tolist()
    return [(e - int(n), e) for e, n in zip(ends, gs.tolist())]


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_wgrad_follows_the_recipe(pow2):
    # 128-aligned groups with an empty expert and 16 rows past the groups (unspecified: NaN here), M not a
    # multiple of 128.
    x, w, gs, dout = _problem(M=400, sizes=(128, 0, 256, 0), seed=1)
    with torch.no_grad():
        x[384:] = float("nan")
    recipe = Fp8BlockwiseRecipe(pow2_scale=pow2)
    out = recipe.grouped_mm(x, w, gs)
    dout[384:] = float("nan")
    (dw,) = torch.autograd.grad(out, (w,), dout)

    # dout and x in E4M3 1x128 blocks along the tokens, the product of the dequantized operands.
    d_deq = _dequantize_along_tokens(dout, pow2)
    x_deq = _dequantize_along_tokens(x.detach(), pow2)
    want, magnitude = torch.zeros(dw.shape, dtype=torch.float64), torch.zeros(dw.shape, dtype=torch.float64)
    for e, (a, b) in enumerate(_ranges(gs)):
        want[e] = d_deq[a:b].t() @ x_deq[a:b]
        magnitude[e] = d_deq[a:b].abs().t() @ x_deq[a:b].abs()
    assert_within_fp32_rounding(dw, want, magnitude, "FP8 wgrad")
    assert torch.all(dw[1] == 0) and torch.all(dw[3] == 0)  # empty experts
    # Against the exact product: two E4M3 operands.
    exact = torch.ops.moe_kernels.grouped_mm_wgrad(dout[:384].double(), x.detach()[:384].double(), gs)
    assert sqnr_db(dw, exact) > quantized_sqnr_floor_db(2)


@pytest.mark.parametrize("kn", [False, True], ids=["nk", "kn"])
def test_contractions_past_multiples_of_128_are_zero_padded(kn):
    # K = 200 (the forward's contraction) and N = 184 (dgrad's) end in partial blocks: the quantizers write the
    # codes zero-padded to 256, the last block's scale from the elements present, so each product is the
    # unpadded operands' (Nemotron 3 Nano's F = 1856 is such a size). FP8 dgrad and wgrad; an empty expert,
    # rows past the groups; weights stored [E, N, K] and [E, K, N].
    from moe_kernels.quant import weight_cache

    x, w, gs, dout = _problem(M=400, N=184, K=200, sizes=(128, 0, 256, 0), seed=3)
    recipe = Fp8BlockwiseRecipe()
    weight = (w.detach().transpose(1, 2).contiguous() if kn else w.detach()).requires_grad_()
    weight_cache.enable()
    try:
        before = weight_cache.stats()
        mm = recipe.grouped_mm_kn if kn else recipe.grouped_mm
        out = mm(x, weight, gs)
        dx, dw = torch.autograd.grad(out, (x, weight), dout)
        after = weight_cache.stats()
    finally:
        weight_cache.enable(False)
    assert after["padded"] - before["padded"] == 2  # the forward's layout along K, dgrad's along N
    assert after["pad_copies"] == before["pad_copies"]  # both written padded by the quantization itself
    if kn:
        dw = dw.transpose(1, 2)
    rows = int(gs.sum())

    def deq(t):  # fp64 of E4M3 1x128 blocks along the rows, partial last blocks as they are
        q, sc = quantize_fp8(t.contiguous(), "block")
        return dequantize_fp8(q, sc, "block", dtype=torch.float32).double()

    w_q, w_s = quantize_fp8_experts(w.detach())
    w_deq = torch.stack([dequantize_fp8(w_q[e], w_s[e], "tile", dtype=torch.float32) for e in range(4)]).double()
    x_deq, d_deq = deq(x.detach()), deq(dout)
    x_tok, d_tok = _dequantize_along_tokens(x.detach(), False), _dequantize_along_tokens(dout, False)
    for e, (a, b) in enumerate(_ranges(gs)):
        if a == b:
            assert torch.all(dw[e] == 0)
            continue
        assert_within_rounding_to(out[a:b], (x_deq[a:b] @ w_deq[e].t()).to(torch.bfloat16),
                                  x_deq[a:b].abs() @ w_deq[e].abs().t(), torch.bfloat16, "forward")
        assert_within_rounding_to(dx[a:b], (d_deq[a:b] @ w_deq[e]).to(torch.bfloat16),
                                  d_deq[a:b].abs() @ w_deq[e].abs(), torch.bfloat16, "dgrad")
        assert_within_fp32_rounding(dw[e], d_tok[a:b].t() @ x_tok[a:b], d_tok[a:b].abs().t() @ x_tok[a:b].abs(),
                                    "wgrad")
    exact = grouped_mm_reference(x.detach().double(), w.detach().double(), gs)
    assert sqnr_db(out[:rows], exact[:rows]) > quantized_sqnr_floor_db(2)


def test_moe_layer_with_the_recipe_past_multiples_of_128():
    # F = 1856 (Nemotron 3 Nano's; 14.5 blocks of 128) and H = 208: every E4M3 operand's codes zero-padded to a
    # multiple of 128 (fp32 rows: the producers compose, the quantization pads); the layer's output and gradients
    # close to the bf16 layer's. (tests/quant/test_recipe_gpu.py runs the bf16 layer on the producers' kernels.)
    torch.manual_seed(0)
    cfg = qwen3_30b_a3b(hidden_size=208, ffn_size=1856, num_experts=4, k=2)
    ref = MoELayer(cfg)
    fp8 = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe()))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(48, 208)
    outs = []
    for layer in (ref, fp8):
        xi = x.clone().requires_grad_()
        y, aux = layer(xi)
        (y.square().sum() + aux).backward()
        outs.append((y.detach(), xi.grad, layer.experts.w2.grad, layer.experts.w13.grad))
    # The output: four E4M3 operands (x and w13, the activation and w2), 22.0 dB by the model. A gradient: the
    # forward's two into h, then two quantized operands per backward GEMM on its path (dout and w2; dh and w13
    # or x), six, 20.2 dB.
    for i, (got, want) in enumerate(zip(outs[1], outs[0])):
        assert sqnr_db(got, want) > quantized_sqnr_floor_db(6 if i else 4)


def _dequantize_along_tokens(t, pow2):
    """[M, C] -> fp64 [M, C]: E4M3 in 1x128 blocks along the tokens (quantize_fp8 of the transpose), by hand."""
    q, s = quantize_fp8(t.t().contiguous(), "block", pow2_scale=pow2)
    return dequantize_fp8(q, s, "block", dtype=torch.float32).double().t()


def test_fp8_wgrad_refuses_unaligned_groups():
    with pytest.raises(ValueError, match="multiple of 128 with fp8_wgrad"):
        Fp8BlockwiseRecipe(align=64)
    assert Fp8BlockwiseRecipe(align=64, fp8_wgrad=False).align == 64
    x, w, gs, dout = _problem()  # groups of 100, 150, 50 rows
    out = Fp8BlockwiseRecipe().grouped_mm(x, w, gs)
    with pytest.raises(ValueError, match="group 0 has 100 rows; every group must be a multiple of 128"):
        out.backward(dout)


def test_fp8_wgrad_saves_the_token_blocked_fp8_copy():
    # With FP8 wgrad the forward keeps x as E4M3 codes + scales (1 byte per element), not x itself.
    x, w, gs, dout = _problem(M=384, sizes=(128, 0, 256, 0))
    x = x.detach().to(torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        Fp8BlockwiseRecipe().grouped_mm(x, w, gs)
    assert not any(t.shape == x.shape and t.dtype == x.dtype for t in saved)
    assert any(t.dtype == torch.float8_e4m3fn and t.shape == (x.shape[1], 384) for t in saved)


def test_no_weight_gradient_keeps_nothing_for_wgrad(monkeypatch):
    # Inference and frozen experts: no token-blocked copy of x is made (nor, fused, the bf16 rows), and dx is
    # the same as with a weight gradient.
    from moe_kernels.quant import recipe as recipe_mod

    x, w, gs, dout = _problem(M=384, sizes=(128, 0, 256, 0))
    calls = []
    real = recipe_mod.quantize_fp8_tokens
    monkeypatch.setattr(recipe_mod, "quantize_fp8_tokens", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    recipe = Fp8BlockwiseRecipe()
    with torch.no_grad():
        recipe.grouped_mm(x, w, gs)
    (dx_frozen,) = torch.autograd.grad(recipe.grouped_mm(x, w.detach(), gs), (x,), dout)
    assert calls == []
    dx, _ = torch.autograd.grad(recipe.grouped_mm(x, w, gs), (x, w), dout)
    assert len(calls) == 2  # x in the forward, dout in the backward
    torch.testing.assert_close(dx_frozen, dx, rtol=0, atol=0)


def test_dgrad_in_input_precision_when_asked():
    x, w, gs, dout = _problem()
    out = Fp8BlockwiseRecipe(fp8_dgrad=False, fp8_wgrad=False).grouped_mm(x, w, gs)
    (dx,) = torch.autograd.grad(out, (x,), dout)
    rows = int(gs.sum())
    want = torch.ops.moe_kernels.grouped_mm_dgrad(dout, w.detach(), gs)
    torch.testing.assert_close(dx[:rows], want[:rows], rtol=0, atol=0)


def test_config_checks_and_alignment():
    with pytest.raises(ValueError, match="multiples of 16"):
        qwen3_30b_a3b(hidden_size=72, ffn_size=128, num_experts=4, k=2, recipe=Fp8BlockwiseRecipe())
    qwen3_30b_a3b(hidden_size=64, ffn_size=1856, num_experts=4, k=2, recipe=Fp8BlockwiseRecipe())  # padded to 128
    with pytest.raises(ValueError, match="torch-native backend"):
        qwen3_30b_a3b(hidden_size=128, ffn_size=128, num_experts=4, k=2, backend="torch", recipe=Fp8BlockwiseRecipe())
    cfg = qwen3_30b_a3b(hidden_size=128, ffn_size=128, num_experts=4, k=2, align=48, recipe=Fp8BlockwiseRecipe())
    assert cfg.permute_align == 384 and cfg.replace(recipe=None).permute_align == 48
    assert set(RECIPES) == {"bf16", "fp8-blockwise", "nvfp4"}


@pytest.mark.parametrize("fused_permute", [True, False])
def test_moe_layer_with_the_recipe(fused_permute, monkeypatch):
    torch.manual_seed(0)
    cfg = qwen3_30b_a3b(hidden_size=128, ffn_size=128, num_experts=4, k=2)
    ref_layer = MoELayer(cfg)
    layer = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe(fused_permute=fused_permute)))
    layer.load_state_dict(ref_layer.state_dict())
    seen = []  # the second GEMM's group sizes, by either path (SwiGLU + GEMM fused, or the experts' own)
    second_gemm = layer.experts.forward_from_gate_up
    layer.experts.forward_from_gate_up = lambda h, gs, *a, **kw: seen.append(gs.clone()) or second_gemm(h, gs, *a, **kw)
    fused_second = Fp8BlockwiseRecipe.swiglu_grouped_mm
    monkeypatch.setattr(Fp8BlockwiseRecipe, "swiglu_grouped_mm",
                        lambda self, h, rw, w, gs, **kw: seen.append(gs.clone()) or fused_second(self, h, rw, w, gs, **kw))
    x = torch.randn(2, 37, 128)
    out, _ = layer(x)
    ref, _ = ref_layer(x)
    assert torch.all(seen[0] % 128 == 0) and int(seen[0].sum()) >= 2 * 37 * 2  # padded groups
    # The SwiGLU experts quantize four operands (x and w13, the activation and w2): 22.0 dB by the model.
    assert sqnr_db(out, ref) > quantized_sqnr_floor_db(4)
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_permute_is_the_unfused_recipe(dtype):
    # The first GEMM's E4M3 input from the pass that permutes it (bf16: the gather writing both layouts; fp32:
    # permute_quantize_fp8) + the FP8 GEMM equals permute, then quantize + the FP8 GEMM: forward and gradients.
    torch.manual_seed(0)
    cfg = qwen3_30b_a3b(hidden_size=256, ffn_size=128, num_experts=6, k=2)
    _assert_same_layer(cfg, Fp8BlockwiseRecipe(), Fp8BlockwiseRecipe(fused_permute=False), dtype)


@pytest.mark.parametrize("weights_in_activation", [False, True])
def test_fused_swiglu_is_the_unfused_recipe(weights_in_activation):
    # swiglu_quantize_fp8 + the FP8 GEMM equals swiglu, then both quantizations + the FP8 GEMM: forward and
    # gradients (the routing weights' too when SwiGLU applies them); in the backward swiglu_bwd_quantize_fp8
    # equals swiglu_bwd, then both quantizations of dh in the up projection's backward.
    torch.manual_seed(1)
    cfg = qwen3_30b_a3b(hidden_size=256, ffn_size=256, num_experts=6, k=2, weights_in_activation=weights_in_activation)
    _assert_same_layer(cfg, Fp8BlockwiseRecipe(), Fp8BlockwiseRecipe(fused_swiglu=False))


@pytest.mark.parametrize("ffn_size", [256, 208])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_squared_relu_is_the_unfused_recipe(ffn_size, dtype):
    # Experts without a gate: squared_relu_quantize_fp8 + the FP8 GEMM equals squared_relu, then both
    # quantizations (F = 208 zero-padded) + the FP8 GEMM, forward and gradients; in the backward
    # squared_relu_bwd_quantize_fp8 equals squared_relu's backward, then both quantizations of dh in the up
    # projection's backward.
    torch.manual_seed(2)
    cfg = qwen3_30b_a3b(hidden_size=256, ffn_size=ffn_size, num_experts=6, k=2, activation="squared_relu")
    _assert_same_layer(cfg, Fp8BlockwiseRecipe(), Fp8BlockwiseRecipe(fused_swiglu=False), dtype)


def _counted(monkeypatch, names) -> dict[str, int]:
    """Calls of the FP8 recipe module's `names` (the producers and quantizers it calls), counted from now on."""
    import moe_kernels.quant.recipe as recipe_module

    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(recipe_module, name)
        monkeypatch.setattr(recipe_module, name,
                            lambda *a, _n=name, _f=real, **kw: calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **kw))
    return calls


@pytest.mark.parametrize("hidden, activation, ffn_size", [(256, "swiglu", 256), (256, "squared_relu", 256),
                                                         (256, "squared_relu", 208), (144, "swiglu", 208),
                                                         (144, "squared_relu", 208)])
def test_fused_layer_hands_the_expert_gemms_their_gradients_in_fp8(monkeypatch, hidden, activation, ffn_size):
    # In the layer's backward the unpermute writes dy in E4M3 (both layouts) for the down projection's backward
    # and the activation (SwiGLU or squared ReLU) writes dh in E4M3 for the up projection's: no quantization of a
    # bf16 gradient anywhere. In the forward the gather of the permuted rows writes x in both layouts (the second
    # unpermute_bwd_quantize_fp8 call), so no quantize_fp8_tokens of a kept bf16 x either; still bit for bit the
    # composition. H = 144 and F = 208 (no multiples of 128, as GPT-OSS's 2880): the producers write the codes
    # zero-padded, the SwiGLU backward's blocks of dh straddling d(gate) and d(up).
    from moe_kernels.nn import fused_fp8

    monkeypatch.setattr(fused_fp8, "fits", lambda *a: False)  # the recipe's functions, also under emulation
    calls = _counted(monkeypatch, ("quantize_fp8", "quantize_fp8_tokens", "quantize_fp8_dual", "swiglu_quantize_fp8",
                                   "squared_relu_quantize_fp8", "swiglu_bwd_quantize_fp8", "squared_relu_bwd_quantize_fp8",
                                   "unpermute_bwd_quantize_fp8"))
    torch.manual_seed(3)
    cfg = qwen3_30b_a3b(hidden_size=hidden, ffn_size=ffn_size, num_experts=6, k=2, activation=activation)
    layer = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe())).to(torch.bfloat16)
    out, aux = layer(torch.randn(2, 29, hidden, dtype=torch.bfloat16, requires_grad=True))
    (out.square().sum() + aux).backward()
    gated = activation == "swiglu"
    assert calls == {"quantize_fp8": 0, "quantize_fp8_tokens": 0, "quantize_fp8_dual": 0,
                     "swiglu_quantize_fp8": int(gated), "squared_relu_quantize_fp8": int(not gated),
                     "swiglu_bwd_quantize_fp8": int(gated), "squared_relu_bwd_quantize_fp8": int(not gated),
                     "unpermute_bwd_quantize_fp8": 2}


def test_fp8_gradient_link_rejects_a_second_consumer():
    recipe = Fp8BlockwiseRecipe()
    torch.manual_seed(4)
    x = torch.randn(40, 128, requires_grad=True)
    w13 = torch.nn.Parameter(torch.randn(4, 256, 128) * 0.05)
    w2 = torch.nn.Parameter(torch.randn(4, 128, 128) * 0.05)
    indices = torch.randint(0, 4, (40, 2), dtype=torch.int32)
    h, _, gs = recipe.permute_grouped_mm(x, indices, 4, 128, w13, swiglu_next=True)
    y = recipe.swiglu_grouped_mm(h, None, w2, gs)
    with pytest.raises(RuntimeError, match="received a gradient from another consumer"):
        (y.square().sum() + h.float().sum()).backward()
    # The same for the down projection's output read by Fp8BlockwiseRecipe.unpermute and by something else.
    h, row_map, gs = recipe.permute_grouped_mm(x, indices, 4, 128, w13)
    y = recipe.swiglu_grouped_mm(h, None, w2, gs, unpermute_next=True)
    out = recipe.unpermute(y, row_map, torch.rand(40, 2))
    with pytest.raises(RuntimeError, match="received a gradient from another consumer"):
        (out.square().sum() + y.float().sum()).backward()
    # Without unpermute_next y's gradient is an ordinary one: taken with respect to y it is not a placeholder.
    x.grad = None
    h, row_map, gs = recipe.permute_grouped_mm(x, indices, 4, 128, w13)
    y = recipe.swiglu_grouped_mm(h, None, w2, gs)
    (dy,) = torch.autograd.grad(recipe.unpermute(y, row_map, torch.rand(40, 2)).square().sum(), y)
    assert dy.abs().sum() > 0
    # The same for the squared ReLU's input, and the two flags together are refused.
    w1 = torch.nn.Parameter(torch.randn(4, 200, 128) * 0.05)
    w2s = torch.nn.Parameter(torch.randn(4, 128, 200) * 0.05)
    h, _, gs = recipe.permute_grouped_mm(x, indices, 4, 128, w1, squared_relu_next=True)
    y = recipe.squared_relu_grouped_mm(h, w2s, gs)
    with pytest.raises(RuntimeError, match="received a gradient from another consumer"):
        (y.square().sum() + h.float().sum()).backward()
    with pytest.raises(ValueError, match="give one"):
        recipe.permute_grouped_mm(x, indices, 4, 128, w13, swiglu_next=True, squared_relu_next=True)
    # A link made for one activation is not taken by the other (its gradient then comes as an ordinary one).
    import moe_kernels.quant.recipe as recipe_module

    h, _, gs = recipe.permute_grouped_mm(x, indices, 4, 128, w13, swiglu_next=True)
    assert h._fp8_grad_link is not None and h._fp8_grad_link.gated
    x.grad = None
    w2_256 = torch.nn.Parameter(torch.randn(4, 128, 256) * 0.05)
    sent = []
    real = recipe_module.squared_relu_bwd_quantize_fp8
    recipe_module.squared_relu_bwd_quantize_fp8 = lambda *a, **kw: sent.append(1) or real(*a, **kw)
    try:
        recipe.squared_relu_grouped_mm(h, w2_256, gs).square().sum().backward()
    finally:
        recipe_module.squared_relu_bwd_quantize_fp8 = real
    assert not sent  # dh went as an ordinary bf16 gradient
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    # Without swiglu_next the same graph is fine (dh in bf16, summed with the other gradient by autograd).
    h, _, gs = recipe.permute_grouped_mm(x, indices, 4, 128, w13)
    (recipe.swiglu_grouped_mm(h, None, w2, gs).square().sum() + h.float().sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w13.grad).all()


def _assert_same_layer(cfg, fused_recipe, plain_recipe, dtype=torch.float32):
    """The MoE layer under the two recipes, same weights and input: output and every gradient bit for bit."""
    fused = MoELayer(cfg.replace(recipe=fused_recipe)).to(dtype)
    plain = MoELayer(cfg.replace(recipe=plain_recipe)).to(dtype)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 41, cfg.hidden_size, dtype=dtype)
    grads = []
    for layer in (fused, plain):
        xi = x.clone().requires_grad_()
        out, aux = layer(xi)
        (out.square().sum() + aux).backward()
        grads.append((out, xi.grad, *(p.grad for p in layer.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _train(recipe, steps=20, seed=0):
    """Loss per step: the model initialised from `seed`, the same batches for every seed."""
    torch.manual_seed(seed)
    cfg = PRESETS["tiny-qwen3-moe"](hidden_size=128, ffn_size=128, num_layers=2, num_experts=4, k=2,
                                    vocab_size=256, recipe=recipe)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, _ = load_tokens(None)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - 65, (8,), generator=gen)
        batch = torch.stack([tokens[s : s + 65] for s in starts.tolist()])
        logits, aux = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        (loss + aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses)


@functools.lru_cache(maxsize=None)
def fp32_curves() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The fp32 run (seed 0) and two fp32 runs from other initialisation seeds: the error model's spread."""
    return _train(None), [_train(None, seed=s) for s in (1, 2)]


def test_training_tracks_the_high_precision_loss_curve():
    # Error model (moe_kernels.testing): FP8 moves the loss curve less than a new initialisation does.
    ref, seeds = fp32_curves()
    fp8 = _train(Fp8BlockwiseRecipe())
    assert fp8[-5:].mean() < 0.8 * fp8[:5].mean()  # it trains
    assert_tracks_loss_curve(fp8, ref, seeds, "FP8 blockwise recipe")


def _kn_problem(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([128, 0, 256, 128], dtype=torch.int32)  # an empty expert; groups padded to 128 rows
    M, K, N = int(sizes.sum()) + 16, 256, 384  # rows past the groups too
    x = torch.randn(M, K, generator=gen).to(device)
    w_kn = (torch.randn(len(sizes), K, N, generator=gen) * 0.05).to(device)
    return x, w_kn, sizes.to(device), torch.randn(M, N, generator=gen).to(device)


def _kn_runs(recipe, x, w_kn, sizes, dout):
    """The [E, K, N] product and the [E, N, K] one on the transposed copy: outputs and gradients."""
    runs = []
    for kn in (True, False):
        torch.manual_seed(0)  # NVFP4 wgrad's stochastic rounding: the same seed drawn
        xi = x.clone().requires_grad_()
        w = w_kn.clone() if kn else w_kn.transpose(1, 2).contiguous()
        w.requires_grad_()
        out = recipe.grouped_mm_kn(xi, w, sizes) if kn else recipe.grouped_mm(xi, w, sizes)
        (out * dout).sum().backward()
        rows = int(sizes.sum())
        runs.append((out[:rows], xi.grad[:rows], w.grad if kn else w.grad.transpose(1, 2)))
    return runs


@pytest.mark.parametrize("recipe", [Fp8BlockwiseRecipe(), Fp8BlockwiseRecipe(fp8_dgrad=False, fp8_wgrad=False),
                                    Fp8BlockwiseRecipe(pow2_scale=True), Nvfp4Recipe(stochastic_dgrad=False)],
                         ids=["fp8", "fp8-bf16-grads", "fp8-pow2", "nvfp4"])
def test_kn_weights_are_the_transposed_weights(recipe):
    # Experts stored [E, K, N] (transformers' Llama 4, Aria): the same codes as the [E, N, K] transpose (a tile is
    # its own transpose), so the same products, bit for bit: output, dx and dW (transposed back).
    (out, dx, dw), (ref_out, ref_dx, ref_dw) = _kn_runs(recipe, *_kn_problem("cpu"))
    for got, want, what in ((out, ref_out, "out"), (dx, ref_dx, "dx"), (dw, ref_dw, "dw")):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)


def test_kn_weights_quantized_once_a_step():
    # The weight cache keeps both layouts of an [E, K, N] weight from one quantization: a second forward hits.
    from moe_kernels.quant import weight_cache

    x, w_kn, sizes, dout = _kn_problem("cpu")
    w = w_kn.requires_grad_()
    weight_cache.enable()
    try:
        before = weight_cache.stats()
        for _ in range(2):
            (Fp8BlockwiseRecipe().grouped_mm_kn(x, w, sizes) * dout).sum().backward()
        after = weight_cache.stats()
    finally:
        weight_cache.enable(False)
    assert after["quantized"] - before["quantized"] == 1 and after["hits"] - before["hits"] == 1
    assert after["transposed"] == before["transposed"]  # both layouts came from the one quantization
    with pytest.raises(ValueError, match=r"must be \[E, K, N\]"):
        Fp8BlockwiseRecipe().grouped_mm_kn(x, w[0], sizes)


@pytest.mark.parametrize("fused", [True, False])
def test_moe_layer_with_the_recipe_under_cpu_autocast(fused):
    # On the CPU references under torch.autocast("cpu", bfloat16), as test_recipe_gpu's autocast test on the device
    # (autocast's stack promotion knew no float8: the weights' tiles were stacked inside it). Error model there: four
    # E4M3 operands, sqrt(4) x E4M3_REL_ERROR relative L2, 2x allowed, plus 4 bf16 roundings of the autocast.
    from moe_kernels.testing import E4M3_REL_ERROR, U_BF16, relative_l2_error

    torch.manual_seed(0)
    cfg = qwen3_30b_a3b(hidden_size=128, ffn_size=128, num_experts=4, k=2)
    layer = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe(fused_permute=fused, fused_swiglu=fused)))
    ref = MoELayer(cfg)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(32, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x)
        want, _ = ref(x)
    assert out.dtype == torch.bfloat16
    err = relative_l2_error(out.float(), want.float())
    assert err < 2 * 4**0.5 * E4M3_REL_ERROR + 4 * U_BF16, err
    out.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.experts.parameters())


def test_experts_tiles_on_meta_tensors():
    # The byte model runs the ops on meta tensors: the per-expert tiles (N not a multiple of 128) stack there too.
    q, s = quantize_fp8_experts(torch.empty(3, 200, 256, device="meta"))
    assert q.shape == (3, 200, 256) and s.shape == (3, 2, 2) and q.device.type == "meta"
