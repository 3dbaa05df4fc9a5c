"""fp8_dequant_scales (csrc/quant/fp8_scales.cu): the FP8 GEMMs' dequantization scales of both operands in one
launch, bit for bit the reference `_inverse_scale` (1 / scale, 0 where the scale is 0) and, for wgrad's
token-block-major layout, its transpose; every output element written (outputs pre-filled with a sentinel)."""

import pytest
import torch

from moe_kernels import _ext
from moe_kernels.ops.grouped_mm_fp8 import _dequant_scales, _inverse_scale
from moe_kernels.testing import assert_exact

pytestmark = pytest.mark.gpu

_SPECIALS = [0.0, -0.0, float("inf"), float("nan"), 1.0, 448.0, 3.4028234663852886e38, 1.1754943508222875e-38,
             1e-45, 2.0**-130, 2.0**127]


def _scales(shape, gen) -> torch.Tensor:
    """Quantization scales over fp32's whole exponent range (fmax / amax spans it), specials sprinkled in."""
    s = torch.exp2(torch.randint(-149, 128, shape, generator=gen).float()) * (1 + torch.rand(shape, generator=gen))
    flat = s.view(-1)
    if flat.numel():
        idx = torch.randperm(flat.numel(), generator=gen)[: len(_SPECIALS)]
        flat[idx] = torch.tensor(_SPECIALS[: len(idx)])
    return s


def _launch(cuda, a, b, transpose, max_blocks=0):
    """The kernel called directly on outputs pre-filled with a sentinel (so an unwritten element shows);
    `max_blocks` caps the grid, so each block strides over several tiles."""
    C = _ext.kernels("fp8_dequant_scales", a)
    assert C is not None
    ra, rb = (a.shape[:-1].numel(), a.shape[-1]), (b.shape[:-1].numel(), b.shape[-1])
    a_out = torch.full((ra[1], ra[0]) if transpose else a.shape, 12345.0, device=cuda)
    b_out = torch.full((rb[1], rb[0]) if transpose else b.shape, 12345.0, device=cuda)
    launch = _ext.launch_args(a)
    C.fp8_dequant_scales(a.data_ptr(), a_out.data_ptr(), *ra, b.data_ptr(), b_out.data_ptr(), *rb, transpose,
                         launch["device"], launch["stream"], max_blocks)
    return a_out, b_out


def _expected(s: torch.Tensor, transpose: bool) -> torch.Tensor:
    inv = _inverse_scale(s)
    return inv.reshape(s.shape[:-1].numel(), s.shape[-1]).t().contiguous() if transpose else inv


CASES = [
    # the forward and dgrad: x or dout scales [M, K / 128], the weight's tiles [E, N / 128, K / 128]
    ((300, 56), (8, 16, 56), False),
    ((77, 15), (3, 4, 15), False),
    ((1, 1), (1, 1, 1), False),
    ((33, 65), (2, 33, 65), False),
    ((0, 2), (4, 3, 2), False),
    # wgrad: dout's and x's token-major scales [N, M / 128] and [K, M / 128], written [M / 128, N] and [M / 128, K]
    ((2048, 5), (96, 5), True),
    ((33, 65), (65, 33), True),
    ((100, 37), (31, 37), True),
    ((1, 1), (1, 1), True),
    ((0, 3), (5, 3), True),
    ((7, 0), (3, 0), True),
    ((64, 32), (32, 64), True),
]


def _id(a, b, t) -> str:
    return f"{'x'.join(map(str, a))}-{'x'.join(map(str, b))}-{'t' if t else 'n'}"


@pytest.mark.parametrize("a_shape,b_shape,transpose", CASES, ids=[_id(*c) for c in CASES])
def test_matches_reference(cuda, a_shape, b_shape, transpose):
    gen = torch.Generator().manual_seed(hash((a_shape, b_shape, transpose)) % 2**31)
    a, b = _scales(a_shape, gen), _scales(b_shape, gen)
    a_out, b_out = _launch(cuda, a.to(cuda), b.to(cuda), transpose)
    assert_exact(a_out, _expected(a, transpose).to(cuda), f"a {a_shape} transpose={transpose}")
    assert_exact(b_out, _expected(b, transpose).to(cuda), f"b {b_shape} transpose={transpose}")


@pytest.mark.parametrize("max_blocks", [1, 3])
@pytest.mark.parametrize("transpose", [True, False], ids=["t", "n"])
def test_blocks_striding_over_tiles(cuda, max_blocks, transpose):
    # Fewer blocks than tiles: each block takes tiles of a, then of b (the tile staged in shared memory reused;
    # a missing barrier between iterations overwrites it while it is still read).
    gen = torch.Generator().manual_seed(11 + max_blocks)
    a, b = _scales((70, 45), gen), _scales((33, 100), gen)
    a_out, b_out = _launch(cuda, a.to(cuda), b.to(cuda), transpose, max_blocks)
    assert_exact(a_out, _expected(a, transpose).to(cuda), f"a, {max_blocks} blocks, transpose={transpose}")
    assert_exact(b_out, _expected(b, transpose).to(cuda), f"b, {max_blocks} blocks, transpose={transpose}")


def test_op_helper_matches_reference(cuda):
    # The helper the FP8 GEMMs call: allocates, makes the inputs contiguous (a strided scale view included).
    gen = torch.Generator().manual_seed(7)
    a = _scales((40, 96), gen).to(cuda)
    b = _scales((3, 9, 12), gen).to(cuda)
    C = _ext.kernels("fp8_dequant_scales", a)
    a_view = a[:, ::2]  # [40, 48], not contiguous
    a_out, b_out = _dequant_scales(C, a_view, b)
    assert_exact(a_out, _inverse_scale(a_view), "a (strided view)")
    assert_exact(b_out, _inverse_scale(b), "b")
    a_out, b_out = _dequant_scales(C, a_view, b[0], transpose=True)
    assert_exact(a_out, _inverse_scale(a_view).t().contiguous(), "a transposed")
    assert_exact(b_out, _inverse_scale(b[0]).t().contiguous(), "b transposed")


def test_bad_sizes_raise(cuda):
    C = _ext.kernels("fp8_dequant_scales", torch.empty(1, device=cuda))
    launch = _ext.launch_args(torch.empty(1, device=cuda))
    with pytest.raises(ValueError, match="negative size"):
        C.fp8_dequant_scales(0, 0, -1, 4, 0, 0, 0, 0, False, launch["device"], launch["stream"])
    with pytest.raises(ValueError, match="without its pointers"):
        C.fp8_dequant_scales(0, 0, 2, 4, 0, 0, 0, 0, False, launch["device"], launch["stream"])
    with pytest.raises(ValueError, match="negative max_blocks"):
        C.fp8_dequant_scales(0, 0, 0, 0, 0, 0, 0, 0, False, launch["device"], launch["stream"], -1)
