"""swiglu: CPU tier."""

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.ops import swiglu


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
