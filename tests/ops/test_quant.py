"""FP8 quantization: CPU tier (the reference against hand-worked values and an independent loop)."""

import math

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.quant import BLOCK, FP8_MAX, dequantize_fp8_reference, quantize_fp8_reference, scale_shape
from moe_kernels.testing import assert_exact

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRANS = ("tensor", "row", "block", "tile")


def _bytes(q):
    return q.view(torch.uint8)


def test_hand_worked_tensor_scale():
    x = torch.tensor([[1.0, -2.0, 224.0, 0.0]])
    q, s = mk.quantize_fp8(x, "tensor")
    assert s.item() == 2.0  # 448 / 224
    assert q.float().tolist() == [[2.0, -4.0, 448.0, 0.0]]
    assert mk.dequantize_fp8(q, s, "tensor", dtype=torch.float32).tolist() == x.tolist()


def test_scale_rules():
    x = torch.zeros(3, 256)
    x[1, 0] = float("inf")
    x[2, :] = 1e-40  # a denormal amax: 448 / amax overflows fp32 and is clamped
    q, s = mk.quantize_fp8(x, "row")
    assert s[0].item() == 1.0 and s[1].item() == 1.0
    assert s[2].item() == torch.finfo(torch.float32).max
    assert q[1, 0].float().item() == 448.0  # inf saturates
    x = torch.full((1, 4), 3.0)
    assert mk.quantize_fp8(x, "tensor")[1].item() == pytest.approx(448 / 3)
    assert mk.quantize_fp8(x, "tensor", pow2_scale=True)[1].item() == 128.0  # 2^floor(log2(149.3))
    assert mk.quantize_fp8(x, "tensor", fp8_dtype=E5M2)[1].item() == pytest.approx(57344 / 3)
    nan = torch.tensor([[1.0, float("nan"), 2.0]])
    q, s = mk.quantize_fp8(nan, "block")
    assert s.item() == 1.0 and _bytes(q)[0, 1].item() == 0x7F and q[0, 2].float().item() == 2.0


def _loop_reference(x, gran, fp8_dtype, pow2):
    """An independent formulation: one scale at a time, in Python floats for the scale."""
    M, K = x.shape
    fmax = FP8_MAX[fp8_dtype]
    scale = torch.empty(scale_shape(gran, M, K))
    q = torch.empty(M, K, dtype=torch.uint8)

    def regions():
        if gran == "tensor":
            yield (), slice(0, M), slice(0, K)
        elif gran == "row":
            for r in range(M):
                yield (r,), slice(r, r + 1), slice(0, K)
        else:
            rstep = BLOCK if gran == "tile" else 1
            for i, r in enumerate(range(0, M, rstep)):
                for j, c in enumerate(range(0, K, BLOCK)):
                    yield (i, j), slice(r, r + rstep), slice(c, c + BLOCK)

    for at, rs, cs in regions():
        blk = x[rs, cs].float()
        amax = blk.abs().max().item() if blk.numel() else 0.0
        if math.isnan(amax) or math.isinf(amax) or amax == 0:
            s = 1.0
        else:
            s = torch.tensor(fmax, dtype=torch.float32).div(torch.tensor(amax, dtype=torch.float32)).item()
            s = min(s, torch.finfo(torch.float32).max)
        if pow2:
            s = 2.0 ** math.floor(math.log2(s))
        scale[at] = s
        v = blk * torch.tensor(s, dtype=torch.float32)
        code = v.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
        q[rs, cs] = torch.where(torch.isnan(v), torch.tensor(0x7F, dtype=torch.uint8), code)
    return q, scale


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("M,K", [(1, 1), (3, 7), (130, 300), (5, 256)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_reference_matches_independent_loop(gran, M, K, fp8_dtype, pow2):
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)  # every block a different magnitude
    if M * K > 10:
        x.view(-1)[::11] = 0.0
    q, s = quantize_fp8_reference(x.to(torch.bfloat16), gran, fp8_dtype, pow2)
    lq, ls = _loop_reference(x.to(torch.bfloat16), gran, fp8_dtype, pow2)
    assert_exact(s, ls, "scales")
    assert_exact(_bytes(q), lq, "codes")


@pytest.mark.parametrize("gran", GRANS)
def test_round_trip_error_bound(gran):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(257, 515, generator=g) * 10
    q, s = mk.quantize_fp8(x, gran)
    assert bool(torch.isfinite(q.float()).all())
    back = mk.dequantize_fp8(q, s, gran, dtype=torch.float32)
    # e4m3: 3 mantissa bits, so a relative error of at most 2^-4 in the normal range, plus half the
    # subnormal spacing (2^-10) in units of 1/scale.
    step = 1.0 / mk.ops.quant._expand(s, gran, *x.shape)
    assert bool(((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * step).all())


def test_empty_and_dtypes():
    for gran in GRANS:
        q, s = mk.quantize_fp8(torch.empty(0, 300), gran)
        assert q.shape == (0, 300) and tuple(s.shape) == scale_shape(gran, 0, 300)
    x = torch.randn(4, 130)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        q, s = mk.quantize_fp8(x.to(dt), "block")
        out = mk.dequantize_fp8(q, s, "block", dtype=dt)
        assert out.dtype == dt
        assert_exact(out, dequantize_fp8_reference(q, s, "block", dt), f"dequant {dt}")


def test_bad_input():
    with pytest.raises(ValueError, match="granularity"):
        mk.quantize_fp8(torch.randn(2, 4), "column")
    with pytest.raises(ValueError, match="2-D"):
        mk.quantize_fp8(torch.randn(2, 4, 4), "row")
    with pytest.raises(TypeError, match="`x`"):
        mk.quantize_fp8(torch.randn(2, 4, dtype=torch.float64), "row")
    with pytest.raises(TypeError, match="fp8_dtype"):
        mk.quantize_fp8(torch.randn(2, 4), "row", fp8_dtype=torch.int8)
    with pytest.raises(ValueError, match="contiguous"):
        mk.quantize_fp8(torch.randn(4, 2).t(), "row")
    q, s = mk.quantize_fp8(torch.randn(2, 300), "block")
    with pytest.raises(ValueError, match="`scale` must have shape"):
        mk.dequantize_fp8(q, s, "row")


def test_opcheck():
    x = torch.randn(5, 200)
    # torch's schema check cannot compare fp8 tensors (no fp8 multiply on the CPU), so both ops skip it;
    # the fake, autograd-registration and dispatch checks still run.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for gran in GRANS:
        torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8, (x, gran, E4M3, False), test_utils=utils)
        q, s = mk.quantize_fp8(x, gran)
        torch.library.opcheck(torch.ops.moe_kernels.dequantize_fp8, (q, s, gran, torch.bfloat16), test_utils=utils)


def test_payload_and_scales_travel_through_permute():
    # permute is deterministic: the fp8 rows and their 1x128 scales, permuted separately with the same
    # routing, land on the same rows; dequantizing after permute equals permuting after dequantizing.
    from moe_kernels.testing import random_routing

    x = torch.randn(50, 300) * 4
    q, s = mk.quantize_fp8(x, "block")
    idx = random_routing(50, 8, 2, kind="zipf", drop=0.1, seed=2)
    q_perm, row_map, sizes = mk.permute(q, idx, 8, align=128)
    s_perm, row_map_s, sizes_s = mk.permute(s, idx, 8, align=128)
    assert_exact(row_map_s, row_map, "row maps")
    assert_exact(sizes_s, sizes, "group sizes")
    back = mk.dequantize_fp8(q_perm, s_perm, "block", dtype=torch.float32)
    expected = mk.dequantize_fp8(q, s, "block", dtype=torch.float32)
    valid = row_map >= 0
    tokens = torch.arange(50)[:, None].expand_as(row_map)[valid]
    assert_exact(back[row_map[valid].long()], expected[tokens], "dequantized rows")


def test_zero_scale_is_a_block_of_zeros():
    # permute's padding rows carry scale 0 (zero-filled codes and scales): such a block dequantizes to 0,
    # whatever its codes, and -0 likewise, not 0 / 0 = NaN; the other blocks keep q / scale.
    g = torch.Generator().manual_seed(9)
    for gran in GRANS:
        q, s = mk.quantize_fp8(torch.randn(300, 260, generator=g) * 3, gran)
        zero = torch.rand(s.shape, generator=g) < 0.5
        zero.view(-1)[0] = True
        s0 = torch.where(zero, torch.where(torch.rand(s.shape, generator=g) < 0.5, 0.0, -0.0), s)
        mask = mk.ops.quant._expand(zero, gran, *q.shape)  # [M, K] elements in a zero-scale block
        for dt in (torch.float32, torch.bfloat16):
            out = mk.dequantize_fp8(q, s0, gran, dtype=dt)
            assert_exact(out, dequantize_fp8_reference(q, s0, gran, dt), f"{gran} {dt} op vs reference")
            assert bool((out[mask] == 0).all()), f"{gran} {dt}: a zero scale gives zeros"
            assert_exact(out[~mask], mk.dequantize_fp8(q, s, gran, dtype=dt)[~mask], f"{gran} {dt}: other blocks")
