"""swiglu and squared_relu: CPU tier."""

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.ops import squared_relu, swiglu


def test_matches_formula_and_weights():
    h = torch.randn(7, 10)
    w = torch.rand(7)
    torch.testing.assert_close(swiglu(h), F.silu(h[:, :5]) * h[:, 5:])
    torch.testing.assert_close(swiglu(h, w), F.silu(h[:, :5]) * h[:, 5:] * w[:, None])
    hb = h.bfloat16()
    assert swiglu(hb).dtype == torch.bfloat16
    torch.testing.assert_close(swiglu(hb), (F.silu(hb[:, :5].float()) * hb[:, 5:].float()).bfloat16())


def test_gradcheck_and_opcheck():
    h = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, w: swiglu(h, w), (h, w))
    assert torch.autograd.gradcheck(lambda h: swiglu(h), (h,))
    torch.library.opcheck(torch.ops.moe_kernels.swiglu, (torch.randn(5, 6, requires_grad=True), torch.rand(5, requires_grad=True)))
    torch.library.opcheck(torch.ops.moe_kernels.swiglu, (torch.randn(5, 6, requires_grad=True), None))


def test_bad_input():
    with pytest.raises(ValueError, match="odd"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="row_weights"):
        swiglu(torch.randn(3, 4), torch.rand(4))
    with pytest.raises(TypeError, match="`h`"):
        swiglu(torch.randint(0, 3, (3, 4)))
    bwd = torch.ops.moe_kernels.swiglu_bwd  # the registered backward op called directly
    h = torch.randn(3, 4)
    with pytest.raises(ValueError, match="swiglu backward: `dout` must have shape"):
        bwd(torch.randn(3, 4), h, None, False)
    with pytest.raises(TypeError, match="swiglu backward: `dout` must have dtype"):
        bwd(torch.randn(3, 2, dtype=torch.float64), h, None, False)
    with pytest.raises(ValueError, match="swiglu backward: `row_weights`"):
        bwd(torch.randn(3, 2), h, torch.rand(2), True)


# ---------------------------------------------------------------------------------------------------
# squared_relu


def _edge_values(dtype):
    # zeros of both signs, NaN, infinities, values whose square overflows fp16 (300^2 > 65504) or underflows, and one
    # whose double overflows fp16 too (2 x 40000: torch's backward rounds 2 relu(h) to the dtype before the product)
    return torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 300.0, -300.0, 1e-30, -1e-30, 40000.0],
                        dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_squared_relu_is_torchs_relu_then_square(dtype):
    h = torch.cat([torch.randn(200).to(dtype), _edge_values(dtype)]).view(3, 70)
    out = squared_relu(h)
    assert out.dtype == dtype and out.shape == h.shape
    # relu(h)^2 exactly (fp64 holds the product of two fp32 values exactly), rounded once to the dtype: torch's
    # relu then square, bit for bit
    exact = torch.relu(h.double()).square().to(dtype)
    torch.testing.assert_close(out, exact, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out, torch.square(torch.relu(h)), rtol=0, atol=0, equal_nan=True)
    # its gradient: torch's, bit for bit, for a gradient holding infinities and NaN as well
    hg = h.clone().requires_grad_()
    dout = torch.cat([torch.randn(205).to(dtype), _edge_values(dtype)[:5]]).view(3, 70)
    (ours,) = torch.autograd.grad(squared_relu(hg), hg, dout)
    (theirs,) = torch.autograd.grad(torch.square(torch.relu(hg)), hg, dout)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def test_squared_relu_gradcheck_and_opcheck():
    h = torch.randn(6, 9, dtype=torch.float64)
    h = (h + 0.1 * h.sign()).requires_grad_()  # away from the kink at 0, where the finite difference is one-sided
    assert torch.autograd.gradcheck(squared_relu, (h,))
    torch.library.opcheck(torch.ops.moe_kernels.squared_relu, (torch.randn(5, 6, requires_grad=True),))
    torch.library.opcheck(torch.ops.moe_kernels.squared_relu, (torch.randn(0, 6, requires_grad=True),))


def test_squared_relu_bad_input():
    with pytest.raises(TypeError, match="squared_relu: `h`"):
        squared_relu(torch.randint(0, 3, (3, 4)))
    with pytest.raises(ValueError, match="squared_relu: `h` must be contiguous"):
        squared_relu(torch.randn(4, 3).t())
    with pytest.raises(TypeError, match="squared_relu: `h` must be a torch.Tensor"):
        squared_relu([1.0, 2.0])
    bwd = torch.ops.moe_kernels.squared_relu_bwd
    h = torch.randn(4, 3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="squared_relu backward: `dout` must have dtype"):
        bwd(torch.randn(4, 3), h)
    with pytest.raises(ValueError, match="squared_relu backward: `dout` must have shape"):
        bwd(torch.randn(4, 2, dtype=torch.bfloat16), h)
    with pytest.raises(ValueError, match="squared_relu: `h` must be contiguous"):
        bwd(torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16).t())
