"""Differentiable collectives over a process group, with reductions in a fixed order.

Each forward is one torch.distributed call; each backward is the transposed collective. The reduce-
scatter is an all-to-all followed by a local sum over ranks in rank order, so results do not depend
on the backend's reduction order (bit-identical run to run on NCCL and gloo alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

if dist.is_available():
    # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is imported, and torch
    # imports it lazily (the first custom-op call pulls in torch._dynamo, which imports it). Imported after
    # init_process_group, those defaults hold the gloo group past destroy_process_group: its worker threads are
    # never joined and abort the process at exit ("terminate called without an active exception"). Imported here,
    # with the dispatchers, before a program creates its groups, the defaults are None.
    import torch.distributed.nn  # noqa: F401


_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _wire(t: Tensor) -> Tensor:
    """FP8 payloads travel as bytes (not every backend has FP8 types)."""
    return t.view(torch.uint8) if t.dtype in _BYTE_FLOATS else t


def _all_to_all(x: Tensor, out_rows: int, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None, group) -> Tensor:
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(
        _wire(out), _wire(x.contiguous()),
        output_split_sizes=None if out_splits is None else list(out_splits),
        input_split_sizes=None if in_splits is None else list(in_splits),
        group=group,
    )
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.rows, ctx.group = (out_splits, in_splits), x.shape[0], group
        return _all_to_all(x, sum(out_splits), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        # The transpose of an all-to-all is the all-to-all with the split lists swapped.
        return _all_to_all(grad, ctx.rows, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group=None) -> Tensor:
    """Rows [sum(in_splits), ...] -> [sum(out_splits), ...]: the i-th block of in_splits goes to rank i,
    the i-th block of the output comes from rank i."""
    return _AllToAll.apply(x, tuple(out_splits), tuple(in_splits), group)


def _reduce_scatter(x: Tensor, group) -> Tensor:
    ranks = dist.get_world_size(group)
    blocks = _all_to_all(x, x.shape[0], None, None, group).view(ranks, x.shape[0] // ranks, *x.shape[1:])
    out = blocks[0].clone()
    for r in range(1, ranks):  # rank order: the same sum on every backend and every run
        out += blocks[r]
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(_wire(out), _wire(x.contiguous()), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Sum the ranks' partial gradients in fp32 (as combine sums the forward), then round once.
        return _reduce_scatter(grad.float().contiguous(), ctx.group).to(grad.dtype), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather(x: Tensor, group=None) -> Tensor:
    """[n, ...] on each rank -> [world * n, ...], rank r's rows at [r*n, (r+1)*n)."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: Tensor, group=None) -> Tensor:
    """[world * n, ...] on each rank -> [n, ...]: rank r gets the sum over ranks of block r, added in
    rank order."""
    if x.shape[0] % dist.get_world_size(group):
        raise ValueError(f"reduce_scatter: {x.shape[0]} rows do not split evenly over {dist.get_world_size(group)} ranks")
    return _ReduceScatter.apply(x, group)
