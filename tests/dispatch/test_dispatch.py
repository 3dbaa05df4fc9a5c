"""Dispatchers on P gloo ranks against the one-rank computation (specs/dispatch.md).

Every rank routes its own tokens; the experts are a row-wise function of (row, global expert), so the
one-rank result is computed exactly on each rank from its own tokens. all_to_all must equal it bit for
bit (forward and gradients), all_gather within fp32 rounding; both must be bit-identical run to run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_kernels.dispatch import AllGatherDispatcher, AllToAllDispatcher, LocalDispatcher, make_dispatcher
from moe_kernels.ops.permute import tokens_per_expert
from tests.distributed import run_world

pytestmark = pytest.mark.distributed

BACKENDS = {"all_to_all": AllToAllDispatcher, "all_gather": AllGatherDispatcher}


def _expert_fn(x, local_indices, first_expert, scale, shift, row_weights=None):
    """Row-wise experts: y = x * scale[e] + shift[e] (e the global expert), times the row weight."""
    e = (local_indices.long() + first_expert).clamp(min=0)
    y = x * scale[e, None].to(x.dtype) + shift[e, None].to(x.dtype)
    return y if row_weights is None else y * row_weights[:, None].to(x.dtype)


def _routing(case: str, T: int, k: int, E: int, P: int, gen: torch.Generator) -> torch.Tensor:
    if case == "uniform":  # distinct experts per token, some dropped slots
        idx = torch.rand(T, E, generator=gen).argsort(1)[:, :k].int()
        return torch.where(torch.rand(T, k, generator=gen) < 0.15, -1, idx).int()
    if case == "hot":  # every slot to the last expert (one rank receives everything)
        return torch.full((T, k), E - 1, dtype=torch.int32)
    if case == "one_rank":  # all traffic to rank 0's experts, so the other ranks' experts stay empty
        return torch.randint(0, E // P, (T, k), generator=gen, dtype=torch.int32)
    if case == "dropped":
        return torch.full((T, k), -1, dtype=torch.int32)
    raise ValueError(case)


def _one_case(rank, P, backend, case, T, H, k, E, align, dtype, weighted):
    gen = torch.Generator().manual_seed(1000 * rank + T + H)
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
    indices = _routing(case, T, k, E, P, gen)
    weights = torch.rand(T, k, generator=gen).requires_grad_()
    gout = torch.randn(T, H, generator=gen).to(dtype)
    scale = torch.linspace(0.5, 2.0, E)  # the same on every rank
    shift = torch.linspace(-1.0, 1.0, E)

    def run(disp):
        d = disp.dispatch(x, weights, indices, align=align)
        y = _expert_fn(d.x, d.local_indices, disp.first_expert, scale, shift, None if weighted else d.weights)
        out = disp.combine(y, d.handle, weighted=weighted)
        dx, dw = torch.autograd.grad((out.float() * gout.float()).sum(), (x, weights), allow_unused=True)
        return d, out, dx, torch.zeros_like(weights) if dw is None else dw

    d, out, dx, dw = run(make_dispatcher(backend, E))
    _, ref, rdx, rdw = run(LocalDispatcher(E))
    where = f"rank {rank}: {backend} {case} T={T} H={H} k={k} E={E} align={align} {dtype} weighted={weighted}"
    assert out.dtype == x.dtype and out.shape == (T, H), where
    if backend == "all_to_all":  # the same sums in the same order: bit-exact
        for got, want in ((out, ref), (dx, rdx), (dw, rdw)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
    else:  # per-rank partial sums, then across ranks: within fp32 rounding, then one rounding to dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        for got, want in ((out, ref), (dx, rdx), (dw, rdw)):
            torch.testing.assert_close(got.float(), want.float(), **tol, msg=where)

    # The local experts' rows: group sizes are the padded counts of every rank's pairs for them.
    all_idx = [torch.empty(0)] * P
    dist.all_gather_object(all_idx, indices)
    counts = tokens_per_expert(torch.cat([i.reshape(-1, 1) for i in all_idx]), E)
    El = E // P
    mine = counts[rank * El : (rank + 1) * El]
    assert torch.equal(d.group_sizes, ((mine + align - 1) // align * align).int()), where
    starts = torch.cumsum(d.group_sizes, 0) - d.group_sizes
    for e in range(El):  # real rows carry their expert, padding rows -1 and weight 0
        rows = slice(int(starts[e]), int(starts[e]) + int(d.group_sizes[e]))
        n = int(mine[e])
        assert torch.all(d.local_indices[rows][:n] == e) and torch.all(d.local_indices[rows][n:] == -1), where
        assert torch.all(d.weights[rows][n:] == 0) and torch.all(d.x[rows][n:] == 0), where

    # Run to run: bit-identical.
    _, out2, dx2, dw2 = run(make_dispatcher(backend, E))
    for a, b in ((out, out2), (dx, dx2), (dw, dw2)):
        assert torch.equal(a, b), where


def _worker_dispatch(rank, P, backend):
    E = 4 * P
    T_of_rank = [0, 1, 7, 33][rank % 4] if P > 2 else [5, 0][rank]  # uneven, with an empty rank
    for case in ("uniform", "hot", "one_rank", "dropped"):
        for k, H, align, dtype, weighted in (
            (2, 13, 1, torch.float32, True),
            (4, 16, 16, torch.bfloat16, True),
            (3, 5, 1, torch.float32, False),
        ):
            _one_case(rank, P, backend, case, T_of_rank, H, k, E, align, dtype, weighted)
    _one_case(rank, P, backend, "uniform", 64 + rank, 24, 8, E, 8, torch.float32, True)  # k = 8


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_dispatcher_equals_one_rank(backend, world_size):
    run_world(_worker_dispatch, world_size, backend)


def _worker_bad_input(rank, P):
    disp = AllToAllDispatcher(4 * P)
    x, w, i = torch.randn(3, 8), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_experts=3 must be a multiple"):
        AllGatherDispatcher(3)
    with pytest.raises(ValueError, match="`weights` and `indices` \\[T, k\\]"):
        disp.dispatch(x, w[:2], i[:2])
    with pytest.raises(ValueError, match="`x`"):
        disp.dispatch(x[None], w, i)
    with pytest.raises(TypeError, match="`indices`"):
        disp.dispatch(x, w, i.float())
    with pytest.raises(ValueError, match="align"):
        disp.dispatch(x, w, i, align=0)


def test_dispatcher_bad_input():
    run_world(_worker_bad_input, 2)


def test_make_dispatcher_names_the_backends():
    with pytest.raises(ValueError, match="backend must be one of \\['all_gather', 'all_to_all', 'nvlink'\\]"):
        make_dispatcher("nccl", 8)
    with pytest.raises(ValueError, match="backend='nvlink' needs max_tokens_per_rank"):
        make_dispatcher("nvlink", 8)
    with pytest.raises(ValueError, match="size the nvlink backend's buffers; backend='all_to_all' takes none"):
        make_dispatcher("all_to_all", 8, max_tokens_per_rank=16)
    with pytest.raises(TypeError, match="unknown options \\['max_tokens'\\]"):
        make_dispatcher("nvlink", 8, max_tokens=16)


def _worker_nvlink_refuses_cpu(rank, P):
    # The nvlink backend writes into other GPUs' memory: on CPU tensors (gloo) it refuses before any
    # kernel or collective, naming the backend that works there; the torch.distributed ones still do.
    from moe_kernels.models import build_model
    from moe_kernels.models.presets import tiny_mixtral
    from moe_kernels.parallel import apply_expert_parallel

    E = 4 * P
    disp = make_dispatcher("nvlink", E, max_tokens_per_rank=8)
    x, w = torch.randn(3, 8), torch.rand(3, 2)
    i = torch.randint(0, E, (3, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensors.*backend='all_to_all'"):
        disp.dispatch(x, w, i)
    with pytest.raises(ValueError, match="max_tokens_per_rank` must be >= 1"):
        make_dispatcher("nvlink", E, max_tokens_per_rank=0)
    torch.manual_seed(0)
    model = apply_expert_parallel(build_model(tiny_mixtral(num_experts=E)), backend="nvlink", max_tokens_per_rank=64)
    with pytest.raises(ValueError, match="backend='all_to_all'"):
        model(torch.randint(0, 256, (2, 8)))


def test_nvlink_refuses_cpu_tensors_naming_all_to_all():
    run_world(_worker_nvlink_refuses_cpu, 2)


def _worker_fp8_payload(rank, P, backend):
    # FP8 codes and their block scales travel together: the received payload is exactly the quantized
    # received rows (quantization is per row), and padding rows dequantize to zeros.
    from moe_kernels.ops.quant import dequantize_fp8, quantize_fp8

    E = 4 * P
    for case, T, align in (("uniform", 9 + 4 * rank, 16), ("hot", 5, 1), ("uniform", 0 if rank else 6, 8)):
        gen = torch.Generator().manual_seed(rank + T)
        x = torch.randn(T, 200, generator=gen)  # two 1x128 blocks, the second partial
        indices = _routing(case, T, 3, E, P, gen)
        weights = torch.rand(T, 3, generator=gen)
        disp = make_dispatcher(backend, E)
        plain = disp.dispatch(x, weights, indices, align=align)
        q, s = quantize_fp8(x, "block")
        d = disp.dispatch(q, weights, indices, align=align, scales=s)
        where = f"rank {rank}: {backend} {case} T={T} align={align}"
        rows = int(d.group_sizes.sum())
        want_q, want_s = quantize_fp8(plain.x[:rows], "block")
        assert d.x.dtype == torch.float8_e4m3fn and d.scales.shape == (d.x.shape[0], 2), where
        assert torch.equal(d.x[:rows].view(torch.uint8), want_q.view(torch.uint8)), where
        assert torch.equal(d.scales[:rows], want_s), where
        assert torch.equal(d.group_sizes, plain.group_sizes), where
        deq = dequantize_fp8(d.x[:rows], d.scales[:rows], "block", dtype=torch.float32)
        pad = d.local_indices[:rows] < 0
        assert torch.isfinite(deq).all() and torch.all(deq[pad] == 0), where


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp8_payload_travels_with_its_scales(backend):
    run_world(_worker_fp8_payload, 2, backend)


def test_local_dispatcher_fp8_payload():
    from moe_kernels.ops.quant import quantize_fp8

    x = torch.randn(7, 256)
    idx = torch.tensor([[0, 1], [1, -1], [2, 0], [0, 0], [1, 2], [-1, -1], [2, 1]], dtype=torch.int32)
    w = torch.rand(7, 2)
    q, s = quantize_fp8(x, "block")
    disp = LocalDispatcher(3)
    d, plain = disp.dispatch(q, w, idx, align=4, scales=s), disp.dispatch(x, w, idx, align=4)
    want_q, want_s = quantize_fp8(plain.x, "block")  # padding rows: codes 0, scale 1
    assert torch.equal(d.x.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(d.scales, want_s)
    with pytest.raises(ValueError, match="`scales` has 6 rows"):
        disp.dispatch(q, w, idx, scales=s[:6])
