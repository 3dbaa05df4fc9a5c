"""swiglu_quantize_fp8 (the SwiGLU forward writing the down projection's input in FP8, both layouts): GPU tier,
bit for bit against the composition it replaces, swiglu then quantize_fp8(., "block") and quantize_fp8_tokens,
each run on the same device."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.activation import swiglu, swiglu_quantize_fp8
from moe_kernels.testing import assert_exact
from tests.emulation import skip_if_too_large

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
    want = (*mk.quantize_fp8(a, "block", pow2_scale=pow2), *mk.quantize_fp8_tokens(a, pow2_scale=pow2))
    for name, x, y in zip(("a_q", "a_scale", "a_t_q", "a_t_scale"), got, want):
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


def test_rejects_f_not_a_multiple_of_128(cuda):
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_quantize_fp8(torch.zeros(4, 2 * 96, dtype=torch.bfloat16, device=cuda))
