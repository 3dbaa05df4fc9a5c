"""Expert-parallel token dispatch (specs/dispatch.md): one interface, several backends.

    d = dispatcher.dispatch(x, weights, indices, align=...)   # rows for this rank's experts
    y = experts(d.x, d.group_sizes)                            # grouped by local expert
    out = dispatcher.combine(y, d.handle)                      # [T, H], weighted sum per token

Backends: `LocalDispatcher` (one rank, the reference), `AllToAllDispatcher` (the portable default) and
`AllGatherDispatcher` (small groups, large k), both on torch.distributed with NCCL or gloo, and
`NvlinkDispatcher` (our CUDA kernels writing into the other GPUs' buffers within one node; no host sync).
"""

from moe_kernels.dispatch.all_gather import AllGatherDispatcher
from moe_kernels.dispatch.all_to_all import AllToAllDispatcher
from moe_kernels.dispatch.base import Dispatched, Dispatcher, GroupDispatcher, LocalDispatcher
from moe_kernels.dispatch.nvlink import NvlinkDispatcher, VirtualNvlinkWorld

BACKENDS = {"all_to_all": AllToAllDispatcher, "all_gather": AllGatherDispatcher, "nvlink": NvlinkDispatcher}
# Options only the nvlink backend takes (its buffers' sizes and its share of the GPU).
NVLINK_OPTIONS = ("max_tokens_per_rank", "capacity", "num_sms")


def make_dispatcher(backend: str, num_experts: int, group=None, **options) -> Dispatcher:
    """A dispatcher for `num_experts` experts spread evenly over the ranks of `group`.

    options: for backend="nvlink", max_tokens_per_rank (required), capacity and num_sms (NvlinkDispatcher).
    """
    if backend not in BACKENDS:
        raise ValueError(f"make_dispatcher: backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - set(NVLINK_OPTIONS))
    if unknown:
        raise TypeError(f"make_dispatcher: unknown options {unknown}; the backends take {list(NVLINK_OPTIONS)}")
    if backend != "nvlink":
        if given:
            raise ValueError(f"make_dispatcher: {sorted(given)} size the nvlink backend's buffers; "
                             f"backend={backend!r} takes none")
        return BACKENDS[backend](num_experts, group)
    if "max_tokens_per_rank" not in given:
        raise ValueError("make_dispatcher: backend='nvlink' needs max_tokens_per_rank (the most tokens one rank "
                         "dispatches per call: its buffers are sized for it)")
    return NvlinkDispatcher(num_experts, group, **given)


__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "BACKENDS", "Dispatched", "Dispatcher", "GroupDispatcher", "LocalDispatcher",
    "NvlinkDispatcher", "VirtualNvlinkWorld", "make_dispatcher",
]
