"""The FP8 blockwise recipe on the GPU: forward, FP8 dgrad (the CUTLASS kernel on transposed weight
tiles) and FP8 wgrad (the K-grouped kernel) against the same recipe on the CPU references, and an MoE layer under bf16 autocast."""

import contextlib

import pytest
import torch

from moe_kernels.nn import MoELayer
from moe_kernels.nn.moe import deepseek_v3
from moe_kernels.quant import Fp8BlockwiseRecipe
from moe_kernels.ops.grouped_mm import grouped_mm_reference, grouped_mm_wgrad_reference
from moe_kernels.ops.grouped_mm_nvfp4 import quantize_nvfp4_experts
from moe_kernels.ops.quant import dequantize_nvfp4, quantize_nvfp4
from moe_kernels.testing import (
    E4M3_REL_ERROR,
    assert_exact,
    U_BF16,
    assert_within_fp32_rounding,
    random_routing,
    relative_l2_error,
)
from moe_kernels._ext import reference_ops
from tests.emulation import skip_if_too_large
from tests.quant.test_nvfp4_recipe import nvfp4_wgrad_error_bound

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2.5e8  # GEMM FLOP per case (the portable kernel; no sm_90a under emulation)


# (200, 184, 200, 4): K and N end in partial blocks, the forward's and dgrad's contractions zero-padded to 256.
@pytest.mark.parametrize("M,N,K,E", [(200, 256, 256, 4), (2048, 1536, 1024, 16), (129, 128, 128, 1),
                                     (200, 184, 200, 4)])
def test_recipe_matches_the_cpu_references(cuda, M, N, K, E):
    g = torch.Generator().manual_seed(M + N)
    idx = random_routing(M, E, 1, kind="zipf", seed=M)
    # Each expert's rows padded to 128 (the FP8 wgrad's token blocks), plus 16 rows past the groups.
    gs = ((torch.bincount(idx.view(-1).long(), minlength=E) + 127) // 128 * 128).to(torch.int32)
    M = int(gs.sum()) + 16
    skip_if_too_large(3 * 2 * M * N * K, EMULATION_BUDGET, "GEMM FLOP")
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(E, N, K, generator=g) * 0.05).float()
    dout = torch.randn(M, N, generator=g).bfloat16()
    recipe = Fp8BlockwiseRecipe()
    grads = []
    for device in ("cpu", cuda):
        with reference_ops() if device == "cpu" else contextlib.nullcontext():
            xi, wi = x.to(device).requires_grad_(), w.to(device).requires_grad_()
            out = recipe.grouped_mm(xi, wi, gs.to(device))
            dx, dw = torch.autograd.grad(out, (xi, wi), dout.to(device))
        grads.append([t.float().cpu() for t in (out, dx, dw)])
    rows = int(gs.sum())
    for (name, got), want in zip(zip(("out", "dx", "dw"), grads[1]), grads[0]):
        if name != "dw":
            got, want = got[:rows], want[:rows]
        # The same FP8 operands; only the fp32 accumulation order and the final bf16 rounding differ.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)


def test_moe_layer_under_autocast(cuda):
    torch.manual_seed(0)
    cfg = deepseek_v3(hidden_size=256, ffn_size=128, shared_ffn_size=128, num_experts=16, k=4, num_groups=4,
                      group_topk=2, recipe=Fp8BlockwiseRecipe())
    layer = MoELayer(cfg).to(cuda)
    ref = MoELayer(cfg.replace(recipe=None)).to(cuda)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(4, 64, 256, device=cuda)
    with torch.autocast(cuda.type, dtype=torch.bfloat16):
        out, _ = layer(x)
        want, _ = ref(x)
    # Error model (moe_kernels.testing): the routed experts quantize four E4M3 operands (x and w13, the
    # activation and w2): sqrt(4) x 0.0265 relative L2 error, 2x that allowed (SwiGLU's gain on the gate's
    # error); both layers' bf16 autocast adds up to 4 bf16 roundings (2^-8 each) of its own.
    err = relative_l2_error(out.float(), want.float())
    assert err < 2 * 4**0.5 * E4M3_REL_ERROR + 4 * U_BF16, err
    out.float().square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_nvfp4_recipe_matches_the_cpu_references(cuda):
    from moe_kernels.quant import Nvfp4Recipe

    g = torch.Generator().manual_seed(7)
    N, K, E = 256, 192, 8
    gs = torch.bincount(random_routing(300, E, 1, kind="zipf", seed=3).view(-1).long(), minlength=E).to(torch.int32)
    gs = (gs + 15) // 16 * 16  # the recipe's NVFP4 wgrad needs groups padded to 16, as permute(align=16) gives
    M = int(gs.sum()) + 16  # and rows past the groups
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, N, K, generator=g) * 0.05
    dout = torch.randn(M, N, generator=g)
    rows = int(gs.sum())

    def grads(recipe, device):
        with reference_ops() if device == "cpu" else contextlib.nullcontext():
            xi, wi = x.to(device).requires_grad_(), w.to(device).requires_grad_()
            out = recipe.grouped_mm(xi, wi, gs.to(device))
            return [t.cpu() for t in (out, *torch.autograd.grad(out, (xi, wi), dout.to(device)))]

    # Round-to-nearest everywhere: the same quantized operands on both sides (bit-exact quantization);
    # only the fp32 accumulation order differs: within fp32 rounding of sum(|terms|) of the dequantized
    # operands (dw: the unquantized ones, its wgrad runs in the input precision).
    exact_recipe = Nvfp4Recipe(stochastic_dgrad=False, nvfp4_wgrad=False)
    in_groups = torch.arange(M)[:, None] < rows
    with reference_ops():
        x_deq = _nvfp4_rows(torch.where(in_groups, x, 0.0)).abs()
        d_deq = _nvfp4_rows(torch.where(in_groups, dout, 0.0)).abs()
        magnitude = {
            "out": grouped_mm_reference(x_deq, _nvfp4_experts(w).abs(), gs),
            "dx": grouped_mm_reference(d_deq, _nvfp4_experts(w.transpose(1, 2).contiguous()).abs(), gs),
            "dw": grouped_mm_wgrad_reference(dout.double().abs(), x.double().abs(), gs),
        }
    for name, got, want in zip(("out", "dx", "dw"), grads(exact_recipe, cuda), grads(exact_recipe, "cpu")):
        mag = magnitude[name]
        if name != "dw":
            got, want, mag = got[:rows], want[:rows], mag[:rows]
        assert_within_fp32_rounding(got, want, mag, f"NVFP4 round-to-nearest {name}")
    # The full recipe (stochastic dgrad, Hadamard NVFP4 wgrad; seeds from the CUDA generator): reproducible
    # under torch.manual_seed, and within NVFP4's precision of the exact gradients.
    torch.manual_seed(11)
    first = grads(Nvfp4Recipe(), cuda)
    torch.manual_seed(11)
    again = grads(Nvfp4Recipe(), cuda)
    for name, a, b in zip(("out", "dx", "dw"), first, again):  # rows past the groups are unspecified
        assert_exact(a if name == "dw" else a[:rows], b if name == "dw" else b[:rows], f"reproducible {name}")
    exact_dw = grouped_mm_wgrad_reference(dout.double(), x.double(), gs)
    assert relative_l2_error(first[2], exact_dw) < nvfp4_wgrad_error_bound(dout, x, gs)


def _nvfp4_rows(t):
    """Activations quantized as the recipe's forward and dgrad do (1D blocks of 16), dequantized, fp64."""
    return dequantize_nvfp4(*quantize_nvfp4(t), dtype=torch.float32).double()


def _nvfp4_experts(w):
    """Expert weights [E, N, K] quantized as the recipe does (16x16 tiles), dequantized, fp64."""
    q, s, g = quantize_nvfp4_experts(w)
    return dequantize_nvfp4(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1]), g,
                            dtype=torch.float32).view(w.shape).double()


@pytest.mark.parametrize("weights_in_activation", [False, True])
@pytest.mark.parametrize("hidden, ffn", [(256, 256), (144, 208)])
def test_fused_swiglu_is_the_unfused_recipe_on_the_kernels(cuda, weights_in_activation, hidden, ffn):
    # The SwiGLU kernel writing both E4M3 layouts (swiglu_quantize_fp8) against swiglu, quantize_fp8 and
    # quantize_fp8_tokens on the same device: the same codes, so the layer's output and every gradient agree
    # bit for bit (bf16 activations under autocast). H = 144, F = 208 (no multiples of 128, as GPT-OSS's 2880):
    # the producers' codes zero-padded, dh's blocks straddling d(gate) and d(up).
    from moe_kernels.nn.moe import qwen3_30b_a3b

    torch.manual_seed(2)
    cfg = qwen3_30b_a3b(hidden_size=hidden, ffn_size=ffn, num_experts=6, k=2,
                        weights_in_activation=weights_in_activation)
    _assert_fused_activation_is_unfused(cuda, cfg, "fused vs unfused SwiGLU quantization")


def _assert_fused_activation_is_unfused(cuda, cfg, what):
    """The layer on the recipe with the activation's FP8 producers and without (fused_swiglu=False), same weights and
    input, bf16 under autocast: output and every gradient bit for bit."""
    fused = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe())).to(cuda)
    plain = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe(fused_swiglu=False))).to(cuda)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 41, cfg.hidden_size, device=cuda)
    grads = []
    for layer in (fused, plain):
        xi = x.clone().requires_grad_()
        with torch.autocast(cuda.type, dtype=torch.bfloat16):
            out, aux = layer(xi)
        (out.float().square().sum() + aux).backward()
        grads.append((out, xi.grad, *(p.grad for p in layer.parameters())))
    for a, b in zip(*grads):
        assert_exact(a, b, what)


@pytest.mark.parametrize("ffn_size", [256, 208])
def test_fused_squared_relu_is_the_unfused_recipe_on_the_kernels(cuda, ffn_size):
    # Experts without a gate: the squared ReLU's kernels writing both E4M3 layouts, forward and backward
    # (squared_relu_quantize_fp8, squared_relu_bwd_quantize_fp8; F = 208 zero-padded to 256 in the same pass)
    # against squared_relu (or its backward), quantize_fp8 and quantize_fp8_tokens on the same device: the same
    # codes, so the layer's output and every gradient agree bit for bit (bf16 activations under autocast).
    from moe_kernels.nn.moe import qwen3_30b_a3b

    torch.manual_seed(6)
    cfg = qwen3_30b_a3b(hidden_size=256, ffn_size=ffn_size, num_experts=6, k=2, activation="squared_relu")
    _assert_fused_activation_is_unfused(cuda, cfg, "fused vs unfused squared-ReLU quantization")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [256, 144])
def test_fused_permute_is_the_unfused_recipe_on_the_kernels(cuda, dtype, hidden):
    # The first GEMM's input written in both E4M3 layouts by the gather of the permuted rows (routing-only
    # permute, then unpermute_bwd_quantize_fp8 with no weights; fp32 rows: permute_quantize_fp8) against
    # permute, quantize_fp8 and quantize_fp8_tokens on the same device: the same codes, so the layer's output
    # and every gradient agree bit for bit (empty experts and a token count off the 128-row blocks included; H =
    # 144: the gathered codes zero-padded to 256; fp32 rows there take the composition).
    from moe_kernels.nn.moe import qwen3_30b_a3b

    torch.manual_seed(5)
    cfg = qwen3_30b_a3b(hidden_size=hidden, ffn_size=128, num_experts=8, k=2)
    fused = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe())).to(cuda, dtype)
    plain = MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe(fused_permute=False))).to(cuda, dtype)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(2, 45, hidden, device=cuda, dtype=dtype)
    grads = []
    for layer in (fused, plain):
        xi = x.clone().requires_grad_()
        out, aux = layer(xi)
        (out.float().square().sum() + aux).backward()
        grads.append((out, xi.grad, *(p.grad for p in layer.parameters())))
    for a, b in zip(*grads):
        assert_exact(a, b, f"gathered vs unfused permute quantization ({dtype})")


def test_kn_weights_are_the_transposed_weights(cuda):
    # Experts stored [E, K, N] (Fp8BlockwiseRecipe.grouped_mm_kn) against grouped_mm on the transposed copy, on the
    # device: the same codes and the same kernels for the forward and dgrad, so out and dx bit for bit. wgrad takes
    # its operands the other way round (x^T dout): each is within Hopper's FP8 accumulation of the exact sum
    # (moe_kernels.testing.FP8_MMA_MAGNITUDE per unit of the terms' magnitude), so they differ by at most twice it.
    from moe_kernels.ops.grouped_mm import grouped_mm_wgrad_reference
    from moe_kernels.testing import FP8_MMA_MAGNITUDE, assert_within_fp32_rounding
    from tests.quant.test_recipe import _kn_problem, _kn_runs

    x, w_kn, sizes, dout = _kn_problem(cuda)
    (out, dx, dw), (ref_out, ref_dx, ref_dw) = _kn_runs(Fp8BlockwiseRecipe(), x, w_kn, sizes, dout)
    assert_exact(out, ref_out, "out")
    assert_exact(dx, ref_dx, "dx")
    rows = int(sizes.sum())
    # The terms' magnitude: |x|^T |dout| per group, 1.1x for the E4M3 rounding of both operands (at most 2^-4 each).
    magnitude = 1.1 * grouped_mm_wgrad_reference(x[:rows].abs().double().cpu(), dout[:rows].abs().double().cpu(),
                                                 sizes.cpu())
    assert_within_fp32_rounding(dw, ref_dw, 2 * FP8_MMA_MAGNITUDE * magnitude, "dw")
