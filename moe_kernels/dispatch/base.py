"""The dispatcher interface (specs/dispatch.md) and the one-rank dispatcher every backend must equal.

Shapes: T local tokens, H hidden, k slots per token, E experts over P ranks, El = E / P local experts
(rank r owns experts [r*El, (r+1)*El)), R received rows.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moe_kernels.ops._checks import FLOAT_DTYPES, check_int, check_tensor
from moe_kernels.ops.permute import permute, permuted_row_values, unpermute

PAYLOAD_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


def padding_scales(scales: Tensor, local_indices: Tensor) -> Tensor:
    """Scales of the grouped rows with 1 in the padding rows (permute pads with zeros)."""
    return torch.where(local_indices[:, None] >= 0, scales, torch.ones((), dtype=scales.dtype))


@dataclass(eq=False)
class Dispatched:
    """What `dispatch` returns on each rank: the rows this rank's experts must process.

    x [R, H]: rows grouped by local expert, expert e's at [start_e, start_e + group_sizes[e]), in the
    order (source rank, token, slot), zero rows padding each group to `align`, rows past
    sum(group_sizes) unspecified (R is a worst case known without a host sync where the backend can).
    weights [R] fp32: the routing weight of each row (0 for padding), for experts that apply it inside.
    group_sizes [El] int32: padded rows per local expert, ready for grouped_mm.
    handle: what `combine` needs; opaque.
    scales [R, S]: the rows of dispatch's `scales` (a quantized payload's scales) moved with x, 1 in the
    padding rows (so dequantizing padding gives zeros); None when no scales were given.
    """

    x: Tensor
    weights: Tensor
    group_sizes: Tensor
    handle: Any
    _row_map: Tensor  # [N, k] rows of the received (token, slot) pairs, for local_indices
    _local_ids: Tensor  # [N, k] their local experts, -1 where not local
    scales: Tensor | None = None

    @functools.cached_property
    def local_indices(self) -> Tensor:
        """[R] int32 local expert of each row, -1 for padding and unused rows."""
        return permuted_row_values(self._local_ids, self._row_map, self.x.shape[0], fill=-1)


class Dispatcher(abc.ABC):
    """dispatch(x, weights, indices) -> Dispatched; combine(y, handle) -> out [T, H].

    combine(y)[t] = sum_j weights[t, j] * y[row of (t, j)] over the slots j of token t (fp32 sums, then
    the dtype of y); with weighted=False the plain sum (the experts applied the weights already). Both are
    differentiable: the backward of dispatch is a combine and that of combine a dispatch.
    """

    def __init__(self, num_experts: int, num_ranks: int, rank: int):
        check_int(type(self).__name__, "num_experts", num_experts, minimum=1)
        if num_experts % num_ranks:
            raise ValueError(
                f"{type(self).__name__}: num_experts={num_experts} must be a multiple of the {num_ranks} ranks"
            )
        self.num_experts, self.num_ranks, self.rank = num_experts, num_ranks, rank
        self.num_local_experts = num_experts // num_ranks
        self.first_expert = rank * self.num_local_experts  # this rank owns [first_expert, first_expert + El)

    @abc.abstractmethod
    def dispatch(
        self, x: Tensor, weights: Tensor, indices: Tensor, *, align: int = 1, scales: Tensor | None = None
    ) -> Dispatched:
        """x [T, H] in any dtype permute takes (FP8 codes and packed FP4 as uint8 included; only float x
        is differentiable); `scales` [T, S] fp32 rows that travel with x (quantize_fp8's 'block' or
        'row' scales, NVFP4 block scales as uint8)."""

    @abc.abstractmethod
    def combine(self, y: Tensor, handle: Any, *, weighted: bool = True) -> Tensor: ...

    def _check(self, x: Tensor, weights: Tensor, indices: Tensor, align: int, scales: Tensor | None = None) -> Tensor:
        op = f"{type(self).__name__}.dispatch"
        check_tensor(op, "x", x, ndim=2, dtypes=PAYLOAD_DTYPES)
        if scales is not None:
            check_tensor(op, "scales", scales, ndim=2, dtypes=(torch.float32, torch.uint8, torch.float8_e4m3fn),
                         device=x.device)
            if scales.shape[0] != x.shape[0]:
                raise ValueError(f"{op}: `scales` has {scales.shape[0]} rows for {x.shape[0]} tokens in `x`")
        check_tensor(op, "indices", indices, ndim=2, dtypes=(torch.int32, torch.int64), device=x.device)
        check_tensor(op, "weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        check_int(op, "align", align, minimum=1)
        if indices.shape[0] != x.shape[0] or weights.shape != indices.shape:
            raise ValueError(
                f"{op}: expected `x` [T, H], `weights` and `indices` [T, k]; got x {tuple(x.shape)}, "
                f"weights {tuple(weights.shape)}, indices {tuple(indices.shape)}"
            )
        return indices.to(torch.int32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_experts={self.num_experts}, rank={self.rank}/{self.num_ranks})"


class GroupDispatcher(Dispatcher):
    """A dispatcher over the ranks of a torch.distributed process group (None: the default group)."""

    def __init__(self, num_experts: int, group=None):
        import torch.distributed as dist

        self.group = group
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group))


@dataclass(eq=False)
class _LocalHandle:
    row_map: Tensor
    weights: Tensor


class LocalDispatcher(Dispatcher):
    """One rank holds every expert: dispatch is permute, combine is unpermute (the reference the
    distributed backends are compared with)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts, 1, 0)

    def dispatch(self, x, weights, indices, *, align=1, scales=None) -> Dispatched:
        indices = self._check(x, weights, indices, align, scales)
        x_perm, row_map, group_sizes = permute(x, indices, self.num_experts, align=align)
        row_weights = permuted_row_values(weights.float(), row_map, x_perm.shape[0])
        d = Dispatched(x_perm, row_weights, group_sizes, _LocalHandle(row_map, weights), row_map, indices)
        if scales is not None:
            d.scales = padding_scales(permute(scales, indices, self.num_experts, align=align)[0], d.local_indices)
        return d

    def combine(self, y: Tensor, handle: _LocalHandle, *, weighted: bool = True) -> Tensor:
        return unpermute(y, handle.row_map, handle.weights if weighted else None)
