"""NVFP4 grouped GEMM and the NVFP4 recipe for the expert GEMMs (specs/lowprec.md)."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.models import PRESETS
from moe_kernels.nn.moe import qwen3_30b_a3b
from moe_kernels.ops.grouped_mm_nvfp4 import grouped_mm_nvfp4, grouped_mm_nvfp4_reference, quantize_nvfp4_experts
from moe_kernels.ops.quant import dequantize_nvfp4, quantize_nvfp4
from moe_kernels.quant import RECIPES, Nvfp4Recipe
from moe_kernels.quant.recipe import _fresh_rng, _nvfp4_along_tokens, random_hadamard_tokens
from moe_kernels.testing import (
    NVFP4_EPS_CAP,
    QUANT_SLACK,
    assert_tracks_loss_curve,
    quantized_product_error,
    relative_l2_error,
)
from tests.quant.test_recipe import _train, fp32_curves


def _problem(M=70, N=48, K=96, sizes=(30, 0, 25, 15), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).requires_grad_()
    w = (torch.randn(len(sizes), N, K, generator=gen) * 0.1).requires_grad_()
    return x, w, torch.tensor(sizes, dtype=torch.int32), torch.randn(M, N, generator=gen)


def test_grouped_mm_matches_dequantized_product_to_fp32_rounding():
    x, w, gs, _ = _problem()
    xq = quantize_nvfp4(x.detach())
    wq = quantize_nvfp4_experts(w.detach())
    out = grouped_mm_nvfp4(*xq, *wq, gs, out_dtype=torch.float32)
    ref = grouped_mm_nvfp4_reference(*xq, *wq, gs)
    rows = int(gs.sum())
    torch.testing.assert_close(out[:rows].double(), ref[:rows], rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    assert out.dtype == torch.float32 and grouped_mm_nvfp4(*xq, *wq, gs).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="`w_q` has K"):
        grouped_mm_nvfp4(*xq, wq[0][..., :8].contiguous(), wq[1], wq[2], gs)
    with pytest.raises(ValueError, match="`x_global` must be one fp32 value"):
        grouped_mm_nvfp4(xq[0], xq[1], xq[2].reshape(1).repeat(2), *wq, gs)
    with pytest.raises(TypeError, match="grouped_mm_nvfp4: `group_sizes` must have dtype"):
        grouped_mm_nvfp4(*xq, *wq, gs.long())  # checked before any kernel reads it
    with pytest.raises(ValueError, match="grouped_mm_nvfp4: `group_sizes`"):
        grouped_mm_nvfp4(*xq, *wq, gs[:-1])


def test_expert_tiles_quantize_the_transpose_to_the_same_values():
    _, w, _, _ = _problem()
    w = w.detach()
    E, N, K = w.shape

    def deq(q, s, g):
        return dequantize_nvfp4(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1]), g, dtype=torch.float32)

    a = deq(*quantize_nvfp4_experts(w)).view(E, N, K)
    b = deq(*quantize_nvfp4_experts(w.transpose(1, 2).contiguous())).view(E, K, N)
    assert torch.equal(a, b.transpose(1, 2))
    with pytest.raises(ValueError, match="N % 16"):
        quantize_nvfp4_experts(w[:, :40].contiguous())


def test_recipe_follows_its_definition():
    x, w, gs, dout = _problem()
    rows = int(gs.sum())
    out = Nvfp4Recipe(stochastic_dgrad=False, nvfp4_wgrad=False).grouped_mm(x, w, gs)
    dx, dw = torch.autograd.grad(out, (x, w), dout)
    want = grouped_mm_nvfp4(*quantize_nvfp4(x.detach()), *quantize_nvfp4_experts(w.detach()), gs, out_dtype=torch.float32)
    torch.testing.assert_close(out[:rows], want[:rows], rtol=0, atol=0)
    wt = quantize_nvfp4_experts(w.detach().transpose(1, 2).contiguous())
    want_dx = grouped_mm_nvfp4(*quantize_nvfp4(dout), *wt, gs, out_dtype=torch.float32)
    torch.testing.assert_close(dx[:rows], want_dx[:rows], rtol=0, atol=0)
    torch.testing.assert_close(dw, torch.ops.moe_kernels.grouped_mm_wgrad(dout, x.detach(), gs), rtol=0, atol=0)


def test_stochastic_dgrad_is_reproducible_and_unbiased():
    x, w, gs, dout = _problem(M=16, sizes=(16, 0, 0, 0))
    rows = 16

    def dx_once(recipe):
        out = recipe.grouped_mm(x, w, gs)
        return torch.autograd.grad(out, (x,), dout)[0][:rows]

    torch.manual_seed(1)
    a = dx_once(Nvfp4Recipe())
    torch.manual_seed(1)
    assert torch.equal(a, dx_once(Nvfp4Recipe()))  # the seed comes from torch's generator
    assert not torch.equal(a, dx_once(Nvfp4Recipe()))  # and changes call to call
    # The mean of many stochastic draws approaches dout @ dequant(w) better than round-to-nearest does.
    wt = quantize_nvfp4_experts(w.detach().transpose(1, 2).contiguous())
    w_deq = dequantize_nvfp4(wt[0].reshape(-1, wt[0].shape[-1]), wt[1].reshape(-1, wt[1].shape[-1]), wt[2],
                             dtype=torch.float32).view(4, 96, 48)
    exact = dout[:rows].double() @ w_deq[0].double().T
    mean = torch.stack([dx_once(Nvfp4Recipe()) for _ in range(64)]).double().mean(0)
    nearest = dx_once(Nvfp4Recipe(stochastic_dgrad=False)).double()
    assert (mean - exact).norm() < 0.5 * (nearest - exact).norm()


def test_config_and_presets():
    assert RECIPES["nvfp4"] == Nvfp4Recipe()
    with pytest.raises(ValueError, match="multiples of 16"):
        qwen3_30b_a3b(hidden_size=40, ffn_size=32, num_experts=4, k=2, recipe=Nvfp4Recipe())
    PRESETS["tiny-qwen3-moe"](recipe=Nvfp4Recipe())  # the tiny models fit the recipe (64 and 32)


def test_training_tracks_the_high_precision_loss_curve():
    # Error model (moe_kernels.testing): NVFP4 moves the loss curve less than a new initialisation does.
    ref, seeds = fp32_curves()
    fp4 = _train(Nvfp4Recipe())
    assert fp4[-5:].mean() < 0.8 * fp4[:5].mean()  # it trains
    assert_tracks_loss_curve(fp4, ref, seeds, "NVFP4 recipe")


def test_rows_past_the_groups_do_not_reach_the_global_scale():
    # permute and grouped_mm leave rows past the groups unspecified (inf or NaN on a GPU): the per-tensor
    # amax must not see them.
    x, w, gs, dout = _problem(M=86)  # 70 rows in the groups, 16 past them
    rows = int(gs.sum())
    assert rows < x.shape[0]
    dirty_x, dirty_dout = x.detach().clone(), dout.clone()
    dirty_x[rows:], dirty_dout[rows:] = float("nan"), float("inf")
    results = []
    for xi, di in ((x.detach().clone(), dout), (dirty_x, dirty_dout)):
        xi.requires_grad_()
        out = Nvfp4Recipe(stochastic_dgrad=False, nvfp4_wgrad=False).grouped_mm(xi, w, gs)
        dx, dw = torch.autograd.grad(out, (xi, w), di)
        results.append((out[:rows], dx[:rows], dw))
    for clean, dirty in zip(*results):
        assert torch.equal(clean, dirty)


def test_random_hadamard_is_orthogonal_along_the_tokens():
    gen = torch.Generator().manual_seed(5)
    d, x = torch.randn(64, 24, generator=gen, dtype=torch.float64), torch.randn(64, 40, generator=gen, dtype=torch.float64)
    rd, rx = random_hadamard_tokens(d), random_hadamard_tokens(x)
    torch.testing.assert_close(rd.T @ rx, d.T @ x, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(rd, d)
    # Blocks of 16 rows are independent: a change in one block leaves the others alone.
    x2 = x.clone()
    x2[:16] += 1
    assert torch.equal(random_hadamard_tokens(x2)[16:], rx[16:])


def nvfp4_wgrad_error_bound(dout: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> float:
    """The NVFP4 wgrad's relative L2 error bound (moe_kernels.testing's quantization error model): QUANT_SLACK x
    sqrt(eps_d^2 + eps_x^2), eps the relative L2 errors of quantizing these very operands as the recipe does
    (the Hadamard-transformed dout stochastically, here another draw, on the CPU: stochastic rounding's eps over
    >= 1e3 elements is the same for every draw to ~1%; the transformed x to nearest). dout and x independent,
    the errors of one are uncorrelated with the other operand: they add in RMS."""
    dout, x, group_sizes = dout.detach().cpu(), x.detach().cpu(), group_sizes.cpu()
    M = x.shape[0]

    def transformed(t):  # as the recipe's wgrad prepares it: rows past the groups zeroed, padded to 16
        t = torch.where(torch.arange(M)[:, None] < int(group_sizes.sum()), t.float(), 0.0)
        return random_hadamard_tokens(torch.nn.functional.pad(t, (0, 0, 0, -M % 16)))

    d, xh = transformed(dout), transformed(x)
    draw = torch.tensor([0x5EED, 0], dtype=torch.int64)  # [seed, offset]; torch's generator left alone
    eps_d = relative_l2_error(_nvfp4_along_tokens(d, draw), d)
    eps_x = relative_l2_error(_nvfp4_along_tokens(xh, None), xh)
    assert eps_d < NVFP4_EPS_CAP and eps_x < NVFP4_EPS_CAP, (eps_d, eps_x)  # the quantizer itself is sound
    return QUANT_SLACK * quantized_product_error(eps_d, eps_x)


def _wgrad_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([32, 0, 16, 48], dtype=torch.int32)  # 96 rows in groups, 16 past them
    M, N, K = 112, 48, 64
    x = torch.randn(M, K, generator=gen)
    dout = torch.randn(M, N, generator=gen)
    w = torch.randn(4, N, K, generator=gen) * 0.1
    return x, w, sizes, dout


def test_nvfp4_wgrad_follows_the_recipe():
    x, w, gs, dout = _wgrad_problem()
    w.requires_grad_()  # x does not: no dgrad, so wgrad's stochastic rounding draws the first seed
    dirty = x.detach().clone()
    torch.manual_seed(3)
    out = Nvfp4Recipe().grouped_mm(x, w, gs)
    (dw,) = torch.autograd.grad(out, (w,), dout)
    torch.manual_seed(3)
    rng = _fresh_rng(dout.device)
    dout = torch.where(torch.arange(dout.shape[0])[:, None] < int(gs.sum()), dout, 0.0)  # rows past the groups
    d = _nvfp4_along_tokens(random_hadamard_tokens(dout), rng)
    x_in = torch.where(torch.arange(x.shape[0])[:, None] < int(gs.sum()), x.detach(), 0.0)
    xh = _nvfp4_along_tokens(random_hadamard_tokens(x_in), None)
    want = torch.ops.moe_kernels.grouped_mm_wgrad(d.contiguous(), xh.contiguous(), gs)
    torch.testing.assert_close(dw, want, rtol=0, atol=0)
    assert torch.all(dw[1] == 0)
    exact = torch.ops.moe_kernels.grouped_mm_wgrad(dout.double(), x.detach().double(), gs)
    assert relative_l2_error(dw, exact) < nvfp4_wgrad_error_bound(dout, x, gs)
    with pytest.raises(ValueError, match="padded to 16"):
        out = Nvfp4Recipe().grouped_mm(dirty.requires_grad_(), w, torch.tensor([30, 2, 16, 48], dtype=torch.int32))
        torch.autograd.grad(out, (w,), dout)



def test_hadamard_matrix_and_token_blocks_are_the_recipe_s():
    # An independent statement of both: R[i, j] = (-1)^popcount(i & j) * s[j] / 4 with some s[j] = -1, and
    # NVFP4 blocks running along the tokens (one large token coarsens its 15 block neighbours, no others).
    from moe_kernels.quant.recipe import _hadamard_16

    R = _hadamard_16(torch.device("cpu"), torch.float64)
    i = torch.arange(16)
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(16)] for a in range(16)], dtype=torch.float64)
    signs = (R[0] * 4).round()
    assert torch.equal(R, (1 - 2 * parity) * signs / 4) and bool((signs == -1).any()) and bool((signs == 1).any())
    assert torch.equal(signs.abs(), torch.ones(16, dtype=torch.float64)) and i.numel() == 16
    t = torch.ones(32, 16)
    t[0] = 1000.0
    deq = _nvfp4_along_tokens(t, None)
    assert torch.all(deq[1:16] == 0) and torch.all(deq[16:] > 0.9)  # along channels rows 1-31 would match


def test_grouped_mm_is_fp32_under_autocast():
    x, w, gs, _ = _problem()
    xq = quantize_nvfp4(x.detach())
    wq = quantize_nvfp4_experts(w.detach())
    want = grouped_mm_nvfp4(*xq, *wq, gs, out_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_mm_nvfp4(*xq, *wq, gs, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Tiny amaxes: the two global scales' product overflows fp32, the result must not.
    tiny = grouped_mm_nvfp4(*quantize_nvfp4(x.detach() * 1e-18), *quantize_nvfp4_experts(w.detach() * 1e-18), gs,
                            out_dtype=torch.float64)
    rows = int(gs.sum())
    torch.testing.assert_close(tiny[:rows] * 1e36, want[:rows].double(), rtol=1e-5, atol=1e-5)
