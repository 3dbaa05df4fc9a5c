"""swiglu_quantize_fp8 (the SwiGLU forward writing the down projection's input in FP8, both layouts) and
swiglu_bwd_quantize_fp8 (the backward writing the up projection's gradient in FP8, both layouts): GPU tier, bit
for bit against the compositions they replace, swiglu (or swiglu_bwd) then quantize_fp8(., "block",
pad_to_block=True) and quantize_fp8_tokens, each run on the same device. F need only be a multiple of 8: the
forward blocks' codes past F (past 2F for dh, whose blocks then straddle d(gate) and d(up)) are zeros."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.activation import swiglu, swiglu_bwd_quantize_fp8, swiglu_quantize_fp8
from moe_kernels.testing import assert_exact
from tests.emulation import misaligned_copy, skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**21  # activation elements per case


def _input(R, F, dtype, seed, weights):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, 2 * F, generator=g) * 3 * torch.logspace(-2, 2, R)[:, None]
    w = torch.rand(R, generator=g) if weights else None
    return h.to(dtype), w


def _check(h, w, pow2, what):
    got = swiglu_quantize_fp8(h, w, pow2_scale=pow2)
    a = swiglu(h, w)
    want = (*mk.quantize_fp8(a, "block", pow2_scale=pow2, pad_to_block=True), *mk.quantize_fp8_tokens(a, pow2_scale=pow2))
    for name, x, y in zip(("a_q", "a_scale", "a_t_q", "a_t_scale"), got, want):
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what} {name}"
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert_exact(x.cpu(), y.cpu(), f"{what} {name}")


@pytest.mark.parametrize("R", [0, 1, 127, 128, 129, 300])
@pytest.mark.parametrize("F", [128, 256, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_composition(cuda, R, F, dtype):
    skip_if_too_large(R * F, EMULATION_BUDGET, "elements")
    h, w = _input(R, F, dtype, seed=R + F, weights=R % 2 == 1)
    _check(h.to(cuda), None if w is None else w.to(cuda), False, f"{R}x{F} {dtype} weights={w is not None}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_specials_and_pow2(cuda, dtype, pow2):
    h, w = _input(260, 256, torch.float32, seed=3, weights=True)
    h[3, 5], h[17, 300], h[29, 9] = float("nan"), float("inf"), -float("inf")  # gate NaN, up inf, gate -inf
    h[:, 100] = 0.0  # a column of zeros: zero token blocks
    h[140:150, :] = 0.0  # zero rows: zero forward blocks
    h[200, 256 + 7] = 1e30  # overflows fp16: inf in the activation
    w[7] = 0.0
    _check(h.to(dtype).to(cuda), w.to(cuda), pow2, f"specials {dtype} pow2={pow2}")


def test_misaligned_h_and_fp16_weights(cuda):
    h, _ = _input(140, 128, torch.bfloat16, seed=9, weights=False)
    base = torch.empty(h.numel() + 1, dtype=h.dtype, device=cuda)
    dev = base[1:].view(140, 256)
    dev.copy_(h.to(cuda))
    assert dev.data_ptr() % 16 != 0
    w = torch.rand(140, dtype=torch.float16).to(cuda)
    _check(dev, w, False, "misaligned")


@pytest.mark.parametrize("R", [1, 129, 300])
@pytest.mark.parametrize("F", [8, 136, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_f_off_128_pads_the_codes(cuda, R, F, dtype):
    # F % 128 != 0 (GPT-OSS's 2880): the last forward block of each row holds F % 128 values and zero codes after.
    h, w = _input(R, F, dtype, seed=R + 7 * F, weights=R % 2 == 1)
    h, w = h.to(cuda), None if w is None else w.to(cuda)
    _check(h, w, False, f"{R}x{F} {dtype}")
    a_q = swiglu_quantize_fp8(h, w)[0]
    assert a_q.shape == (R, -(-F // 128) * 128)
    assert not a_q[:, F:].view(torch.uint8).any(), "codes past F"


def test_rejects_f_not_a_multiple_of_8(cuda):
    with pytest.raises(ValueError, match="multiple of 8"):
        swiglu_quantize_fp8(torch.zeros(4, 2 * 100, dtype=torch.bfloat16, device=cuda))


# The backward: swiglu_bwd_quantize_fp8 against swiglu_bwd then quantize_fp8(., "block") and quantize_fp8_tokens.


def _check_bwd(da, h, w, need_dw, pow2, what):
    got = swiglu_bwd_quantize_fp8(da, h, w, need_dw=need_dw, pow2_scale=pow2)
    dh, dw = torch.ops.moe_kernels.swiglu_bwd(da, h, w, need_dw)
    want = (*mk.quantize_fp8(dh, "block", pow2_scale=pow2, pad_to_block=True), *mk.quantize_fp8_tokens(dh, pow2_scale=pow2),
            dw)
    for name, x, y in zip(("dh_q", "dh_scale", "dh_t_q", "dh_t_scale", "drow_weights"), got, want):
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what} {name}"
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert_exact(x.cpu(), y.cpu(), f"{what} {name}")


def _grad_input(R, F, dtype, seed, weights):
    h, w = _input(R, F, dtype, seed, weights)
    g = torch.Generator().manual_seed(seed + 1)
    da = (torch.randn(R, F, generator=g) * torch.logspace(-3, 1, R)[:, None]).to(dtype)
    return da, h, w


@pytest.mark.parametrize("R", [0, 1, 127, 128, 129, 300])
@pytest.mark.parametrize("F", [128, 256, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backward_matches_composition(cuda, R, F, dtype):
    skip_if_too_large(R * F, EMULATION_BUDGET, "elements")
    da, h, w = _grad_input(R, F, dtype, seed=R * 3 + F, weights=R % 2 == 1)
    _check_bwd(da.to(cuda), h.to(cuda), None if w is None else w.to(cuda), w is not None, False,
               f"backward {R}x{F} {dtype} weights={w is not None}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_backward_specials_and_pow2(cuda, dtype, pow2):
    # NaN / inf in h and in the incoming gradient, zero columns and rows (zero blocks in both layouts), an fp16
    # overflow, a zero routing weight; the routing weights' gradient as well.
    da, h, w = _grad_input(260, 256, torch.float32, seed=4, weights=True)
    h[3, 5], h[17, 300], h[29, 9] = float("nan"), float("inf"), -float("inf")
    da[40, 7], da[41, 130] = float("nan"), float("inf")
    h[:, 100] = 0.0  # d(up) zero in column 100: a zero token block
    da[140:150, :] = 0.0  # zero rows: zero forward blocks
    h[200, 256 + 7] = 1e30  # overflows fp16
    w[7] = 0.0
    _check_bwd(da.to(dtype).to(cuda), h.to(dtype).to(cuda), w.to(cuda), True, pow2,
               f"backward specials {dtype} pow2={pow2}")


@pytest.mark.parametrize("R", [1, 129, 300])
@pytest.mark.parametrize("F", [8, 64, 136, 192, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_f_off_128_straddles_the_halves(cuda, R, F, dtype):
    # F % 128 != 0: blocks of dh = [d(gate) | d(up)] hold values of both halves (F = 200: block 1 is d(gate)'s
    # columns 128..199 and d(up)'s 0..55); 2F off 128 (8, 136, 200) zero-pads the last block's codes, 2F a
    # multiple of 128 (64, 192: as GPT-OSS's 2880) straddles without padding.
    da, h, w = _grad_input(R, F, dtype, seed=R * 5 + F, weights=R % 2 == 1)
    h[:, F:] *= 50  # the halves' gradients of different magnitudes: a straddling block's scale is the larger's
    da, h, w = da.to(cuda), h.to(cuda), None if w is None else w.to(cuda)
    _check_bwd(da, h, w, w is not None, False, f"backward {R}x{F} {dtype}")
    dh_q = swiglu_bwd_quantize_fp8(da, h, w)[0]
    assert dh_q.shape == (R, -(-2 * F // 128) * 128)
    assert not dh_q[:, 2 * F:].view(torch.uint8).any(), "codes past 2F"


def test_backward_hot_and_empty_row_ranges(cuda):
    # A hot expert's long run of large rows next to rows of zeros (an empty expert's padding): per-block scales.
    da, h, _ = _grad_input(384, 128, torch.bfloat16, seed=8, weights=False)
    h[:128] *= 100
    h[128:256] = 0
    da[128:256] = 0
    _check_bwd(da.to(cuda), h.to(cuda), None, False, False, "hot and empty")


def test_backward_misaligned_inputs(cuda):
    da, h, w = _grad_input(140, 128, torch.bfloat16, seed=9, weights=True)
    _check_bwd(misaligned_copy(da, cuda), misaligned_copy(h, cuda), w.to(torch.float16).to(cuda), True, False,
               "backward misaligned")


def test_backward_bad_input_raises_before_the_kernel(cuda):
    h = torch.zeros(4, 256, dtype=torch.bfloat16, device=cuda)
    with pytest.raises(ValueError, match="multiple of 8"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 100, dtype=torch.bfloat16, device=cuda),
                                torch.zeros(4, 200, dtype=torch.bfloat16, device=cuda))
    with pytest.raises(ValueError, match="`dout` must have shape"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 256, dtype=torch.bfloat16, device=cuda), h)
    with pytest.raises(TypeError, match="`dout` must have dtype"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 128, dtype=torch.float16, device=cuda), h)
    with pytest.raises(ValueError, match="`row_weights` must have shape"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 128, dtype=torch.bfloat16, device=cuda), h,
                                torch.ones(5, device=cuda))
