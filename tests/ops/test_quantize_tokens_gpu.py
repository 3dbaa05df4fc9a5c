"""quantize_fp8_tokens (wgrad's operand: 1x128 blocks along the tokens, transposed): GPU tier, the one-pass
kernel against the composition it replaces (zero-filled transpose, then quantize_fp8 "block") bit for bit."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.quant import quantize_fp8_tokens_reference
from moe_kernels.testing import assert_exact
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**22  # elements per case

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _input(M, C, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread along the tokens too, so the column blocks' scales differ.
    x = torch.randn(M, C, generator=g) * torch.logspace(-3, 3, C) * torch.logspace(-2, 2, M)[:, None]
    if specials and M >= 200 and C >= 130:
        x[3, 5], x[17, 9], x[29, 9] = float("nan"), float("inf"), -float("inf")
        x[40:45, 7] = 0.0
        x[50, 11] = -0.0
        x[60, 12] = 1e-42  # fp32 denormal
        x[:, 100] = 0.0  # a column of zero blocks
        x[128:, 101] = 0.0  # one zero block, one live
        x[130, 102] = float("nan")  # NaN in the second block only
    return x.to(dtype)


def _check(x_cpu, x_dev, pow2, what):
    q, s = mk.quantize_fp8_tokens(x_dev, pow2_scale=pow2)
    rq, rs = quantize_fp8_tokens_reference(x_cpu, pow2)
    assert_exact(s.cpu(), rs, f"{what} scales")
    assert_exact(q.cpu().view(torch.uint8), rq.view(torch.uint8), f"{what} codes")


@pytest.mark.parametrize("M", [0, 1, 127, 128, 129, 300])
@pytest.mark.parametrize("C", [128, 256, 7168])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(cuda, M, C, dtype):
    skip_if_too_large(M * C, EMULATION_BUDGET, "elements")
    if C == 7168 and dtype != torch.bfloat16 and M not in (0, 129):
        pytest.skip("the wide case runs in bf16 (the dtypes share the tile code)")
    x = _input(M, C, dtype, seed=M * 7 + C)
    _check(x, x.to(cuda), False, f"{M}x{C} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_specials_and_pow2(cuda, dtype, pow2):
    # NaN, +-inf, zeros, -0, denormals; whole zero blocks; a partial last block (M = 260).
    x = _input(260, 192, torch.float32, seed=11, specials=True).to(dtype)
    _check(x, x.to(cuda), pow2, f"specials {dtype} pow2={pow2}")


@pytest.mark.parametrize("C", [1, 33, 70])
def test_columns_not_a_multiple_of_8_take_the_scalar_path(cuda, C):
    x = _input(200, C, torch.bfloat16, seed=C)
    _check(x, x.to(cuda), False, f"C={C}")


def test_misaligned_and_strided_inputs(cuda):
    x = _input(150, 256, torch.bfloat16, seed=5)
    base = torch.empty(x.numel() + 1, dtype=x.dtype, device=cuda)
    dev = base[1:].view(150, 256)
    dev.copy_(x.to(cuda))
    assert dev.data_ptr() % 16 != 0
    _check(x, dev, False, "misaligned")
    xt = _input(256, 150, torch.float32, seed=6)
    _check(xt.t(), xt.to(cuda).t(), True, "transposed view")


def test_padding_codes_are_zero(cuda):
    x = torch.full((130, 128), float("nan"), dtype=torch.bfloat16)
    q, s = mk.quantize_fp8_tokens(x.to(cuda))
    assert q.shape == (128, 256) and s.shape == (128, 2)
    assert torch.all(q.cpu().view(torch.uint8)[:, 130:] == 0)
    assert torch.all(q.cpu().view(torch.uint8)[:, :130] == 0x7F)
