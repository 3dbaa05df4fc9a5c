"""The rows_fp8 kernel's ops: squared_relu_quantize_fp8 (the squared ReLU writing the down projection's input in FP8,
both layouts), squared_relu_bwd_quantize_fp8 (its backward writing the up projection's output gradient in FP8, both
layouts) and quantize_fp8_dual (both layouts of a tensor as it is): GPU tier, bit for bit against the compositions
they replace, squared_relu (or its backward, or nothing) then quantize_fp8(., "block", pad_to_block=True) and
quantize_fp8_tokens, each run on the same device. F off 128 (the forward blocks' codes zero-padded) as well as on
it."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.activation import quantize_fp8_dual, squared_relu_bwd_quantize_fp8, squared_relu_quantize_fp8
from moe_kernels.testing import assert_exact
from tests.emulation import EMULATED, misaligned_copy, skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**21  # activation elements per case
NAMES = ("q", "scale", "t_q", "t_scale")


def _input(R, F, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, F, generator=g) * 3 * torch.logspace(-2, 2, R)[:, None]
    d = torch.randn(R, F, generator=g) * torch.logspace(-3, 1, R)[:, None]
    return h.to(dtype), d.to(dtype)


def _compare(got, want, what):
    for name, x, y in zip(NAMES, got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what} {name}"
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert_exact(x.cpu(), y.cpu(), f"{what} {name}")


def _layouts(v, pow2):
    return (*mk.quantize_fp8(v, "block", pow2_scale=pow2, pad_to_block=True), *mk.quantize_fp8_tokens(v, pow2_scale=pow2))


def _check(h, pow2, what):
    _compare(squared_relu_quantize_fp8(h, pow2_scale=pow2), _layouts(torch.ops.moe_kernels.squared_relu(h), pow2), what)
    _compare(quantize_fp8_dual(h, pow2_scale=pow2), _layouts(h, pow2), f"dual {what}")


def _check_bwd(d, h, pow2, what):
    dh = torch.ops.moe_kernels.squared_relu_bwd(d, h)
    _compare(squared_relu_bwd_quantize_fp8(d, h, pow2_scale=pow2), _layouts(dh, pow2), f"backward {what}")


@pytest.mark.parametrize("R", [0, 1, 127, 128, 129, 300])
@pytest.mark.parametrize("F", [8, 128, 200, 256, 1856])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_composition(cuda, R, F, dtype):
    skip_if_too_large(R * F, EMULATION_BUDGET, "elements")
    h, d = _input(R, F, dtype, seed=R + F)
    _check(h.to(cuda), False, f"{R}x{F} {dtype}")
    _check_bwd(d.to(cuda), h.to(cuda), False, f"{R}x{F} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_specials_and_pow2(cuda, dtype, pow2):
    # NaN / inf in h and in the incoming gradient, zero columns and rows (zero blocks in both layouts), an fp16
    # overflow (relu(h)^2 past 65504), negative blocks (relu zero), F off 128 so the padded block has them too.
    h, d = _input(260, 200, torch.float32, seed=3)
    h[3, 5], h[17, 190], h[29, 9] = float("nan"), float("inf"), -float("inf")
    d[40, 7], d[41, 130], d[17, 190] = float("nan"), float("inf"), float("nan")
    h[:, 100] = 0.0  # a column of zeros: zero token blocks
    h[140:150, :] = 0.0  # zero rows: zero forward blocks
    h[200, 150] = 300.0  # 90000: inf in fp16
    h[210:215, 128:] = -1.0  # the padded block negative: a zero block
    h, d = h.to(dtype).to(cuda), d.to(dtype).to(cuda)
    _check(h, pow2, f"specials {dtype} pow2={pow2}")
    _check_bwd(d, h, pow2, f"specials {dtype} pow2={pow2}")


def test_padding_codes_are_zero(cuda):
    # Fresh allocations filled (NaN codes, not the zeros of recycled memory), so unwritten padding shows.
    h, d = _input(130, 200, torch.bfloat16, seed=5)
    h, d = h.to(cuda), d.to(cuda)
    torch.use_deterministic_algorithms(True, warn_only=True)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        outs = [squared_relu_quantize_fp8(h), squared_relu_bwd_quantize_fp8(d, h), quantize_fp8_dual(h)]
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(EMULATED, warn_only=True)
    for q, _, qt, _ in outs:
        assert q.shape == (130, 256) and qt.shape == (200, 256)
        assert torch.all(q.view(torch.uint8)[:, 200:] == 0) and torch.all(qt.view(torch.uint8)[:, 130:] == 0)


def test_hot_and_empty_row_ranges(cuda):
    # A hot expert's long run of large rows next to rows of zeros (an empty expert's padding): per-block scales.
    h, d = _input(384, 256, torch.bfloat16, seed=8)
    h[:128] *= 100
    h[128:256] = 0
    d[128:256] = 0
    _check(h.to(cuda), False, "hot and empty")
    _check_bwd(d.to(cuda), h.to(cuda), False, "hot and empty")


def test_misaligned_inputs(cuda):
    h, d = _input(140, 136, torch.bfloat16, seed=9)
    h, d = misaligned_copy(h, cuda), misaligned_copy(d, cuda)
    _check(h, False, "misaligned")
    _check_bwd(d, h, False, "misaligned")


def test_bad_input_raises_before_the_kernel(cuda):
    h = torch.zeros(4, 256, dtype=torch.bfloat16, device=cuda)
    with pytest.raises(ValueError, match="multiple of 8"):
        squared_relu_quantize_fp8(torch.zeros(4, 100, dtype=torch.bfloat16, device=cuda))
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_fp8_dual(torch.zeros(4, 100, dtype=torch.bfloat16, device=cuda))
    with pytest.raises(TypeError, match="`t` must have dtype"):
        quantize_fp8_dual(torch.zeros(4, 128, dtype=torch.float64, device=cuda))
    with pytest.raises(ValueError, match="`dout` must have shape"):
        squared_relu_bwd_quantize_fp8(torch.zeros(4, 128, dtype=torch.bfloat16, device=cuda), h)
    with pytest.raises(TypeError, match="`dout` must have dtype"):
        squared_relu_bwd_quantize_fp8(torch.zeros(4, 256, dtype=torch.float16, device=cuda), h)


def test_dual_of_a_strided_view(cuda):
    # A non-contiguous view (a column slice) is quantized as its contiguous copy.
    h, _ = _input(130, 272, torch.bfloat16, seed=12)
    view = h.to(cuda)[:, 8:264]
    _compare(quantize_fp8_dual(view), _layouts(view.contiguous(), False), "dual of a view")


@pytest.mark.slow
@pytest.mark.gpu_memory
@pytest.mark.cuda_device
def test_past_2_31_elements(cuda):
    # 2^20 + 8 rows of 2048 (2^31 + 16384 elements, 4 GB of bf16): the row-major codes' offsets and the token-major
    # copy's pass 2^31 (64-bit indices). quantize_fp8_dual against quantize_fp8 and quantize_fp8_tokens on the
    # device, compared there; then the squared ReLU forward's codes against the composition's.
    if EMULATED:
        pytest.skip("not emulated: 2^31 elements")
    R, C = 2**20 + 8, 2048
    t = torch.randn(R, C, device=cuda, dtype=torch.bfloat16)
    got = quantize_fp8_dual(t)
    for name, x, y in zip(NAMES[:2], got[:2], mk.quantize_fp8(t, "block", pad_to_block=True), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), name
    for name, x, y in zip(NAMES[2:], got[2:], mk.quantize_fp8_tokens(t), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), name
    del got
    q, s, _, _ = squared_relu_quantize_fp8(t)
    wq, ws = mk.quantize_fp8(torch.ops.moe_kernels.squared_relu(t), "block", pad_to_block=True)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
