"""permute / unpermute / tokens_per_expert: GPU tier, CUDA kernels against the CPU references."""

import itertools

import pytest
import torch

import moe_kernels as mk
from moe_kernels._ext import reference_ops
from moe_kernels.ops.permute import (
    permute_reference,
    permuted_rows,
    tokens_per_expert_reference,
    unpermute_bwd_reference,
    unpermute_reference,
)
from moe_kernels.testing import assert_exact, assert_within_fp32_rounding, random_routing
from tests.emulation import EMULATED, skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**22  # permuted elements per case (the copy runs a fiber per 16-byte vector lane)

# (T, E, k): T in {0, 1, 7, 4096}, E in {1, 8, 256}, k in {1, 2, 8}.
CASES = [
    (T, E, k)
    for T, (E, k) in itertools.product((0, 1, 7, 4096), ((1, 1), (1, 8), (8, 1), (8, 2), (256, 8), (8, 8)))
]
# Odd H, H not a multiple of 8, and a 16-byte multiple; the full deepseek-v3 width has its own case.
HIDDEN = (129, 100, 1032)


def _hidden(T, E, k):
    return HIDDEN[(T + E + k) % len(HIDDEN)]


def _run_and_compare(dev, x, idx, E, align, weights):
    """permute + weighted unpermute, forward and backward, on `dev` against the CPU reference."""
    T, k = idx.shape
    ref_perm, ref_map, ref_sizes = permute_reference(x, idx, E, align)
    xg = x.to(dev, copy=True).requires_grad_()
    wg = weights.to(dev, copy=True).requires_grad_()
    x_perm, row_map, sizes = mk.permute(xg, idx.to(dev), E, align=align)
    n = int(ref_sizes.sum())
    assert x_perm.shape[0] == permuted_rows(T, k, E, align)
    assert_exact(row_map.cpu(), ref_map, "row_map")
    assert_exact(sizes.cpu(), ref_sizes, "group_sizes")
    assert_exact(x_perm[:n].detach().cpu(), ref_perm[:n], "x_perm")
    assert_exact(mk.tokens_per_expert(idx.to(dev), E).cpu(), tokens_per_expert_reference(idx, E), "tokens_per_expert")

    out = mk.unpermute(x_perm, row_map, wg)
    assert_exact(out.detach().cpu(), unpermute_reference(ref_perm, ref_map, weights), "unpermute")
    assert_exact(mk.unpermute(x_perm, row_map).detach().cpu(), unpermute_reference(ref_perm, ref_map), "unpermute (no weights)")

    dout = torch.randn(x.shape, dtype=x.dtype)
    out.backward(dout.to(dev))
    # CPU autograd through the references for the expected gradients.
    xc, wc = x.clone().requires_grad_(), weights.clone().requires_grad_()
    with reference_ops():
        pc, mc, _ = mk.permute(xc, idx, E, align=align)
        mk.unpermute(pc, mc, wc).backward(dout)
    assert_exact(xg.grad.cpu(), xc.grad, "dx")
    rows = ref_map.long().clamp(min=0)
    magnitude = (ref_perm[rows].float() * dout[:, None, :].float()).abs().sum(-1) * (ref_map >= 0)
    assert_within_fp32_rounding(wg.grad.cpu(), wc.grad, magnitude, "dweights")


@pytest.mark.parametrize("T,E,k", CASES)
@pytest.mark.parametrize("align", [1, 16, 128])
def test_matches_reference(cuda, T, E, k, align):
    H = _hidden(T, E, k)
    skip_if_too_large(T * k * H, EMULATION_BUDGET, "permuted elements")
    gen = torch.Generator().manual_seed(T * 131 + E * 7 + k)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = random_routing(T, E, k, kind="uniform", drop=0.05, seed=T + E + k)
    _run_and_compare(cuda, x, idx, E, align, torch.rand(T, k, generator=gen))


@pytest.mark.parametrize("kind", ["hot", "empty", "zipf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_skewed_routing_and_dtypes(cuda, kind, dtype):
    T, E, k, H = 777, 64, 4, 264
    x = torch.randn(T, H).to(dtype)
    idx = random_routing(T, E, k, kind=kind, drop=0.1, seed=11)
    _run_and_compare(cuda, x, idx, E, 16, torch.rand(T, k))


def test_deepseek_width(cuda):
    T, E, k, H = 300, 256, 8, 7168
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = random_routing(T, E, k, kind="zipf", seed=12)
    _run_and_compare(cuda, x, idx, E, 128, torch.rand(T, k))


@pytest.mark.parametrize("H", [1, 3, 7, 17])
def test_tiny_and_odd_rows(cuda, H):
    x = torch.randn(50, H).to(torch.bfloat16)
    idx = random_routing(50, 5, 3, drop=0.2, seed=H)
    _run_and_compare(cuda, x, idx, 5, 4, torch.rand(50, 3))


def test_misaligned_base_pointer(cuda):
    # A view starting one element into its storage: 16-byte vectors are impossible, narrower ones are used.
    T, H, E, k = 64, 128, 8, 2
    base = torch.randn(T * H + 1).to(torch.bfloat16).to(cuda)
    x = base[1:].view(T, H)
    idx = random_routing(T, E, k, seed=13)
    ref_perm, ref_map, ref_sizes = permute_reference(x.cpu(), idx, E, 1)
    x_perm, row_map, _ = mk.permute(x, idx.to(cuda), E)
    assert_exact(x_perm.cpu(), ref_perm, "x_perm")
    y = torch.randn(T * k * H + 1).to(torch.bfloat16).to(cuda)[1:].view(T * k, H)
    assert_exact(mk.unpermute(y, row_map).cpu(), unpermute_reference(y.cpu(), ref_map), "unpermute")


def test_low_precision_payload(cuda):
    T, H, E, k = 200, 96, 16, 4
    x = (torch.randn(T, H) * 8).to(torch.float8_e4m3fn)
    idx = random_routing(T, E, k, seed=14)
    ref_perm, ref_map, ref_sizes = permute_reference(x.view(torch.uint8), idx, E, 128)
    x_perm, row_map, sizes = mk.permute(x.to(cuda), idx.to(cuda), E, align=128)
    n = int(ref_sizes.sum())
    assert x_perm.dtype == torch.float8_e4m3fn
    assert_exact(x_perm[:n].view(torch.uint8).cpu(), ref_perm[:n], "fp8 x_perm")
    assert_exact(row_map.cpu(), ref_map, "row_map")


def test_deterministic(cuda):
    T, E, k, H = 2048, 32, 8, 520
    x = torch.randn(T, H, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(T, k, device=cuda, requires_grad=True)
    idx = random_routing(T, E, k, kind="zipf", seed=15).to(cuda)
    dout = torch.randn(T, H, device=cuda, dtype=torch.bfloat16)
    results = []
    for _ in range(3):
        x.grad = w.grad = None
        x_perm, row_map, _ = mk.permute(x, idx, E, align=16)
        out = mk.unpermute(x_perm * 1.25, row_map, w)
        out.backward(dout)
        results.append((out.detach().clone(), x.grad.clone(), w.grad.clone()))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


def test_out_of_range_indices_are_dropped(cuda):
    T, E, k, H = 40, 6, 3, 64
    idx = random_routing(T, E, k, seed=16)
    idx[3, 1], idx[7, 0], idx[9, 2] = 6, 1000, -7
    clean = idx.clone()
    clean[(clean < -1) | (clean >= E)] = -1
    x = torch.randn(T, H).to(torch.bfloat16)
    ref_perm, ref_map, ref_sizes = permute_reference(x, clean, E, 1)
    if cuda.type != "cuda" and not EMULATED:
        pytest.skip("the CPU references raise instead (tested in the CPU tier)")
    x_perm, row_map, sizes = mk.permute(x.to(cuda), idx.to(cuda), E)
    assert_exact(row_map.cpu(), ref_map, "row_map")
    assert_exact(sizes.cpu(), ref_sizes, "group_sizes")
    assert_exact(x_perm[: int(ref_sizes.sum())].cpu(), ref_perm[: int(ref_sizes.sum())], "x_perm")
    assert_exact(mk.tokens_per_expert(idx.to(cuda), E).cpu(), tokens_per_expert_reference(clean, E), "counts")


def test_checking_mode_raises(cuda, checks_on):
    idx = torch.tensor([[0, 5]], dtype=torch.int32, device=cuda)
    with pytest.raises(ValueError, match="outside"):
        mk.permute(torch.randn(1, 8, device=cuda), idx, 4)
    with pytest.raises(ValueError, match="outside"):
        mk.tokens_per_expert(idx, 4)
    with pytest.raises(ValueError, match="outside"):
        mk.unpermute(torch.randn(2, 8, device=cuda), torch.tensor([[0, 2]], dtype=torch.int32, device=cuda))


@pytest.mark.cuda_device
def test_bad_input_on_gpu(cuda):
    x = torch.randn(4, 8, device=cuda)
    idx = torch.zeros(4, 2, dtype=torch.int32, device=cuda)
    with pytest.raises(ValueError, match="indices"):
        mk.permute(x, idx.cpu(), 4)
    with pytest.raises(TypeError, match="fp64"):
        mk.permute(x.double(), idx, 4)
    with pytest.raises(TypeError, match="fp64"):
        mk.unpermute(x.double(), idx)
    with pytest.raises(ValueError, match="num_experts"):
        mk.permute(x, idx, 100_000)
    with pytest.raises(ValueError, match="weights"):
        mk.unpermute(x, idx, torch.rand(4, 2))


@pytest.mark.cuda_device
def test_cuda_graph_replay(cuda):
    T, E, k, H = 512, 16, 4, 256
    x = torch.randn(T, H, device=cuda, dtype=torch.bfloat16)
    idx = random_routing(T, E, k, seed=17).to(cuda)
    w = torch.rand(T, k, device=cuda)

    def step():
        x_perm, row_map, _ = mk.permute(x, idx, E, align=16)
        return mk.unpermute(x_perm, row_map, w)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    idx.copy_(random_routing(T, E, k, kind="zipf", seed=18).to(cuda))
    graph.replay()
    torch.cuda.synchronize()
    assert_exact(out.cpu(), step().cpu(), "graph replay")


@pytest.mark.slow
@pytest.mark.gpu_memory
@pytest.mark.cuda_device
def test_past_2_31_elements(cuda):
    # T*k*H = 32768 * 8 * 8200 > 2^31: 64-bit offsets in every kernel. Checked on the device in chunks
    # (~10 GB of device memory; emulated: test_rows_past_2_31_bytes_emulated).
    T, E, k, H = 32768, 64, 8, 8200
    assert T * k * H > 2**31
    x = torch.randn(T, H, device=cuda, dtype=torch.bfloat16)
    idx = random_routing(T, E, k, seed=19).to(cuda)
    x_perm, row_map, sizes = mk.permute(x, idx, E)
    assert int(sizes.sum()) == T * k
    for t0 in range(0, T, 4096):
        rows = row_map[t0 : t0 + 4096].long()
        assert torch.equal(x_perm[rows.flatten()].view(-1, k, H), x[t0 : t0 + 4096, None, :].expand(-1, k, -1))
    out = mk.unpermute(x_perm, row_map)  # eight equal copies: 8 * x is exact in bf16
    assert torch.equal(out, x * 8)
    del out
    x_perm.requires_grad_()
    dx_perm = torch.autograd.grad(mk.unpermute(x_perm, row_map).float().sum(), x_perm)[0]
    assert bool((dx_perm[: T * k] == 1).all())


@pytest.mark.slow
def test_rows_past_2_31_bytes_emulated(cuda):
    # Three rows of 2^30 bytes: the last starts at byte 2^31, where a 32-bit row offset wraps. The
    # emulated counterpart of test_past_2_31_elements (3.2e9 elements, about 7 GB of host memory).
    if not EMULATED:
        pytest.skip("on a GPU, test_past_2_31_elements covers 64-bit offsets")
    H = 2**30
    x = torch.empty((3, H), dtype=torch.uint8)
    marks = torch.randint(0, 256, (3, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(20))
    for r in range(3):
        x[r].fill_(r + 1)
        x[r, H // 2 : H // 2 + 4096] = marks[r]
    idx = torch.tensor([[0], [1], [1]], dtype=torch.int32)  # rows 0, 1, 2 of x_perm
    x_perm, row_map, sizes = mk.permute(x, idx, 2)
    assert_exact(row_map, torch.tensor([[0], [1], [2]], dtype=torch.int32), "row_map")
    assert_exact(sizes, torch.tensor([1, 2], dtype=torch.int32), "group_sizes")
    assert torch.equal(x_perm, x)


# ---------------------------------------------------------------------------------------------------
# unpermute's backward kernel on its own: dy [R, H] and dweights [T, k] against unpermute_bwd_reference,
# on fresh random inputs. dy is pre-filled with NaN, so a row the kernel forgets (a padding or tail row it
# must zero) or a row it zeroes after a slot wrote it shows up; every row of dy is compared.


def _unpermute_bwd_kernel(dev, dout, row_map, weights, y, num_rows, dy_offset=0):
    """The extension's unpermute_bwd on `dev`, dy pre-filled with NaN (starting `dy_offset` elements into
    its buffer: a misaligned dy). Returns (dy, dweights) on the CPU."""
    from moe_kernels import _ext

    dout, row_map = dout.to(dev), row_map.to(dev)
    w = None if weights is None else weights.to(dev).float().contiguous()
    y = None if y is None else y.to(dev)
    C = _ext.kernels("unpermute", dout)
    if C is None:
        pytest.skip("no kernels for this device")
    H = dout.shape[1]
    dy = torch.full((num_rows * H + dy_offset,), float("nan"), dtype=dout.dtype, device=dev)[dy_offset:].view(num_rows, H)
    T, k = row_map.shape
    dweights = torch.full((T, k) if y is not None else (0,), float("nan"), dtype=torch.float32, device=dev)
    row_mask = torch.zeros((num_rows,), dtype=torch.uint8, device=dev)
    C.unpermute_bwd(
        dout=_ext.ptr(dout), y=_ext.ptr(y), row_map=_ext.ptr(row_map), weights=_ext.ptr(w), dy=_ext.ptr(dy),
        dweights=_ext.ptr(dweights), row_mask=_ext.ptr(row_mask), num_tokens=T, k=k, hidden=H,
        num_rows=num_rows, dtype=_ext.dtype_code(dout.dtype), **_ext.launch_args(dout),
    )
    return dy.cpu(), dweights.cpu()


def _check_unpermute_bwd(dev, T, E, k, H, *, align=1, kind="uniform", drop=0.0, dtype=torch.bfloat16, with_y=True,
                         with_weights=True, offsets=(0, 0, 0), seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = random_routing(T, E, k, kind=kind, drop=drop, seed=seed)
    _, row_map, _ = permute_reference(torch.zeros(T, 1), idx, E, align)
    R = permuted_rows(T, k, E, align)

    def buf(n, off):  # a [n, H] tensor starting `off` elements into its storage
        return torch.randn(n * H + off, generator=gen).to(dtype)[off:].view(n, H)

    dout, y = buf(T, offsets[0]), buf(R, offsets[1])
    weights = torch.rand(T, k, generator=gen) if with_weights else None
    y_arg = y if with_y and with_weights else None
    dy, dw = _unpermute_bwd_kernel(dev, dout, row_map, weights, y_arg, R, dy_offset=offsets[2])
    ref_dy, ref_dw = unpermute_bwd_reference(dout, row_map, weights, y_arg, R)
    assert_exact(dy, ref_dy, "dy")
    if y_arg is None:
        assert dw.numel() == 0
        return
    _, magnitude = unpermute_bwd_reference(dout.abs(), row_map, weights, y.abs(), R)
    assert_within_fp32_rounding(dw, ref_dw, magnitude, "dweights")


@pytest.mark.parametrize("drop", [0.0, 0.3])
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("H", [1, 7, 100, 129, 264, 1032])
def test_unpermute_bwd_kernel(cuda, H, align, drop):
    # H=1..129: 1-, 2- and 4-element vectors and groups of 1 to 32 threads; 264 and 1032: 16-byte vectors,
    # 33 and 129 of them (groups of 16 and 64 threads). Without drops and align 1 every row is written.
    _check_unpermute_bwd(cuda, 37, 8, 4, H, align=align, drop=drop, seed=H + 7 * align + int(10 * drop))


@pytest.mark.parametrize("k", [1, 3, 8, 9, 17])
def test_unpermute_bwd_kernel_slots(cuda, k):
    # k past one batch of 8 slots: several passes over the row, each with its own reduction (and, in groups
    # wider than a warp (H=2056: 257 vectors, 128 threads), alternating halves of the shared scratch).
    _check_unpermute_bwd(cuda, 6, 32, k, 2056, drop=0.1, seed=k)
    _check_unpermute_bwd(cuda, 11, 32, k, 72, drop=0.1, seed=k + 1)


@pytest.mark.parametrize("kind", ["hot", "empty", "zipf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unpermute_bwd_kernel_routing_and_dtypes(cuda, kind, dtype):
    _check_unpermute_bwd(cuda, 29, 16, 4, 136, align=8, kind=kind, drop=0.1, dtype=dtype, seed=3)


@pytest.mark.parametrize("with_y,with_weights", [(False, True), (False, False)])
def test_unpermute_bwd_kernel_without_dweights(cuda, with_y, with_weights):
    # No dweights: the kernel reads no y and takes 4 vectors per thread per pass.
    _check_unpermute_bwd(cuda, 23, 8, 3, 1032, align=4, drop=0.2, with_y=with_y, with_weights=with_weights, seed=5)
    _check_unpermute_bwd(cuda, 23, 8, 3, 9, drop=0.2, with_y=with_y, with_weights=with_weights, seed=6)


@pytest.mark.parametrize("offsets", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (2, 0, 4)])
def test_unpermute_bwd_kernel_misaligned(cuda, offsets):
    # One misaligned pointer among dout, y and dy narrows every access of the launch.
    _check_unpermute_bwd(cuda, 19, 8, 2, 1032, align=4, drop=0.1, offsets=offsets, seed=8)


def test_unpermute_bwd_kernel_empty(cuda):
    # 0 tokens: every row of dy is a padding row (zero); no rows: every slot is dropped (dweights zero).
    H = 40
    dy, dw = _unpermute_bwd_kernel(cuda, torch.randn(0, H).to(torch.bfloat16), torch.zeros(0, 2, dtype=torch.int32),
                                   torch.rand(0, 2), torch.randn(5, H).to(torch.bfloat16), 5)
    assert_exact(dy, torch.zeros(5, H, dtype=torch.bfloat16), "dy, 0 tokens")
    assert dw.shape == (0, 2)
    row_map = torch.full((3, 2), -1, dtype=torch.int32)
    dy, dw = _unpermute_bwd_kernel(cuda, torch.randn(3, H).to(torch.bfloat16), row_map, torch.rand(3, 2),
                                   torch.randn(0, H).to(torch.bfloat16), 0)
    assert dy.shape == (0, H)
    assert_exact(dw, torch.zeros(3, 2), "dweights, every slot dropped")


def test_unpermute_bwd_op_matches_reference(cuda):
    # Through the registered op and autograd: dy and dweights of unpermute, with drops and padding.
    T, E, k, H = 45, 8, 8, 520
    idx = random_routing(T, E, k, kind="zipf", drop=0.15, seed=21)
    x = torch.randn(T, H).to(torch.bfloat16)
    x_perm, row_map, _ = permute_reference(x, idx, E, 16)
    y = torch.randn(x_perm.shape).to(torch.bfloat16)
    w, dout = torch.rand(T, k), torch.randn(T, H).to(torch.bfloat16)
    yg, wg = y.to(cuda).requires_grad_(), w.to(cuda).requires_grad_()
    mk.unpermute(yg, row_map.to(cuda), wg).backward(dout.to(cuda))
    ref_dy, ref_dw = unpermute_bwd_reference(dout, row_map, w, y, y.shape[0])
    _, magnitude = unpermute_bwd_reference(dout.abs(), row_map, w, y.abs(), y.shape[0])
    assert_exact(yg.grad.cpu(), ref_dy, "dy")
    assert_within_fp32_rounding(wg.grad.cpu(), ref_dw, magnitude, "dweights")
