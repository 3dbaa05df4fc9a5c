"""FP8 blockwise grouped GEMM: CPU tier (the reference against an independent formulation)."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.grouped_mm import grouped_mm_reference, grouped_mm_wgrad_reference
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8_reference
from moe_kernels.ops.permute import unpermute_bwd_reference, unpermute_reference
from moe_kernels.testing import FP32_EPS, assert_exact, assert_within_fp32_rounding, assert_within_rounding_to

E4M3 = torch.float8_e4m3fn


def _operands(M, N, K, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, K)
    w = torch.randn(len(sizes), N, K, generator=g) * 0.05
    xq, xs = mk.quantize_fp8(x, "block")
    wq, ws = mk.quantize_fp8_experts(w)
    return xq, xs, wq, ws, torch.tensor(sizes, dtype=torch.int32)


def test_reference_matches_blockwise_sum_in_fp64():
    # Independent: sum over 128-wide K blocks of (integer-valued fp8 products) times both block scales.
    xq, xs, wq, ws, gs = _operands(40, 256, 384, [10, 0, 25, 5])
    out = grouped_mm_fp8_reference(xq, xs, wq, ws, gs).to(torch.bfloat16)
    expected = torch.zeros(40, 256, dtype=torch.float64)
    magnitude = torch.zeros(40, 256, dtype=torch.float64)  # sum of |terms|
    start = 0
    for e, n in enumerate(gs.tolist()):
        for kb in range(3):
            a = xq[start : start + n, 128 * kb : 128 * (kb + 1)].double()
            b = wq[e, :, 128 * kb : 128 * (kb + 1)].double()
            sa = 1.0 / xs[start : start + n, kb].double()[:, None]
            sb = 1.0 / ws[e, :, kb].double().repeat_interleave(128)[None, :]
            expected[start : start + n] += (a @ b.t()) * sa * sb
            magnitude[start : start + n] += (a.abs() @ b.abs().t()) * sa.abs() * sb.abs()
        start += n
    # The reference accumulates in fp32, then rounds to bf16: one bf16 ulp + fp32 rounding from the exact sum.
    assert_within_rounding_to(out, expected.to(torch.bfloat16), magnitude, torch.bfloat16, "fp8 reference")


def test_quantize_fp8_experts_tiles_stay_inside_experts():
    w = torch.randn(3, 200, 256)  # N not a multiple of 128: a per-expert loop
    wq, ws = mk.quantize_fp8_experts(w)
    assert wq.shape == (3, 200, 256) and ws.shape == (3, 2, 2)
    for e in range(3):
        q, s = mk.quantize_fp8(w[e], "tile")
        assert_exact(wq[e].view(torch.uint8), q.view(torch.uint8), f"expert {e} codes")
        assert_exact(ws[e], s, f"expert {e} scales")
    for shape in ((0, 256, 128), (2, 0, 128)):  # empty experts or rows
        wq, ws = mk.quantize_fp8_experts(torch.empty(shape))
        assert wq.shape == shape and ws.shape == (shape[0], -(-shape[1] // 128), 1)
    w = torch.randn(2, 256, 128)
    wq, ws = mk.quantize_fp8_experts(w)  # fast path: one call over [E * N, K]
    assert_exact(ws[1], mk.quantize_fp8(w[1], "tile")[1], "fast path scales")


def test_close_to_the_bf16_product():
    xq, xs, wq, ws, gs = _operands(64, 128, 256, [32, 32], seed=1)
    x = mk.dequantize_fp8(xq, xs, "block", dtype=torch.float32)
    w = torch.stack([mk.dequantize_fp8(wq[e], ws[e], "tile", dtype=torch.float32) for e in range(2)])
    torch.testing.assert_close(mk.grouped_mm_fp8(xq, xs, wq, ws, gs).float(), mk.grouped_mm(x, w, gs),
                               rtol=2**-7, atol=1e-5)


def test_bad_input():
    xq, xs, wq, ws, gs = _operands(8, 128, 256, [4, 4])
    with pytest.raises(TypeError, match="x_q"):
        mk.grouped_mm_fp8(xq.float(), xs, wq, ws, gs)
    with pytest.raises(ValueError, match="multiple of 128"):
        mk.grouped_mm_fp8(xq[:, :200].contiguous(), xs[:, :2].contiguous(), wq[:, :, :200].contiguous(), ws, gs)
    with pytest.raises(ValueError, match="x_scale"):
        mk.grouped_mm_fp8(xq, xs[:, :1].contiguous(), wq, ws, gs)
    with pytest.raises(ValueError, match="w_scale"):
        mk.grouped_mm_fp8(xq, xs, wq, ws[:, :, :1].contiguous(), gs)
    with pytest.raises(ValueError, match="group_sizes"):
        mk.grouped_mm_fp8(xq, xs, wq, ws, gs[:1].contiguous())
    with pytest.raises(ValueError, match="sums to"):
        mk.grouped_mm_fp8(xq, xs, wq, ws, torch.tensor([8, 8], dtype=torch.int32))


def test_opcheck():
    xq, xs, wq, ws, gs = _operands(16, 128, 128, [6, 10])
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.moe_kernels.grouped_mm_fp8, (xq, xs, wq, ws, gs), test_utils=utils)


def permuted_fp8_pipeline(x, idx, weights, w1q, w1s, w2, align, device="cpu"):
    """quantize -> permute codes and scales -> grouped_mm_fp8 -> grouped_mm -> unpermute, backward of a
    sum of squares: (h, row_map, sizes, out, dw2). Padding rows get codes 0 and scale 0 from permute."""
    E = w1q.shape[0]
    xq, xs = mk.quantize_fp8(x.to(device), "block")
    idx = idx.to(device)
    q, row_map, sizes = mk.permute(xq, idx, E, align=align)
    s, _, _ = mk.permute(xs, idx, E, align=align)
    h = mk.grouped_mm_fp8(q, s, w1q.to(device), w1s.to(device), sizes).float()
    w = w2.to(device, copy=True).requires_grad_()
    out = mk.unpermute(mk.grouped_mm(h, w, sizes), row_map, weights.to(device))
    out.square().sum().backward()
    return h, row_map, sizes, out.detach(), w.grad


def permuted_fp8_operands(T=40, E=4, K=256, N=128, H=64, k=2, seed=5):
    from moe_kernels.testing import random_routing

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) * 2
    w1q, w1s = mk.quantize_fp8_experts(torch.randn(E, N, K, generator=g) * 0.05)
    w2 = torch.randn(E, H, N, generator=g) * 0.05
    return x, random_routing(T, E, k, kind="zipf", seed=seed), torch.rand(T, k, generator=g), w1q, w1s, w2


def padding_rows(row_map, sizes):
    """[sum(sizes)] bool: rows inside the groups that no (token, slot) maps to."""
    pad = torch.ones(int(sizes.sum()), dtype=torch.bool, device=row_map.device)
    pad[row_map[row_map >= 0].long()] = False
    return pad


def test_permuted_padding_rows_give_zeros_and_finite_gradients():
    # A zero scale is a block of zeros: the padding rows' products are 0, not 0 * inf = NaN, so the next
    # GEMM's wgrad, which sums over every row of its groups, stays finite. Without padding (align=1) the
    # same rows give the same output and gradient.
    x, idx, weights, w1q, w1s, w2 = permuted_fp8_operands()
    h, row_map, sizes, out, dw = permuted_fp8_pipeline(x, idx, weights, w1q, w1s, w2, align=128)
    pad = padding_rows(row_map, sizes)
    rows = int(sizes.sum())
    assert bool(pad.any()), "the case must hold padding rows"
    assert bool(torch.isfinite(h).all()) and bool((h[:rows][pad] == 0).all()), "padding rows are zeros"
    assert bool(torch.isfinite(dw).all()), "wgrad over the padding rows"
    h1, row_map1, _, out1, dw1 = permuted_fp8_pipeline(x, idx, weights, w1q, w1s, w2, align=1)
    valid = row_map >= 0
    assert_exact(h[row_map[valid].long()], h1[row_map1[valid].long()], "rows of the tokens")
    # The same rows in groups of other sizes: only the fp32 summation order differs. out: fp32 rounding of
    # its terms |h| |w2| (through unpermute's weights); dw2 = dy^T h with dy = 2 out w per slot: its own
    # terms, plus out's rounding carried through dy.
    mag_out = unpermute_reference(grouped_mm_reference(h.abs(), w2.abs(), sizes), row_map, weights)
    assert_within_fp32_rounding(out, out1, mag_out, "out, align 128 vs 1")
    dy_mag = unpermute_bwd_reference(2 * (out.abs() + 64 * FP32_EPS * mag_out), row_map, weights, None, h.shape[0])[0]
    assert_within_fp32_rounding(dw, dw1, grouped_mm_wgrad_reference(dy_mag, h.abs(), sizes), "dw2, align 128 vs 1")
    # The reference takes the same rule (q / 0 is a zero block there too).
    s = torch.zeros(3, 2)
    q = torch.full((3, 256), 0.5).to(E4M3)
    assert bool((grouped_mm_fp8_reference(q, s, w1q[:1], w1s[:1], torch.tensor([3], dtype=torch.int32)) == 0).all())
