"""grouped_mm: CPU tier (reference against an independent formulation, autograd, opcheck, bad input)."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.grouped_mm import grouped_mm_dgrad_reference, grouped_mm_reference, grouped_mm_wgrad_reference


def masked_formulation(x, w, group_sizes):
    """Independent formulation: every row against every expert, keep the row's own expert."""
    M = x.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(len(group_sizes)), group_sizes.long(), output_size=None)
    expert_of_row = torch.cat([expert_of_row, torch.full((M - len(expert_of_row),), -1)])
    all_products = torch.einsum("mk,enk->emn", x.double(), w.double())  # [E, M, N]
    out = torch.zeros(M, w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        out[expert_of_row == e] = all_products[e][expert_of_row == e]
    return out


@pytest.mark.parametrize("sizes", [[3, 0, 5], [8], [0, 0, 4], [2, 2, 2, 2], [0], [1, 0, 0, 6, 0]])
def test_reference_matches_masked_formulation(sizes):
    torch.manual_seed(0)
    gs = torch.tensor(sizes, dtype=torch.int32)
    M = int(gs.sum()) + 2  # two rows past the groups
    x = torch.randn(M, 6, dtype=torch.float64)
    w = torch.randn(len(sizes), 5, 6, dtype=torch.float64)
    out = mk.grouped_mm(x, w, gs)
    n = int(gs.sum())
    torch.testing.assert_close(out[:n], masked_formulation(x, w, gs)[:n])


def test_gradients_and_empty_groups():
    torch.manual_seed(1)
    gs = torch.tensor([3, 0, 4], dtype=torch.int32)
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    out = mk.grouped_mm(x, w, gs)
    g = torch.randn_like(out)
    (out[:7] * g[:7]).sum().backward()
    assert torch.equal(w.grad[1], torch.zeros(5, 6)), "empty group: zero weight gradient"
    assert torch.equal(x.grad[7:], torch.zeros(2, 6)), "rows past the groups: zero gradient"
    torch.testing.assert_close(w.grad[0], g[:3].t() @ x[:3].detach())
    torch.testing.assert_close(x.grad[3:7], g[3:7] @ w[2].detach())
    assert torch.autograd.gradcheck(lambda x, w: mk.grouped_mm(x, w, gs)[:7], (x, w))


def test_dtypes_accumulate_in_fp32():
    torch.manual_seed(2)
    gs = torch.tensor([4, 4], dtype=torch.int32)
    x = torch.randn(8, 64).to(torch.bfloat16)
    w = torch.randn(2, 16, 64).to(torch.bfloat16)
    out = mk.grouped_mm(x, w, gs)
    assert out.dtype == torch.bfloat16
    expected = torch.cat([x[:4].float() @ w[0].float().t(), x[4:].float() @ w[1].float().t()]).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_backward_references_agree_with_autograd():
    torch.manual_seed(3)
    gs = torch.tensor([2, 5, 0, 1], dtype=torch.int32)
    x = torch.randn(8, 7, dtype=torch.float64)
    w = torch.randn(4, 3, 7, dtype=torch.float64)
    g = torch.randn(8, 3, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (masked_formulation(xr, wr, gs) * g).sum().backward()
    torch.testing.assert_close(grouped_mm_dgrad_reference(g, w, gs), xr.grad)
    torch.testing.assert_close(grouped_mm_wgrad_reference(g, x, gs), wr.grad)
    torch.testing.assert_close(grouped_mm_reference(x, w, gs), masked_formulation(x, w, gs))


def test_opcheck():
    gs = torch.tensor([3, 0, 2], dtype=torch.int32)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(3, 4, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_kernels.grouped_mm, (x, w, gs))
    g = torch.randn(6, 4)
    torch.library.opcheck(torch.ops.moe_kernels.grouped_mm_dgrad, (g, w.detach(), gs))
    torch.library.opcheck(torch.ops.moe_kernels.grouped_mm_wgrad, (g, x.detach(), gs))


def test_compile_fullgraph():
    gs = torch.tensor([3, 1], dtype=torch.int32)
    x = torch.randn(5, 8)
    w = torch.randn(2, 4, 8)
    f = torch.compile(lambda x, w: mk.grouped_mm(x, w, gs) * 2, fullgraph=True)
    torch.testing.assert_close(f(x, w)[:4], (mk.grouped_mm(x, w, gs) * 2)[:4])


def test_bad_input():
    x, w, gs = torch.randn(6, 8), torch.randn(3, 4, 8), torch.tensor([2, 2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="K="):
        mk.grouped_mm(x, torch.randn(3, 4, 7), gs)
    with pytest.raises(TypeError, match="`w`"):
        mk.grouped_mm(x, w.double(), gs)
    with pytest.raises(ValueError, match="group_sizes"):
        mk.grouped_mm(x, w, torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="group_sizes"):
        mk.grouped_mm(x, w, gs.long())
    with pytest.raises(ValueError, match="sums to 9"):
        mk.grouped_mm(x, w, torch.tensor([3, 3, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="negative"):
        mk.grouped_mm(x, w, torch.tensor([3, -1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        mk.grouped_mm(torch.randn(8, 6).t(), w, gs)
    with pytest.raises(ValueError, match="`w`"):
        mk.grouped_mm(x, torch.randn(4, 8), gs)
    for bad in (None, "x", 3):  # not a tensor: named by the op, not an AttributeError from the autocast step
        with pytest.raises((TypeError, RuntimeError), match="`x`|'x'"):
            mk.grouped_mm(bad, w, gs)


def test_autocast_casts_inputs_and_keeps_fp32_grads():
    x = torch.randn(8, 16)
    w = torch.randn(2, 4, 16, requires_grad=True)
    gs = torch.tensor([4, 4], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mk.grouped_mm(x, w, gs)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32
    expected = mk.grouped_mm(x.bfloat16(), w.detach().bfloat16(), gs)
    assert torch.equal(out, expected)


class _RecordingExt:
    """Stands in for the extension: records the pointers each entry point sees and, like the real one,
    sizes a larger workspace for 16-byte aligned pointers (the CUTLASS path) than for misaligned ones."""

    grouped_mm_max_groups = 1024

    def __init__(self):
        self.sized, self.launched = [], []

    def grouped_mm_workspace_bytes(self, *, a, b, d, **_):
        self.sized.append((a, b, d))
        return 1024 if all(p % 16 == 0 for p in (a, b, d)) else 256

    def grouped_mm(self, *, a, b, d, workspace_bytes, **_):
        self.launched.append((a, b, d))
        if workspace_bytes < (1024 if all(p % 16 == 0 for p in (a, b, d)) else 256):
            raise ValueError("grouped_mm: workspace too small")


class _EmptyViewAddress(torch.Tensor):
    """An empty view whose data_ptr() is its misaligned address, not 0 (torch builds differ on this)."""

    def data_ptr(self):
        return 4


def test_launch_sizes_and_runs_with_the_same_pointers(monkeypatch):
    # The workspace is sized for the path the launch will take: both see the same pointers, also for an
    # empty operand whose view is misaligned (data_ptr() says misaligned, the launch would pass 0).
    import sys

    from moe_kernels import _ext

    gm = sys.modules["moe_kernels.ops.grouped_mm"]  # the module (moe_kernels.ops.grouped_mm is the op)
    C = _RecordingExt()
    monkeypatch.setattr(_ext, "kernels", lambda op, t: C)
    a = torch.Tensor._make_subclass(_EmptyViewAddress, torch.empty(0, 8))
    b, d, gs = torch.empty(0, 16), torch.empty(2, 8, 16), torch.zeros(2, dtype=torch.int32)
    gm._launch("wgrad", a, b, d, gs, 0, 8, 16, C)
    assert C.sized == C.launched
    # M = 0: zeros for dw, before any launch.
    C.sized.clear(), C.launched.clear()
    dw = gm._grouped_mm_wgrad_cuda(torch.empty(0, 8), b, gs)
    assert dw.shape == (2, 8, 16) and bool((dw == 0).all()) and not C.launched and not C.sized
