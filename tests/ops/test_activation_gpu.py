"""swiglu: GPU tier against fp64 (policy: error <= 2x torch's at the same precision). squared_relu: bit for bit
torch's relu then square on the same device, forward and backward (both round the fp32 product once)."""

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.ops import squared_relu, swiglu
from moe_kernels.ops.activation import squared_relu_bwd_reference, squared_relu_reference, swiglu_bwd_reference, \
    swiglu_reference
from moe_kernels.testing import assert_close_to_fp64, assert_exact
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


# The backward writing the forward's output again (the fused regions' backward takes the activation from there, not
# from the forward): the forward kernel's output, bit for bit but for NaN payloads, the backward's own outputs
# unchanged by it.

def _launch(t):
    from moe_kernels import _ext

    L = _ext.eager(t)
    if L is None:
        pytest.skip("the extension does not serve this device")
    return L


def _ptr(t):
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


@pytest.mark.parametrize("R,F_,offset", [(0, 8, 0), (1, 1, 0), (37, 3, 0), (300, 768, 0), (64, 1000, 0), (50, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_backward_writes_the_forward_again(cuda, R, F_, offset, dtype, weighted):
    from moe_kernels import _ext

    g = torch.Generator().manual_seed(R * 7 + F_)

    def make(*shape, scale=1.0):
        # offset 1: one element into its storage (the narrowest vectors)
        base = (scale * torch.randn(int(torch.tensor(shape).prod()) + offset, generator=g)).to(cuda, dtype)
        return base[offset:].view(shape)

    h, dout = _with_edges(make(R, 2 * F_), R), make(R, F_)
    w = torch.rand(R, generator=g).to(cuda) if weighted else None
    L, dt = _launch(h), _ext.dtype_code(dtype)
    want = make(R, F_)
    L.C.swiglu_fwd(_ptr(h), _ptr(w), _ptr(want), R, F_, dt, L.device, L.stream)
    outs = {}
    for act in (False, True):
        dh, dw, a = make(R, 2 * F_), torch.empty(R, device=cuda), make(R, F_)
        L.C.swiglu_bwd(_ptr(dout), _ptr(h), _ptr(w), _ptr(dh), _ptr(dw), R, F_, dt, L.device, L.stream,
                       act=_ptr(a) if act else 0)
        outs[act] = (dh, dw, a)
    # Equal values, a NaN equal to any NaN (the edges make some: which operand's NaN a product passes on, and so its
    # sign, is the compiler's choice, as in any two kernels)
    assert_exact(outs[True][2], want, "the activation again")
    assert_exact(outs[True][0], outs[False][0], "dh")
    assert_exact(outs[True][1], outs[False][1], "drow_weights")


@pytest.mark.parametrize("n,offset", [(0, 0), (1, 0), (37 * 3, 0), (300 * 768, 0), (7 * 1001, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_squared_relu_backward_writes_the_forward_again(cuda, n, offset, dtype):
    from moe_kernels import _ext

    g = torch.Generator().manual_seed(n + offset)

    def make():
        return torch.randn(n + offset, generator=g).to(cuda, dtype)[offset:]

    h, dout = _with_edges(make(), n), make()
    L, dt = _launch(h), _ext.dtype_code(dtype)
    want = make()
    L.C.squared_relu_fwd(_ptr(h), _ptr(want), n, dt, L.device, L.stream)
    dh, dh_alone, a = make(), make(), make()
    L.C.squared_relu_bwd(_ptr(dout), _ptr(h), _ptr(dh), n, dt, L.device, L.stream, act=_ptr(a))
    L.C.squared_relu_bwd(_ptr(dout), _ptr(h), _ptr(dh_alone), n, dt, L.device, L.stream)
    assert_exact(a, want, "the activation again")
    assert_exact(dh, dh_alone, "dh")
