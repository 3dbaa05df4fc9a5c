"""NVFP4 quantization: CPU tier (the reference against hand-worked values, an independent loop and the
statistics of stochastic rounding)."""

import math

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.quant import philox4x32, quantize_nvfp4_reference
from moe_kernels.testing import assert_exact

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _codes(packed):
    p = packed.long()
    return torch.stack([p & 0xF, p >> 4], -1).view(packed.shape[0], -1)


def _value(code):
    return -GRID[code & 7] if code & 8 else GRID[code & 7]


def test_philox_known_answers():
    # Random123's philox4x32_10 test vectors.
    def run(c, k):
        return philox4x32(torch.tensor([c[0]]), c[1], c[2] | (c[3] << 32), k[0] | (k[1] << 32))[0].tolist()

    assert run([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    assert run([m, m, m, m], [m, m]) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_e2m1_round_to_nearest_even():
    # global amax 2688 -> s_global 1; block amax 6 -> s_block 1 -> r 1: the codes are e2m1(x) itself.
    vals = [6.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.25, -5.5, 4.9, 1.3, 2.6, -0.0]
    want = [6.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -0.0, -6.0, 4.0, 1.5, 3.0, -0.0]
    x = torch.tensor([vals])
    packed, sb, sg = mk.quantize_nvfp4(x, global_amax=torch.tensor(2688.0))
    assert sg.item() == 1.0 and sb.float().tolist() == [[1.0]]
    codes = _codes(packed)[0].tolist()
    got = [_value(c) for c in codes]
    assert got == want
    assert [math.copysign(1, g) for g in got] == [math.copysign(1, w) for w in want]  # -0.25 -> -0 (code 8)
    assert codes[0] == 7 and packed[0, 0].item() == codes[0] | (codes[1] << 4)  # first element in the low nibble
    assert mk.dequantize_nvfp4(packed, sb, sg, dtype=torch.float32)[0].tolist() == want


def test_scales_zero_block_and_saturation():
    x = torch.zeros(2, 32)
    x[0, 16:] = torch.linspace(-3, 3, 16)
    packed, sb, sg = mk.quantize_nvfp4(x)
    assert sg.item() == pytest.approx(2688 / 3)
    assert sb[0, 0].float().item() == 0.0 and bool((_codes(packed)[0, :16] == 0).all())  # all-zero block
    assert sb[0, 1].float().item() == 448.0  # 3 / 6 * 896 = 448
    assert bool((packed[1] == 0).all()) and bool((sb[1].float() == 0).all())
    # A global amax below the data's saturates the block scale at 448 (and the codes at 6).
    packed, sb, sg = mk.quantize_nvfp4(x, global_amax=torch.tensor(0.5))
    assert sb[0, 1].float().item() == 448.0 and _codes(packed)[0, 16].item() == 15  # -3 -> -6
    packed, sb, sg = mk.quantize_nvfp4(torch.zeros(1, 16))
    assert sg.item() == 1.0


def _loop_reference(x, amax=None):
    """Independent: one block at a time, Python floats for the grid search (nearest, ties to even code)."""
    M, K = x.shape
    xf = x.float()
    a = float(xf.abs().max()) if amax is None else amax
    sg = torch.tensor(2688.0).div(torch.tensor(a)).item() if a > 0 and math.isfinite(a) else 1.0
    codes = torch.zeros(M, K, dtype=torch.long)
    scales = torch.zeros(M, K // 16)
    for r in range(M):
        for b in range(K // 16):
            blk = xf[r, 16 * b : 16 * b + 16]
            t = (torch.tensor(float(blk.abs().max())) / torch.tensor(6.0)) * torch.tensor(sg)
            sbf = t.clamp(max=448).to(torch.float8_e4m3fn).float()
            scales[r, b] = sbf
            if sbf.item() == 0:
                continue
            rs = torch.tensor(sg) / sbf
            for j in range(16):
                v = (blk[j] * rs).item()
                mag = abs(v)
                best = min(range(8), key=lambda c: (abs(GRID[c] - mag), c % 2))  # nearest; tie -> even code
                codes[r, 16 * b + j] = best | (8 if math.copysign(1, v) < 0 else 0)
    return codes, scales


@pytest.mark.parametrize("M,K", [(1, 16), (3, 48), (17, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_independent_loop(M, K, dtype):
    g = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)).to(dtype)
    packed, sb, _ = quantize_nvfp4_reference(x)
    codes, scales = _loop_reference(x)
    assert_exact(_codes(packed), codes, "codes")
    assert_exact(sb.float(), scales, "block scales")


def test_stochastic_rounding_statistics():
    x = torch.full((64, 1024), 1.2)  # between grid points 1 and 1.5 after scaling with r = 1
    x[:, ::16] = 6.0  # every block's amax: s_block = 1
    amax = torch.tensor(2688.0)
    draws = []
    for offset in range(8):
        packed, sb, sg = mk.quantize_nvfp4(x, global_amax=amax, rng=torch.tensor([1234, offset * x.numel()]))
        assert sb.float().unique().tolist() == [1.0]
        draws.append(mk.dequantize_nvfp4(packed, sb, sg, dtype=torch.float32).view(64, 64, 16)[:, :, 1:])
    vals = torch.stack(draws)
    assert set(vals.unique().tolist()) == {1.0, 1.5}  # only the two neighbours
    assert abs(vals.mean().item() - 1.2) < 0.01  # unbiased: P(up) = 0.4
    assert abs(vals.mean().item() - 1.2) < abs(1.0 - 1.2)  # closer than round-to-nearest (1.0)
    assert not torch.equal(draws[0], draws[1])  # two draws differ
    again = mk.quantize_nvfp4(x, global_amax=amax, rng=torch.tensor([1234, 0]))
    first = mk.quantize_nvfp4(x, global_amax=amax, rng=torch.tensor([1234, 0]))
    assert_exact(again[0], first[0], "same seed and offset")
    exact = torch.tensor([[6.0, 4.0, 3.0, 0.5] * 4])  # grid points never move
    assert_exact(mk.quantize_nvfp4(exact, global_amax=amax, rng=torch.tensor([7, 0]))[0],
                 mk.quantize_nvfp4(exact, global_amax=amax)[0], "grid points")


def test_tile_2d_row_and_column_quantization_agree():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-1, 1, 64)
    p, sb, sg = mk.quantize_nvfp4(w, tile_2d=True)
    pt, sbt, sgt = mk.quantize_nvfp4(w.t().contiguous(), tile_2d=True)
    assert sg.item() == sgt.item()
    a = mk.dequantize_nvfp4(p, sb, sg, dtype=torch.float32)
    b = mk.dequantize_nvfp4(pt, sbt, sgt, dtype=torch.float32)
    assert_exact(a, b.t().contiguous(), "row- and column-wise values")
    assert bool((sb.float().view(3, 16, 4)[:, :1] == sb.float().view(3, 16, 4)).all())  # one scale per tile


def test_round_trip_error_bound():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 256, generator=g)
    p, sb, sg = mk.quantize_nvfp4(x)
    back = mk.dequantize_nvfp4(p, sb, sg, dtype=torch.float32)
    step = (sb.float() / sg).repeat_interleave(16, 1)  # one unit of the grid in x's units
    # e2m1 spacing is at most 2 units (between 4 and 6); nearest rounding is off by at most half of it,
    # and the block scale's own e4m3 rounding costs up to 1/16 relative at the block maximum.
    assert bool(((back - x).abs() <= step + x.abs() / 16).all())


def test_bad_input():
    with pytest.raises(ValueError, match="multiple of 16"):
        mk.quantize_nvfp4(torch.randn(2, 24))
    with pytest.raises(ValueError, match="global_amax"):
        mk.quantize_nvfp4(torch.randn(2, 16), global_amax=torch.ones(2))
    with pytest.raises(TypeError, match="rng"):
        mk.quantize_nvfp4(torch.randn(2, 16), rng=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="rng"):
        mk.quantize_nvfp4(torch.randn(2, 16), rng=torch.tensor([1, 2, 3]))
    p, sb, sg = mk.quantize_nvfp4(torch.randn(2, 32))
    with pytest.raises(ValueError, match="block_scale"):
        mk.dequantize_nvfp4(p, sb[:, :1], sg)


def test_opcheck():
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    x = torch.randn(5, 64)
    for args in ((x, None, False, None), (x, torch.tensor(3.0), True, torch.tensor([1, 2]))):
        torch.library.opcheck(torch.ops.moe_kernels.quantize_nvfp4, args, test_utils=utils)
    p, sb, sg = mk.quantize_nvfp4(x)
    torch.library.opcheck(torch.ops.moe_kernels.dequantize_nvfp4, (p, sb, sg, torch.bfloat16), test_utils=utils)


def test_empty_inputs():
    for shape in ((0, 16), (5, 0)):
        for tile_2d in (False, True):
            p, sb, sg = mk.quantize_nvfp4(torch.empty(shape), tile_2d=tile_2d)
            assert p.shape == (shape[0], shape[1] // 2) and sb.shape == (shape[0], shape[1] // 16)
            assert sg.item() == 1.0
            assert mk.dequantize_nvfp4(p, sb, sg).shape == shape


def test_permuted_padding_rows_dequantize_to_zeros():
    # permute zero-fills padding rows of codes and block scales; the block scale multiplies, so they
    # dequantize (and enter grouped_mm_nvfp4) as zeros with no special rule, unlike FP8's divided scale.
    from moe_kernels.testing import random_routing

    p, sb, sg = mk.quantize_nvfp4(torch.randn(30, 64))
    idx = random_routing(30, 4, 2, kind="zipf", seed=3)
    p_perm, row_map, sizes = mk.permute(p, idx, 4, align=16)
    sb_perm, _, _ = mk.permute(sb.view(torch.uint8), idx, 4, align=16)
    out = mk.dequantize_nvfp4(p_perm, sb_perm.view(torch.float8_e4m3fn), sg, dtype=torch.float32)
    pad = torch.ones(out.shape[0], dtype=torch.bool)
    pad[row_map[row_map >= 0].long()] = False
    assert bool(pad[: int(sizes.sum())].any()) and bool((out[pad] == 0).all())
    from moe_kernels.ops.grouped_mm_nvfp4 import grouped_mm_nvfp4, quantize_nvfp4_experts

    w_q, w_s, w_g = quantize_nvfp4_experts(torch.randn(4, 32, 64))
    y = grouped_mm_nvfp4(p_perm, sb_perm.view(torch.float8_e4m3fn), sg, w_q, w_s, w_g, sizes, out_dtype=torch.float32)
    assert bool(torch.isfinite(y).all()) and bool((y[: int(sizes.sum())][pad[: int(sizes.sum())]] == 0).all())
