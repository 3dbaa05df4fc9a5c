"""swiglu: GPU tier against fp64 (policy: error <= 2x torch's at the same precision). squared_relu: bit for bit
torch's relu then square on the same device, forward and backward (both round the fp32 product once)."""

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.ops import squared_relu, swiglu
from moe_kernels.ops.activation import squared_relu_bwd_reference, squared_relu_reference, swiglu_bwd_reference, \
    swiglu_reference
from moe_kernels.testing import assert_close_to_fp64
from tests.emulation import EMULATED, skip_if_too_large

EMULATION_BUDGET = 2e7  # squared_relu: elements per case

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


def _with_edges(t: torch.Tensor, seed: int) -> torch.Tensor:
    """t with zeros of both signs, NaN, infinities and values whose square (300) or double (40000) overflows fp16 at
    random places."""
    edges = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 300.0, -300.0, 1e-30, 40000.0]).to(
        t.dtype)
    flat = t.flatten().clone()
    if flat.numel():
        g = torch.Generator().manual_seed(seed)
        at = torch.randint(0, flat.numel(), (min(flat.numel(), 64),), generator=g)
        flat[at] = edges[torch.randint(0, len(edges), (len(at),), generator=g)]
    return flat.view(t.shape)


@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (37, 3), (1000, 768), (300, 2048), (7, 1001), (2, 3, 5)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_squared_relu_is_torchs_bit_for_bit(cuda, shape, dtype):
    h = _with_edges(torch.randn(shape).to(dtype), seed=1)
    dout = _with_edges(torch.randn(shape).to(dtype), seed=2)
    hg = h.to(cuda).requires_grad_()
    out = squared_relu(hg)
    (dh,) = torch.autograd.grad(out, hg, dout.to(cuda))
    # torch's own composition on the same device, and the CPU reference
    h_ref = h.to(cuda).requires_grad_()
    ref = torch.square(torch.relu(h_ref))
    (dh_ref,) = torch.autograd.grad(ref, h_ref, dout.to(cuda))
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dh, dh_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out.cpu(), squared_relu_reference(h), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dh.cpu(), squared_relu_bwd_reference(dout, h), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_squared_relu_misaligned(cuda, offset):
    # bf16 views starting 0, 1, 2 and 4 elements into their storage, of a length divisible by 8: vectors of 16, 2, 4
    # and 8 bytes (the widest that every pointer's alignment and the length allow).
    n = 4096 * 8
    base = torch.randn(n + offset, device=cuda, dtype=torch.bfloat16)
    _assert_squared_relu_is_torchs(base[offset:])


@pytest.mark.parametrize(("dtype", "extra"), [(torch.bfloat16, 24), (torch.float32, 3)], ids=["bf16-x8", "fp32-x1"])
def test_squared_relu_grid_stride(cuda, dtype, extra):
    # More vectors than the kernel's grid holds threads (8192 blocks of 256): the grid-stride loop's later rounds,
    # with 8-element vectors (bf16, a length divisible by 8) and single elements (an odd length).
    n = 8192 * 256 * (8 if dtype == torch.bfloat16 else 1) + extra
    skip_if_too_large(n, EMULATION_BUDGET, "elements")
    _assert_squared_relu_is_torchs(torch.randn(n, device=cuda, dtype=dtype))


def _assert_squared_relu_is_torchs(h: torch.Tensor) -> None:
    """squared_relu(h) and its gradient for a random dout equal torch's relu then square, bit for bit."""
    dout = torch.randn_like(h)
    hg = h.detach().requires_grad_()
    out = squared_relu(hg)
    (dh,) = torch.autograd.grad(out, hg, dout)
    assert torch.equal(out, torch.square(torch.relu(h)))
    assert torch.equal(dh, squared_relu_bwd_reference(dout, h))


@pytest.mark.slow
@pytest.mark.gpu_memory
@pytest.mark.cuda_device
def test_squared_relu_past_2_31_elements(cuda):
    # 2^31 + 1 bf16 elements (4 GB each way), an odd length: single-element vectors, so the vector index itself
    # passes 2^31 (64-bit indices); checked against torch in chunks.
    if EMULATED:
        pytest.skip("not emulated: 2^31 elements")
    n = 2**31 + 1
    h = torch.randn(n, device=cuda, dtype=torch.bfloat16)
    out = squared_relu(h)
    chunk = 2**28
    for i in range(0, n, chunk):
        assert torch.equal(out[i : i + chunk], torch.square(torch.relu(h[i : i + chunk]))), i
    del out
    dh = torch.ops.moe_kernels.squared_relu_bwd(h, h)  # dout = h: 2 relu(h) h
    for i in range(0, n, chunk):
        assert torch.equal(dh[i : i + chunk], squared_relu_bwd_reference(h[i : i + chunk], h[i : i + chunk])), i
