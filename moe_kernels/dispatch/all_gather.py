"""All-gather dispatch on torch.distributed: every rank sees every token.

dispatch gathers the tokens, weights and indices of the group (padded to the largest T), and each rank
permutes the pairs routed to its own experts. combine sums each rank's weighted partial outputs in fp32
and reduce-scatters them, adding the ranks in rank order (an all-to-all then a local sum, so the order
does not depend on the communication backend). Static shapes apart from the one exchange of T (which
`gather_tokens` skips when the caller knows the most tokens a rank passes: expert tensor parallelism over
an nvlink dispatcher pads to its max_tokens_per_rank, without a host sync); good for small groups and
large k, where most tokens go to most ranks anyway. Memory: each rank's grouped rows are sized for the
worst case, every gathered pair local (P * Tmax * k rows, about P times what a uniform routing uses), and
combine's partial sums are [P * Tmax, H] fp32: for large groups use all-to-all. The result equals the
one-rank layer within fp32 rounding (the slots are summed per rank, then across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moe_kernels.dispatch import collectives
from moe_kernels.dispatch.base import Dispatched, GroupDispatcher, padding_scales
from moe_kernels.ops._checks import check_int
from moe_kernels.ops.permute import permute, permuted_row_values, unpermute


def gather_tokens(x: Tensor, weights: Tensor, indices: Tensor, scales: Tensor | None, group, *,
                  pad_to: int | None = None):
    """Every rank's tokens, routing weights (fp32), expert choices and scales, rank r's at [r*Tmax, (r+1)*Tmax).
    The ranks' T may differ: padding tokens route nowhere (-1) and weigh 0. Tmax is `pad_to` when given (the
    most tokens a rank passes, e.g. an nvlink dispatcher's max_tokens_per_rank: no host sync, no exchange
    of T), else the group's largest T (one exchange of T and a host sync).
    Differentiable in x and weights: the backward sums every rank's gradients onto the owner."""
    T = x.shape[0]
    if pad_to is not None:
        check_int("gather_tokens", "pad_to", pad_to, minimum=1)
        if T > pad_to:
            raise ValueError(f"gather_tokens: `x` has {T} tokens, more than pad_to={pad_to} (the most tokens a rank "
                             "passes)")
        pad = pad_to - T
    else:
        sizes = [torch.empty(1, dtype=torch.int64, device=x.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, torch.tensor([T], dtype=torch.int64, device=x.device), group=group)
        pad = int(torch.cat(sizes).max()) - T  # the sync
    if pad:
        x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
        weights = torch.cat([weights, weights.new_zeros((pad, weights.shape[1]))])
        indices = torch.cat([indices, indices.new_full((pad, indices.shape[1]), -1)])
        if scales is not None:
            scales = torch.cat([scales, scales.new_zeros((pad, scales.shape[1]))])
    x_all = collectives.all_gather(x, group)  # [P * Tmax, H]
    w_all = collectives.all_gather(weights.float(), group)  # [P * Tmax, k]
    i_all = collectives._AllGather.apply(indices, group)  # [P * Tmax, k]
    s_all = None if scales is None else collectives._AllGather.apply(scales, group)
    return x_all, w_all, i_all, s_all


@dataclass(eq=False)
class _AllGatherHandle:
    row_map: Tensor  # [P * Tmax, k] grouped row of each gathered pair, -1 where not local
    weights: Tensor  # [P * Tmax, k] gathered weights
    num_tokens: int  # local T


class AllGatherDispatcher(GroupDispatcher):
    def dispatch(self, x, weights, indices, *, align=1, scales=None) -> Dispatched:
        indices = self._check(x, weights, indices, align, scales)
        T = x.shape[0]
        x_all, w_all, i_all, s_all = gather_tokens(x, weights, indices, scales, self.group)
        lo, El = self.first_expert, self.num_local_experts
        local_ids = torch.where((i_all >= lo) & (i_all < lo + El), i_all - lo, -1).to(torch.int32)
        x_grouped, row_map, group_sizes = permute(x_all, local_ids, El, align=align)
        w_grouped = permuted_row_values(w_all, row_map, x_grouped.shape[0])
        handle = _AllGatherHandle(row_map, w_all, T)
        d = Dispatched(x_grouped, w_grouped, group_sizes, handle, row_map, local_ids)
        if s_all is not None:
            d.scales = padding_scales(permute(s_all, local_ids, El, align=align)[0], d.local_indices)
        return d

    def combine(self, y: Tensor, handle: _AllGatherHandle, *, weighted: bool = True) -> Tensor:
        partial = unpermute(y.float(), handle.row_map, handle.weights if weighted else None)  # [P * Tmax, H]
        out = collectives.reduce_scatter(partial, self.group)  # [Tmax, H], ranks added in order
        return out[: handle.num_tokens].to(y.dtype)
