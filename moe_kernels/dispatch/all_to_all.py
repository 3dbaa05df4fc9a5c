"""All-to-all dispatch on torch.distributed (NCCL, gloo): the portable default.

Each (token, slot) pair travels once, to the rank owning its expert:
  source: permute by global expert (rows for rank r are then contiguous, since r owns a contiguous
          expert range) -> exchange per-expert counts -> all_to_all_single of the rows and weights;
  owner:  rows arrive ordered (source rank, local expert); one more permute groups them by local expert
          (keeping source order inside each expert) and pads to `align`.
combine runs the same steps backwards and the source sums its slots with unpermute: fp32, ascending
slot order, exactly what the one-rank layer computes. The split sizes are needed on the host, so
dispatch synchronises once (one small device-to-host copy of the counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_kernels.dispatch import collectives
from moe_kernels.dispatch.base import Dispatched, GroupDispatcher, padding_scales
from moe_kernels.ops.permute import permute, permuted_row_values, unpermute


@dataclass(eq=False)
class _AllToAllHandle:
    row_map: Tensor  # [T, k] source rows of the local tokens' pairs
    weights: Tensor  # [T, k]
    recv_row_map: Tensor  # [N, 1] grouped row of each received pair
    send_splits: tuple[int, ...]  # pairs sent to each rank
    recv_splits: tuple[int, ...]  # pairs received from each rank
    source_rows: int  # rows of the source permute (T * k)


class AllToAllDispatcher(GroupDispatcher):
    def dispatch(self, x, weights, indices, *, align=1, scales=None) -> Dispatched:
        indices = self._check(x, weights, indices, align, scales)
        P, El = self.num_ranks, self.num_local_experts
        x_perm, row_map, counts = permute(x, indices, self.num_experts)  # [T*k, H], [T, k], [E]
        recv_counts = collectives._all_to_all(counts, counts.shape[0], None, None, self.group)  # [P * El]
        both = torch.stack([counts.view(P, El).sum(1), recv_counts.view(P, El).sum(1)]).tolist()  # the sync
        send_splits, recv_splits = tuple(both[0]), tuple(both[1])
        n_send, n_recv = sum(send_splits), sum(recv_splits)

        x_recv = collectives.all_to_all(x_perm[:n_send], recv_splits, send_splits, self.group)  # [N, H]
        w_rows = permuted_row_values(weights.float(), row_map, x_perm.shape[0])[:n_send]
        w_recv = collectives.all_to_all(w_rows, recv_splits, send_splits, self.group)  # [N]
        # Local expert of each received row: blocks of recv_counts[src, e] rows, in (src, e) order.
        block_expert = torch.arange(El, dtype=torch.int32, device=x.device).repeat(P)
        local_ids = torch.repeat_interleave(block_expert, recv_counts.long(), output_size=n_recv)[:, None]
        x_grouped, recv_row_map, group_sizes = permute(x_recv, local_ids, El, align=align)
        w_grouped = permuted_row_values(w_recv[:, None], recv_row_map, x_grouped.shape[0])
        handle = _AllToAllHandle(row_map, weights, recv_row_map, send_splits, recv_splits, x_perm.shape[0])
        d = Dispatched(x_grouped, w_grouped, group_sizes, handle, recv_row_map, local_ids)
        if scales is not None:  # the same three moves (permute is deterministic: the rows line up)
            s_perm = permute(scales, indices, self.num_experts)[0][:n_send]
            s_recv = collectives.all_to_all(s_perm, recv_splits, send_splits, self.group)
            d.scales = padding_scales(permute(s_recv, local_ids, El, align=align)[0], d.local_indices)
        return d

    def combine(self, y: Tensor, handle: _AllToAllHandle, *, weighted: bool = True) -> Tensor:
        y_recv = unpermute(y, handle.recv_row_map)  # [N, H], one row per received pair (a copy)
        y_back = collectives.all_to_all(y_recv, handle.send_splits, handle.recv_splits, self.group)
        pad = handle.source_rows - y_back.shape[0]  # dropped slots: no row, never read
        if pad:
            y_back = torch.cat([y_back, y_back.new_zeros((pad, y_back.shape[1]))])
        return unpermute(y_back, handle.row_map, handle.weights if weighted else None)
