"""swiglu: GPU tier against fp64 (policy: error <= 2x torch's at the same precision)."""

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.ops import swiglu
from moe_kernels.ops.activation import swiglu_bwd_reference, swiglu_reference
from moe_kernels.testing import assert_close_to_fp64

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("R,F_", [(0, 8), (1, 1), (37, 3), (1000, 768), (300, 2048), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_fp64(cuda, R, F_, dtype, weighted):
    h = torch.randn(R, 2 * F_).to(dtype)
    w = torch.rand(R) if weighted else None
    hg = h.to(cuda).requires_grad_()
    wg = w.to(cuda).requires_grad_() if weighted else None
    out = swiglu(hg, wg)
    g = torch.randn(R, F_).to(dtype)
    out.backward(g.to(cuda))
    base = (F.silu(h[:, :F_]) * h[:, F_:] * (w[:, None].to(dtype) if weighted else 1)).to(dtype)
    assert_close_to_fp64(out.detach(), base, swiglu_reference(h.double(), None if w is None else w.double()),
                         "swiglu", floor=1e-2 if dtype != torch.float32 else 1e-5)
    dh64, dw64 = swiglu_bwd_reference(g.double(), h.double(), None if w is None else w.double(), weighted)
    dh_base, _ = swiglu_bwd_reference(g, h, w, False)
    assert_close_to_fp64(hg.grad, dh_base, dh64, "swiglu dh", floor=1e-2 if dtype != torch.float32 else 1e-5)
    if weighted:
        _, dw32 = swiglu_bwd_reference(g.float(), h.float(), w, True)
        assert_close_to_fp64(wg.grad, dw32, dw64, "swiglu dweights", floor=1e-3)


def test_misaligned_rows(cuda):
    # A view starting one element into storage: narrower vectors, same values.
    base = torch.randn(50 * 16 + 1, device=cuda, dtype=torch.bfloat16)
    h = base[1:].view(50, 16)
    torch.testing.assert_close(swiglu(h).float(), swiglu_reference(h.cpu()).float().to(cuda), rtol=1e-2, atol=1e-2)
