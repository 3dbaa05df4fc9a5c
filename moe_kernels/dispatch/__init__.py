"""Expert-parallel token dispatch (specs/dispatch.md): one interface, several backends.

    d = dispatcher.dispatch(x, weights, indices, align=...)   # rows for this rank's experts
    y = experts(d.x, d.group_sizes)                            # grouped by local expert
    out = dispatcher.combine(y, d.handle)                      # [T, H], weighted sum per token

Backends: `LocalDispatcher` (one rank, the reference), `AllToAllDispatcher` (the portable default) and
`AllGatherDispatcher` (small groups, large k), both on torch.distributed with NCCL or gloo.
"""

from moe_kernels.dispatch.all_gather import AllGatherDispatcher
from moe_kernels.dispatch.all_to_all import AllToAllDispatcher
from moe_kernels.dispatch.base import Dispatched, Dispatcher, GroupDispatcher, LocalDispatcher

BACKENDS = {"all_to_all": AllToAllDispatcher, "all_gather": AllGatherDispatcher}


def make_dispatcher(backend: str, num_experts: int, group=None) -> Dispatcher:
    """A dispatcher for `num_experts` experts spread evenly over the ranks of `group`."""
    if backend not in BACKENDS:
        raise ValueError(f"make_dispatcher: backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend](num_experts, group)


__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "BACKENDS", "Dispatched", "Dispatcher", "GroupDispatcher", "LocalDispatcher",
    "make_dispatcher",
]
