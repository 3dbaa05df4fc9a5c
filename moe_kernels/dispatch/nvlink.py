"""NVLink dispatch: our CUDA kernels writing tokens straight into the other ranks' receive buffers.

Within one node every rank maps every other rank's buffers (CUDA IPC handles, exchanged once through the
process group) and the kernels of csrc/dispatch/nvlink.cu move the rows:

  dispatch  barrier | notify: per destination rank, which tokens go there and the totals into its inbox
            barrier | send: each token once per destination rank (not once per expert), with its local
                      experts, weights and scale row, at an offset computed on the device from the inboxes
            barrier | layout: the receiver groups its rows by local expert (permute, `align` padding)
  combine   barrier | push: each grouped row back to its source, one row per (token, slot)
            barrier | reduce: the source sums its slots with unpermute (fp32, ascending slot)
The backward of dispatch is a combine (push, reduce) and that of combine a dispatch of rows (the source
writes its per-slot gradient rows, the owners pull them). No phase syncs with the host: buffers are
sized for the worst case from `max_tokens_per_rank`, counts stay on the device, and a whole MoE layer can
be captured in a CUDA graph (after one warm-up call has allocated the buffers). What the autograd keeps
for the backward (the handles' tensors, combine's weights and slot rows) is saved with save_for_backward,
so activation checkpointing and saved-tensor offload see and can free it.

Layout agreement: what sets the layout of the peer buffers (k; the rows' hidden size and dtype; the scales'
width and dtype; every rank's tokens within `max_tokens_per_rank`) must be the same on every rank of the
group, or a rank would write its peers' buffers with its own layout. A dispatcher checks it on the host
once per layout: the first dispatch (or combine) with a layout it has not seen does one all_gather of a
few integers over the group (one host sync) and raises the same ValueError on every rank, naming the
first rank that differs and its value; later calls with that layout only check this rank's token count
(no collective, no sync). A rank that later passes a layout the others do not waits in that all_gather
(and they in their next barrier) rather than writing out of bounds; the checks of a rank's own arguments
(shapes, supported dtypes) raise on that rank alone.

Results are bit-identical to the all-to-all backend and the one-rank layer: the same rows in the same
order, the same sums in the same order.

Memory per rank (P ranks, M = max_tokens_per_rank, k slots, El local experts, H hidden, b bytes per
element, S scale bytes per row, C = capacity, X = min(P*M, C)):
  dispatch buffer  P*M*(8 + 8k) + X*(H*b + S) bytes   (receive rows and their routing)
  combine buffer   M*k*(H*b + 4) bytes                (one row per own (token, slot))
  grouped rows     min(C, P*M*k) + El*(align - 1) rows per dispatch (torch tensors)
The default capacity is the worst case, every token of every rank to this rank with all its k slots
here: no token is ever dropped, and the grouped rows are sized for it. A smaller `capacity` (expert rows
per rank; 2*M*k is twice the balanced load) bounds the buffers; tokens past it are dropped (they count
as routed nowhere on that rank), counted on the device and reported by `dropped_tokens()`.

IPC buffers: each rank cudaMallocs its regions and maps its peers' (CUDA IPC handles, exchanged through the
process group). A region is freed only once no peer maps it: when a region grows, and in
`NvlinkDispatcher.release_buffers(group)` (collective, before the process group is destroyed), every rank
waits for its kernels, a barrier, every rank closes its mappings of the peers' regions, a barrier, then
each frees its own, so no rank frees memory a peer still maps. A transport collected without that (at
interpreter exit, or after the group was destroyed) runs no collective (the ranks get there in no known
order, or cannot synchronise any more): it closes its own mappings and leaves its regions allocated, and
the driver frees them with the process's context when it exits. For an orderly teardown, call
`release_buffers` before destroying the group.

`VirtualNvlinkWorld` runs P ranks in one process on one device (buffers all there, the barrier replaced
by stream order): how the kernels are tested without a node, on the CPU-executed build in CI.
"""

from __future__ import annotations

import abc
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.dispatch.base import Dispatched, Dispatcher, GroupDispatcher, padding_scales
from moe_kernels.ops._checks import check_int

DEFAULT_NUM_SMS = 20
MAX_RANKS = 64  # kMaxRanks of csrc/dispatch/nvlink.h (the signal words and inbox of the header)
_FALLBACK = "use backend='all_to_all' (torch.distributed, any devices) instead"
_DROPPED_INDEX = 65  # Header.dropped as an int64 index: after signals[64] and epoch


def _kernels(x: Tensor, who: str):
    """The extension module running the kernels for `x` (the CUDA one, or the CPU-executed build under
    MOE_KERNELS_EMULATE), or a ValueError saying what to use instead."""
    if x.device.type == "cpu" and _ext.emulation() is None:
        raise ValueError(f"{who}: the nvlink backend runs CUDA kernels on CUDA tensors, got CPU tensors; {_FALLBACK}")
    C = _ext.kernels("nvlink dispatch", x)
    if C is None:
        raise ValueError(f"{who}: the nvlink backend needs moe_kernels' CUDA extension on this GPU; {_FALLBACK}")
    return C


# ---------------------------------------------------------------------------------------------------
# Buffers: one region kind ("header", "dispatch", "combine") per rank, the same layout on every rank.


class _Transport(abc.ABC):
    """Each rank's regions and the device tables of their base addresses (as int64)."""

    num_ranks: int
    local_ranks: list[int]  # the ranks this process drives
    device: torch.device

    def __init__(self):
        self.regions: dict[str, list[Tensor | None]] = {}
        self.bases: dict[str, Tensor] = {}
        self.dropped_seen: dict[int, int] = {}  # rank -> drop counter value at the last dropped_tokens()

    def region(self, kind: str, rank: int) -> Tensor:
        return self.regions[kind][rank]

    def ensure(self, kind: str, nbytes: int) -> None:
        """Grow region `kind` to at least `nbytes` on every rank (collective on real ranks)."""
        have = self.regions.get(kind)
        local = self.local_ranks[0]
        if have is not None and have[local].numel() >= nbytes:
            return
        self._allocate(kind, max(nbytes, 256))

    @abc.abstractmethod
    def _allocate(self, kind: str, nbytes: int) -> None:
        """(Re)allocate region `kind` with `nbytes` on every rank this process drives and map the others'."""

    @abc.abstractmethod
    def barrier(self, C) -> None:
        """Every rank's earlier writes visible to every rank (the barrier kernel, or stream order)."""


class _VirtualTransport(_Transport):
    """P ranks' regions as tensors on one device; a barrier is every rank's arrival, then every wait."""

    def __init__(self, num_ranks: int, device: torch.device):
        super().__init__()
        self.num_ranks, self.local_ranks, self.device = num_ranks, list(range(num_ranks)), device

    def _allocate(self, kind: str, nbytes: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        tensors = [torch.zeros(nbytes + 256, dtype=torch.uint8, device=self.device) for _ in range(self.num_ranks)]
        # 256-byte aligned views (CUDA allocations are; host memory may not be)
        views = [t[(-t.data_ptr()) % 256 :][:nbytes] for t in tensors]
        self._owners = getattr(self, "_owners", {})
        self._owners[kind] = tensors
        self.regions[kind] = views
        self.bases[kind] = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=self.device)

    def barrier(self, C) -> None:
        bases = self.bases["header"].data_ptr()
        for mode in (1, 2):  # arrive everywhere, then wait everywhere: no rank waits for one not yet run
            for r in self.local_ranks:
                C.nvlink_barrier(rank=r, ranks=self.num_ranks, bases=bases, mode=mode, **_launch(self.device))


class _CudaMemory:
    """A device allocation seen by torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class _IpcTransport(_Transport):
    """This process's rank of a torch.distributed group within one node: its regions are cudaMalloc'd
    and mapped by every other rank through CUDA IPC handles (exchanged once per region and size)."""

    def __init__(self, group, device: torch.device, C):
        import torch.distributed as dist

        super().__init__()
        self.group, self.C, self.device = group, C, device
        self.num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_ranks = [rank]
        self._mine: dict[str, int] = {}  # kind -> own allocation
        self._opened: dict[str, list[int]] = {}  # kind -> peers' mappings
        import socket

        infos = [None] * self.num_ranks
        dist.all_gather_object(infos, (socket.gethostname(), C.pci_bus_id(device.index)), group=group)
        hosts = sorted({h for h, _ in infos})
        if len(hosts) > 1:
            raise ValueError(f"nvlink dispatch: the group spans {len(hosts)} nodes ({', '.join(hosts)}); peer buffers "
                             f"work within one node; {_FALLBACK}")
        for r, (_, bus) in enumerate(infos):
            # Bus ids, not device indices: with per-rank CUDA_VISIBLE_DEVICES every rank's GPU is "device 0".
            peer = C.device_by_pci_bus_id(bus)
            if peer >= 0 and not C.can_access_peer(device.index, peer):
                raise ValueError(f"nvlink dispatch: this rank's GPU ({infos[rank][1]}, rank {rank}) cannot access "
                                 f"rank {r}'s GPU ({bus}) directly (no NVLink/PCIe peer access); {_FALLBACK}")

    def _allocate(self, kind: str, nbytes: int) -> None:
        import torch.distributed as dist

        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's kernels on the old regions finished
        self._release([kind])
        dev = self.device.index
        ptr = self.C.ipc_malloc(nbytes, dev)
        self._mine[kind] = ptr
        handles = [None] * self.num_ranks
        dist.all_gather_object(handles, self.C.ipc_handle(ptr, dev), group=self.group)
        me = self.local_ranks[0]
        bases = []
        opened = []
        for r, h in enumerate(handles):
            if r == me:
                bases.append(ptr)
                continue
            try:
                p = self.C.ipc_open(h, dev)
            except RuntimeError as exc:
                raise ValueError(f"nvlink dispatch: rank {me} cannot map rank {r}'s buffer ({exc}): the GPUs must "
                                 f"see each other (one node, peer access, no isolating CUDA_VISIBLE_DEVICES); "
                                 f"{_FALLBACK}") from exc
            opened.append(p)
            bases.append(p)
        self._opened[kind] = opened
        dist.barrier(group=self.group)  # every rank mapped every buffer before any kernel writes into one
        regions = [None] * self.num_ranks
        regions[me] = self._own_view(ptr, nbytes)
        self.regions[kind] = regions
        self.bases[kind] = torch.tensor(bases, dtype=torch.int64, device=self.device)

    def _own_view(self, ptr: int, nbytes: int) -> Tensor:
        return torch.as_tensor(_CudaMemory(ptr, nbytes), device=self.device)

    def _unmap(self, kind: str) -> None:
        """Close this rank's mappings of the peers' `kind` regions (local: the peers' memory stays theirs)."""
        dev = self.device.index
        for p in self._opened.pop(kind, []):
            self.C.ipc_close(p, dev)
        self.regions.pop(kind, None)
        self.bases.pop(kind, None)

    def _release(self, kinds) -> None:
        """Unmap the peers' regions of `kinds`, wait until every rank has (a barrier), then free this rank's:
        no rank frees a region another still maps. Collective; every rank's kernels on them have finished."""
        import torch.distributed as dist

        kinds = [kind for kind in kinds if kind in self._mine]  # the same kinds on every rank
        if not kinds:
            return
        for kind in kinds:
            self._unmap(kind)
        dist.barrier(group=self.group)  # no rank maps these regions any more
        for kind in kinds:
            self.C.ipc_free(self._mine.pop(kind), self.device.index)

    def close(self) -> None:
        """Free every region: wait for every rank's kernels, unmap the peers' regions, barrier, free this
        rank's. Collective (every rank of the group calls it, while the group is alive); the regions are
        allocated again at the next dispatch. With the process group gone it only unmaps (`_abandon`)."""
        import torch.distributed as dist

        if not self._mine and not self._opened:
            return
        if not _group_alive(self.group):
            torch.cuda.synchronize(self.device)
            self._abandon()
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's kernels on the regions finished
        self._release(list(self._mine))
        self.dropped_seen.clear()  # a new header starts its drop counter at zero

    def _abandon(self) -> None:
        """Unmap the peers' regions and forget this rank's without freeing them: without a barrier a peer may
        still map them, so they stay allocated until this process exits (the driver frees them then)."""
        for kind in list(self._opened):
            self._unmap(kind)
        self._mine.clear()
        self.regions.clear()
        self.bases.clear()

    def barrier(self, C) -> None:
        C.nvlink_barrier(rank=self.local_ranks[0], ranks=self.num_ranks, bases=self.bases["header"].data_ptr(),
                         mode=3, **_launch(self.device))

    def __del__(self):
        # No collective here: ranks collect their transports at different times (at interpreter exit the
        # group may be gone), so a barrier could hang and a free without one could race a peer's mapping.
        try:
            torch.cuda.synchronize(self.device)
            self._abandon()
        except Exception:  # interpreter shutdown
            pass


def _group_alive(group) -> bool:
    """Whether collectives over `group` can still run (torch.distributed initialised, the group not destroyed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        return dist.get_rank(group) >= 0
    except (RuntimeError, ValueError):
        return False


def _launch(device: torch.device) -> dict:
    if device.type == "cpu":
        return {"device": 0, "stream": 0}
    return {"device": device.index, "stream": torch.cuda.current_stream(device).cuda_stream}


# ---------------------------------------------------------------------------------------------------
# The engine: the phases of each operation, per rank; `_run` puts a barrier before every phase.


@dataclass(eq=False)
class NvlinkHandle:
    """What combine and the backward passes need; tensors of this rank's own (not the shared buffers)."""

    rank: int
    num_tokens: int  # T
    k: int
    source_rows: Tensor  # [T, k] row t*k + j of slot j in the combine region, -1: went nowhere
    weights: Tensor | None  # [T, k] the dispatch's weights (combine's default); None in a backward's copy
    num_received: Tensor  # [1] int32 tokens received (N)
    src: Tensor  # [X, 2] (source rank, source token) of received rows < N
    row_map: Tensor  # [X, k] grouped row of each received slot, -1 none
    workspace: Tensor  # the layout permute's workspace (expert starts and counts)
    group_sizes: Tensor  # [El]
    num_rows: int  # R

    # The tensors the backward passes read, in the order `_saved`/`_rebuilt` use.
    _TENSORS = ("source_rows", "num_received", "src", "row_map", "workspace", "group_sizes")

    def _saved(self) -> tuple[tuple[Tensor, ...], tuple[int, int, int, int]]:
        """(tensors for ctx.save_for_backward, the integers beside them)."""
        return tuple(getattr(self, f) for f in self._TENSORS), (self.rank, self.num_tokens, self.k, self.num_rows)

    @classmethod
    def _rebuilt(cls, tensors, meta) -> NvlinkHandle:
        rank, num_tokens, k, num_rows = meta
        return cls(rank, num_tokens, k, *tensors[:1], None, *tensors[1:], num_rows)


class _Engine:
    def __init__(self, transport: _Transport, num_experts: int, max_tokens: int, capacity: int | None, num_sms: int):
        P = transport.num_ranks
        if num_experts % P:
            raise ValueError(f"nvlink dispatch: num_experts={num_experts} must be a multiple of the {P} ranks")
        self.t, self.P, self.E, self.M = transport, P, num_experts, max_tokens
        self.El = num_experts // P
        self.capacity, self.num_sms = capacity, num_sms

    # -- sizes
    def cap(self, k: int) -> int:
        worst = self.P * self.M * k  # every slot of every token here (repeated experts included)
        return worst if self.capacity is None else min(self.capacity, worst)

    def x_rows(self, k: int) -> int:
        return min(self.P * self.M, self.cap(k))

    def _run(self, C, phases) -> None:
        for phase in phases:
            self.t.barrier(C)
            for r in self.t.local_ranks:
                phase(r)

    # -- dispatch
    def dispatch(self, C, xs, ws, idxs, scales, align):
        t, P, M, El = self.t, self.P, self.M, self.El
        ranks = t.local_ranks
        k = idxs[0].shape[1]
        H = xs[0].shape[1]
        row_bytes = H * xs[0].element_size()
        scale_bytes = 0 if scales[0] is None else scales[0].shape[1] * scales[0].element_size()
        X, cap = self.x_rows(k), self.cap(k)
        layout = C.nvlink_dispatch_layout(P, M, k, X, row_bytes, scale_bytes)
        t.ensure("header", C.nvlink_header_bytes)
        t.ensure("dispatch", layout["bytes"])
        dev = _launch(t.device)
        hb, db = t.bases["header"].data_ptr(), t.bases["dispatch"].data_ptr()
        R = cap + El * (align - 1)
        st = {}

        def notify(r):
            i = ranks.index(r)
            T = xs[i].shape[0]
            s = st[r] = {"T": T}
            s["send_token"] = torch.empty((T, P), dtype=torch.int32, device=t.device)
            s["send_slot"] = torch.empty((T, P), dtype=torch.int32, device=t.device)
            C.nvlink_notify(rank=r, ranks=P, header_bases=hb, indices=_ext.ptr(idxs[i]), num_tokens=T, k=k,
                            local_experts=El, send_token=_ext.ptr(s["send_token"]), send_slot=_ext.ptr(s["send_slot"]),
                            **dev)

        def send(r):
            i, s = ranks.index(r), st[r]
            s["source_rows"] = torch.empty((s["T"], k), dtype=torch.int32, device=t.device)
            C.nvlink_send(rank=r, ranks=P, header_bases=hb, data_bases=db, x=_ext.ptr(xs[i]),
                          scales=_ext.ptr(scales[i]), weights=_ext.ptr(ws[i]), indices=_ext.ptr(idxs[i]),
                          send_token=_ext.ptr(s["send_token"]), send_slot=_ext.ptr(s["send_slot"]),
                          source_rows=_ext.ptr(s["source_rows"]), num_tokens=s["T"], k=k, row_bytes=row_bytes,
                          scale_bytes=scale_bytes, max_tokens=M, x_rows=X, capacity=cap, local_experts=El,
                          num_sms=self.num_sms, **dev)

        def lay_out(r):
            i, s = ranks.index(r), st[r]
            region = t.region("dispatch", r)
            base = region.data_ptr()
            rows = X  # rows past X only ever hold dropped tokens
            n = torch.empty((1,), dtype=torch.int32, device=t.device)
            C.nvlink_prepare(rank=r, ranks=P, header_bases=hb, idx=base + layout["idx"], rows=rows, k=k,
                             num_received=_ext.ptr(n), **dev)
            x_g = torch.empty((R, H), dtype=xs[i].dtype, device=t.device)
            row_map = torch.empty((rows, k), dtype=torch.int32, device=t.device)
            group_sizes = torch.empty((El,), dtype=torch.int32, device=t.device)
            ws_t = torch.empty((C.permute_workspace_bytes(rows * k, El),), dtype=torch.uint8, device=t.device)
            C.permute_fwd(x=base + layout["x"], indices=base + layout["idx"], x_perm=_ext.ptr(x_g),
                          row_map=_ext.ptr(row_map), group_sizes=group_sizes.data_ptr(), workspace=_ext.ptr(ws_t),
                          num_tokens=rows, k=k, row_bytes=row_bytes, num_experts=El, align=align, **dev)
            row_w = torch.zeros((R,), dtype=torch.float32, device=t.device)
            local = torch.full((R,), -1, dtype=torch.int32, device=t.device)
            g_scales = None
            if scales[i] is not None:
                g_scales = torch.empty((R, scales[i].shape[1]), dtype=scales[i].dtype, device=t.device)
            src = torch.empty((rows, 2), dtype=torch.int32, device=t.device)
            C.nvlink_layout_meta(num_received=_ext.ptr(n), src=base + layout["src"], idx=base + layout["idx"],
                                 w=base + layout["w"], scales=base + layout["scales"] if scale_bytes else 0,
                                 row_map=_ext.ptr(row_map), handle_src=_ext.ptr(src), row_weights=_ext.ptr(row_w),
                                 local_indices=_ext.ptr(local), grouped_scales=_ext.ptr(g_scales), rows=rows, k=k,
                                 scale_bytes=scale_bytes, **dev)
            handle = NvlinkHandle(r, s["T"], k, s["source_rows"], ws[i], n, src, row_map, ws_t, group_sizes, R)
            if g_scales is not None:
                g_scales = padding_scales(g_scales, local)
            s["out"] = (x_g, row_w, group_sizes, local, g_scales, handle)

        self._run(C, (notify, send, lay_out))
        return [st[r]["out"] for r in ranks]

    # -- rows back to their sources: push, then each source reduces its (token, slot) rows
    def _push(self, C, r, h: NvlinkHandle, rows: Tensor, floats: Tensor | None):
        t = self.t
        C.nvlink_push(rank=r, ranks=self.P, data_bases=t.bases["combine"].data_ptr(), num_received=_ext.ptr(h.num_received),
                      src=_ext.ptr(h.src), row_map=_ext.ptr(h.row_map), rows=_ext.ptr(rows), floats=_ext.ptr(floats),
                      received_rows=h.row_map.shape[0], k=h.k, row_bytes=rows.shape[1] * rows.element_size(),
                      max_tokens=self.M, num_sms=self.num_sms, starts=0, totals=0, group_sizes=0, local_experts=0,
                      **_launch(t.device))

    def _slot_rows(self, r, h: NvlinkHandle, H: int, dtype) -> Tensor:
        """This rank's combine region as [T*k, H] rows of `dtype`."""
        n = h.num_tokens * h.k * H * torch.empty((), dtype=dtype).element_size()
        return self.t.region("combine", r)[:n].view(dtype).view(h.num_tokens * h.k, H)

    def _slot_floats(self, C, r, h: NvlinkHandle, row_bytes: int) -> Tensor:
        """The floats sent beside the rows, as [T, k] (where the push kernel writes them)."""
        off = C.nvlink_combine_floats_offset(self.M, h.k, row_bytes)
        return self.t.region("combine", r)[off : off + 4 * h.num_tokens * h.k].view(torch.float32).view(h.num_tokens, h.k)

    def _ensure_combine(self, C, k: int, row_bytes: int) -> None:
        self.t.ensure("combine", C.nvlink_combine_bytes(self.M, k, row_bytes))

    def combine(self, C, ys, handles, weights, save_rows: bool, floats=None):
        """out[t] = sum_j w[t, j] * y[row of (t, j)] (plain sum when weights[i] is None), per local rank
        (out, the [T*k, H] slot rows when save_rows, the floats sent beside the rows as [T, k] or None).
        The backward of dispatch is this with no weights and the row weights' gradients as `floats`."""
        t = self.t
        H, dtype = ys[0].shape[1], ys[0].dtype
        row_bytes = H * ys[0].element_size()
        self._ensure_combine(C, handles[0].k, row_bytes)
        floats = floats or [None] * len(ys)
        outs = {}

        def push(r):
            i = t.local_ranks.index(r)
            self._push(C, r, handles[i], ys[i], floats[i])

        def reduce(r):
            i = t.local_ranks.index(r)
            h = handles[i]
            slots = self._slot_rows(r, h, H, dtype)
            out = torch.empty((h.num_tokens, H), dtype=dtype, device=t.device)
            if h.num_tokens:
                C.unpermute_fwd(y=_ext.ptr(slots), row_map=_ext.ptr(h.source_rows), weights=_ext.ptr(weights[i]),
                                out=_ext.ptr(out), num_tokens=h.num_tokens, k=h.k, hidden=H,
                                num_rows=h.num_tokens * h.k, dtype=_ext.dtype_code(dtype), **_launch(t.device))
            sent = None
            if floats[i] is not None:  # fresh tensors: the region is reused by the next call
                sent = torch.where(h.source_rows >= 0, self._slot_floats(C, r, h, row_bytes), 0.0)
            outs[r] = (out, slots.clone() if save_rows else None, sent)

        self._run(C, (push, reduce))
        return [outs[r] for r in t.local_ranks]

    def combine_backward(self, C, grads, handles, weights, saved_rows):
        """The transpose of combine: each source writes its per-slot gradient rows (and the weights'
        gradients) into its own combine region; the experts' owners pull theirs."""
        t = self.t
        H, dtype = grads[0].shape[1], grads[0].dtype
        row_bytes = H * grads[0].element_size()
        self._ensure_combine(C, handles[0].k, row_bytes)
        outs = {}
        dws = {}

        def write(r):
            i = t.local_ranks.index(r)
            h = handles[i]
            slots = self._slot_rows(r, h, H, dtype)
            need_dw = weights[i] is not None and saved_rows[i] is not None
            dw = torch.empty((h.num_tokens, h.k) if need_dw else (0,), dtype=torch.float32, device=t.device)
            mask = torch.zeros((h.num_tokens * h.k,), dtype=torch.uint8, device=t.device)
            if h.num_tokens:
                C.unpermute_bwd(dout=_ext.ptr(grads[i].contiguous()), y=_ext.ptr(saved_rows[i]) if need_dw else 0,
                                row_map=_ext.ptr(h.source_rows), weights=_ext.ptr(weights[i]), dy=_ext.ptr(slots),
                                dweights=_ext.ptr(dw) if need_dw else 0, row_mask=_ext.ptr(mask),
                                num_tokens=h.num_tokens, k=h.k, hidden=H, num_rows=h.num_tokens * h.k,
                                dtype=_ext.dtype_code(dtype), **_launch(t.device))
            dws[r] = dw if need_dw else None

        def pull(r):
            i = t.local_ranks.index(r)
            h = handles[i]
            dy = torch.empty((h.num_rows, H), dtype=dtype, device=t.device)
            ws = h.workspace.data_ptr()
            starts = ws + C.permute_starts_offset(h.row_map.numel(), self.El)
            C.nvlink_pull(rank=r, ranks=self.P, data_bases=t.bases["combine"].data_ptr(),
                          num_received=_ext.ptr(h.num_received), src=_ext.ptr(h.src), row_map=_ext.ptr(h.row_map),
                          rows=_ext.ptr(dy), floats=0, received_rows=h.row_map.shape[0], k=h.k, row_bytes=row_bytes,
                          max_tokens=self.M, num_sms=self.num_sms, starts=starts, totals=starts + 4 * self.El,
                          group_sizes=h.group_sizes.data_ptr(), local_experts=self.El, **_launch(t.device))
            outs[r] = (dy, dws[r])

        self._run(C, (write, pull))
        return [outs[r] for r in t.local_ranks]

    def dropped_tokens(self) -> int:
        """(token, rank) copies the local ranks' dispatches dropped for capacity since the last call
        (syncs with the device); warns when there were any."""
        total = 0
        for r in self.t.local_ranks:
            if "header" not in self.t.regions:
                continue
            now = int(self.t.region("header", r).view(torch.int64)[_DROPPED_INDEX])
            seen = self.t.dropped_seen.get(r, 0)  # per transport: every dispatcher of the group shares it
            total += now - seen
            self.t.dropped_seen[r] = now
        if total:
            warnings.warn(f"nvlink dispatch: {total} token copies went past capacity={self.capacity} and were dropped "
                          "(their experts on those ranks contributed nothing); raise `capacity`", RuntimeWarning,
                          stacklevel=2)
        return total


# ---------------------------------------------------------------------------------------------------
# Autograd: one node for all the ranks this process drives (virtual ranks move in lockstep). Every tensor
# a node keeps goes through ctx.save_for_backward (activation checkpointing and saved-tensor offload see
# them); ctx holds only integers, dtypes and the engine. The handles are rebuilt in backward.

_PER_HANDLE = len(NvlinkHandle._TENSORS)


def _save_handles(ctx, handles, *extra) -> None:
    """Saves each handle's tensors (then, per handle, one tensor or None of each list in `extra`)."""
    saved, ctx.handle_meta = [], []
    for i, h in enumerate(handles):
        tensors, meta = h._saved()
        saved += [*tensors, *(e[i] for e in extra)]
        ctx.handle_meta.append(meta)
    ctx.save_for_backward(*saved)


def _saved_handles(ctx, extra: int) -> tuple[list[NvlinkHandle], list[list]]:
    """The handles and the `extra` lists `_save_handles` saved."""
    saved, width = ctx.saved_tensors, _PER_HANDLE + extra
    handles, extras = [], [[] for _ in range(extra)]
    for i, meta in enumerate(ctx.handle_meta):
        chunk = saved[i * width : (i + 1) * width]
        handles.append(NvlinkHandle._rebuilt(chunk[:_PER_HANDLE], meta))
        for j in range(extra):
            extras[j].append(chunk[_PER_HANDLE + j])
    return handles, extras


def _is_float(t: Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float16, torch.bfloat16)


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, C, box, align, n, *tensors):
        xs, ws, idxs, scales = tensors[:n], tensors[n : 2 * n], tensors[2 * n : 3 * n], tensors[3 * n :]
        outs = engine.dispatch(C, [x.detach() for x in xs], [w.detach().float().contiguous() for w in ws],
                               list(idxs), [None if s is None else s.detach() for s in scales], align)
        box.extend(outs)
        ctx.engine, ctx.C, ctx.n = engine, C, n
        _save_handles(ctx, [o[5] for o in outs])
        ctx.w_dtypes = [w.dtype for w in ws]
        ctx.x_float = [_is_float(x) for x in xs]
        xg = [o[0] for o in outs]
        nondiff = [x for x, f in zip(xg, ctx.x_float) if not f]
        nondiff += [o[2] for o in outs] + [o[3] for o in outs] + [o[4] for o in outs if o[4] is not None]
        ctx.mark_non_differentiable(*nondiff)
        return (*xg, *[o[1] for o in outs], *[o[2] for o in outs], *[o[3] for o in outs],
                *[o[4] for o in outs])

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        gx, gw = list(grads[:n]), list(grads[n : 2 * n])
        ctx_inputs = ctx.needs_input_grad[5:]
        need_x, need_w = any(ctx_inputs[:n]), any(ctx_inputs[n : 2 * n])
        if not (need_x or need_w):
            return (None,) * (5 + 4 * n)
        handles, _ = _saved_handles(ctx, 0)
        for i, h in enumerate(handles):
            if gx[i] is None or not ctx.x_float[i]:  # a non-float payload: its rows carry no gradient
                gx[i] = torch.zeros((h.num_rows, 1), dtype=torch.float32, device=h.row_map.device)
            if gw[i] is None and need_w:
                gw[i] = torch.zeros((h.num_rows,), dtype=torch.float32, device=h.row_map.device)
        res = ctx.engine.combine(ctx.C, [g.contiguous() for g in gx], handles, [None] * n, False,
                                 floats=[g.float().contiguous() for g in gw] if need_w else None)
        dxs = [dx if (ctx.x_float[i] and ctx_inputs[i]) else None for i, (dx, _, _) in enumerate(res)]
        dws = [None if dw is None else dw.to(ctx.w_dtypes[i]) for i, (_, _, dw) in enumerate(res)]
        return (None, None, None, None, None, *dxs, *dws, *([None] * (2 * n)))


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, C, handles, weighted, n, *tensors):
        ys, ws = tensors[:n], tensors[n:]
        wf = [w.detach().float().contiguous() if weighted else None for w in ws]
        save = weighted and any(w.requires_grad for w in ws)
        outs = engine.combine(C, [y.detach().contiguous() for y in ys], handles, wf, save)
        ctx.engine, ctx.C, ctx.n = engine, C, n
        # The weights (for dy) and, when the weights need a gradient, the [T*k, H] slot rows (for dw).
        _save_handles(ctx, handles, wf, [o[1] for o in outs])
        ctx.w_dtypes = [None if w is None else w.dtype for w in ws]
        return tuple(o[0] for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        handles, (wf, saved_rows) = _saved_handles(ctx, 2)
        res = ctx.engine.combine_backward(ctx.C, [g.contiguous() for g in grads], handles, wf, saved_rows)
        dys = [dy for dy, _ in res]
        dws = [None if dw is None else dw.to(ctx.w_dtypes[i]) for i, (_, dw) in enumerate(res)]
        return (None, None, None, None, None, *dys, *dws)


_PAYLOADS = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
_OUTPUTS = (torch.float32, torch.float16, torch.bfloat16)


# Layout agreement: what sets the layout of the peer buffers must be the same on every rank (a rank with
# another k, row width or scale width would write its peers' buffers with its own layout). A layout is a
# few integers; `_check_agreed` compares every rank's with rank 0's.

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
           torch.float64)
_LAYOUT_FIELDS = ("k", "hidden size", "dtype", "scale width", "scale dtype")


def _code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dispatch_layout(x: Tensor, indices: Tensor, scales: Tensor | None) -> tuple[int, ...]:
    """k, hidden size, payload dtype, scale width and scale dtype (-1: no scales), as integers."""
    if scales is None:
        return (indices.shape[1], x.shape[1], _code(x.dtype), -1, -1)
    return (indices.shape[1], x.shape[1], _code(x.dtype), scales.shape[1], _code(scales.dtype))


def _combine_layout(y: Tensor, handle: NvlinkHandle) -> tuple[int, ...]:
    return (handle.k, y.shape[1], _code(y.dtype), -1, -1)


def _shown(field: str, value: int):
    if field.endswith("dtype"):
        return "none" if value < 0 else _DTYPES[value] if value < len(_DTYPES) else "another dtype"
    return "none" if value < 0 and field == "scale width" else value


def _check_tokens(op: str, arg: str, num_tokens: int, max_tokens: int, where: str) -> None:
    if num_tokens > max_tokens:
        raise ValueError(f"{op}: `{arg}` has {num_tokens} tokens{where}, more than max_tokens_per_rank={max_tokens} "
                         "(the buffers are sized for it); raise max_tokens_per_rank")


def _check_agreed(op: str, arg: str, rows, max_tokens: int) -> None:
    """rows[r] = rank r's layout, then its token count. Every rank's tokens within max_tokens and every
    layout equal to rank 0's, or a ValueError naming the first rank that differs and its value."""
    for r, row in enumerate(rows):
        _check_tokens(op, arg, row[-1], max_tokens, f" on rank {r}" if len(rows) > 1 else "")
    same = "k, hidden size, dtype and scales" if arg == "x" else "hidden size and dtype"
    for r, row in enumerate(rows[1:], 1):
        for field, mine, first in zip(_LAYOUT_FIELDS, row, rows[0]):
            if mine != first:
                raise ValueError(f"{op}: rank {r} passes `{arg}` with {field} {_shown(field, mine)}, rank 0 with "
                                 f"{_shown(field, first)}: every rank must pass the same {same} (they set the layout "
                                 "of the peer buffers)")


def _check_payloads(op: str, xs) -> None:
    for x in xs:
        if x.dtype not in _PAYLOADS:
            raise TypeError(f"{op}: the nvlink kernels move float32, float16, bfloat16, FP8 or uint8 rows, got `x` "
                            f"in {x.dtype}")


def _check_combine(op: str, ys, handles) -> None:
    for r, (y, h) in enumerate(zip(ys, handles)):
        where = f" on rank {r}" if len(ys) > 1 else ""
        if not isinstance(h, NvlinkHandle):
            raise TypeError(f"{op}: `handle` must be the handle of this backend's dispatch, got {type(h).__name__}")
        if not isinstance(y, Tensor) or y.dim() != 2 or y.shape[0] != h.num_rows:
            shape = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"{op}: `y` must be [R, H] with R = {h.num_rows} (dispatch's rows){where}, got {shape}")


def _check_outputs(op: str, ys) -> None:
    for r, y in enumerate(ys):
        if y.dtype not in _OUTPUTS:
            where = f" on rank {r}" if len(ys) > 1 else ""
            raise TypeError(f"{op}: `y` must be float32, float16 or bfloat16{where}, got {y.dtype}")


def _dispatched(out, weights: Tensor) -> Dispatched:
    x_g, row_w, group_sizes, local, g_scales, handle = out
    handle.weights = weights
    d = Dispatched(x_g, row_w, group_sizes, handle, None, None, g_scales)
    d.__dict__["local_indices"] = local  # the cached property, computed by the layout kernel
    return d


def _check_knobs(who: str, max_tokens_per_rank, capacity, num_sms) -> None:
    check_int(who, "max_tokens_per_rank", max_tokens_per_rank, minimum=1)
    if capacity is not None:
        check_int(who, "capacity", capacity, minimum=1)
    check_int(who, "num_sms", num_sms, minimum=1)


class NvlinkDispatcher(GroupDispatcher):
    """The NVLink backend on the ranks of a torch.distributed group within one node (module docstring).

    max_tokens_per_rank: the most tokens one rank passes to dispatch (a larger call raises ValueError);
    sizes the buffers. capacity: expert rows one rank receives at most (None: the worst case, nothing is
    ever dropped). num_sms: thread blocks of the copy kernels (about 20 of an H100's 132 leave the rest to
    overlapping compute). The buffers are allocated at the first dispatch (a collective) and shared by
    every NvlinkDispatcher of the same group and device; `release_buffers(group)` frees them.
    """

    _transports: dict = {}

    def __init__(self, num_experts: int, group=None, *, max_tokens_per_rank: int, capacity: int | None = None,
                 num_sms: int = DEFAULT_NUM_SMS):
        super().__init__(num_experts, group)
        _check_knobs("NvlinkDispatcher", max_tokens_per_rank, capacity, num_sms)
        if self.num_ranks > MAX_RANKS:
            raise ValueError(f"NvlinkDispatcher: at most {MAX_RANKS} ranks, the group has {self.num_ranks}; {_FALLBACK}")
        self.max_tokens_per_rank, self.capacity, self.num_sms = max_tokens_per_rank, capacity, num_sms
        self._engine: _Engine | None = None
        self._agreed: set[tuple] = set()  # layouts every rank of the group passed (module docstring)

    def _engine_for(self, x: Tensor, C) -> _Engine:
        if self._engine is None:
            self._engine = _Engine(self._transport(x, C), self.num_experts, self.max_tokens_per_rank, self.capacity,
                                   self.num_sms)
        return self._engine

    def _transport(self, x: Tensor, C) -> _Transport:
        """The group's peer buffers on x's device: CUDA IPC mappings, made once per group and device."""
        if x.device.type != "cuda":
            raise ValueError(f"NvlinkDispatcher: peer buffers need CUDA tensors on the ranks' GPUs; {_FALLBACK}")
        key = (id(self.group), x.device)
        transport = NvlinkDispatcher._transports.get(key)
        if transport is None:
            transport = NvlinkDispatcher._transports[key] = _IpcTransport(self.group, x.device, C)
        return transport

    def _agree(self, op: str, arg: str, kind: str, layout: tuple[int, ...], num_tokens: int, device) -> None:
        """The layout agreed by every rank of the group: one all_gather of a few integers (and one host
        sync) the first time this dispatcher sees `layout`, nothing after (module docstring)."""
        key = (kind, *layout)
        if key in self._agreed:  # steady state: this rank's own token count, checked on the host
            where = f" on rank {self.rank}" if self.num_ranks > 1 else ""
            _check_tokens(op, arg, num_tokens, self.max_tokens_per_rank, where)
            return
        rows = self._all_gather_ints([*layout, num_tokens], device)
        _check_agreed(op, arg, rows, self.max_tokens_per_rank)
        self._agreed.add(key)

    def _all_gather_ints(self, values: list[int], device) -> list[list[int]]:
        """Every rank's `values`, indexed by rank in the group."""
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows).tolist()

    def dispatch(self, x, weights, indices, *, align=1, scales=None) -> Dispatched:
        op = "NvlinkDispatcher.dispatch"
        indices = self._check(x, weights, indices, align, scales)
        C = _kernels(x, "NvlinkDispatcher")
        self._agree(op, "x", "dispatch", _dispatch_layout(x, indices, scales), x.shape[0], x.device)
        _check_payloads(op, [x])
        engine = self._engine_for(x, C)
        box: list = []
        _DispatchFn.apply(engine, C, box, align, 1, x.contiguous(), weights, indices.contiguous(),
                          None if scales is None else scales.contiguous())
        return _dispatched(box[0], weights)

    def combine(self, y: Tensor, handle: NvlinkHandle, *, weighted: bool = True) -> Tensor:
        """y [R, H]: the expert outputs of dispatch's rows (rows past the groups are never read)."""
        op = "NvlinkDispatcher.combine"
        _check_combine(op, [y], [handle])
        self._agree(op, "y", "combine", _combine_layout(y, handle), 0, y.device)
        _check_outputs(op, [y])
        (out,) = _CombineFn.apply(self._engine, _ext.kernels("nvlink dispatch", y), [handle], weighted, 1, y,
                                  handle.weights)
        return out

    def dropped_tokens(self) -> int:
        """Token copies dropped for capacity since the last call (warns when any); syncs."""
        return 0 if self._engine is None else self._engine.dropped_tokens()

    @classmethod
    def release_buffers(cls, group=None) -> None:
        """Free the peer buffers of `group`'s dispatchers (on every device), in the teardown order of the
        module docstring. Collective: every rank of the group calls it, while the group is alive (before
        destroy_process_group). A later dispatch allocates them again."""
        for (group_id, _), transport in list(cls._transports.items()):
            if group_id == id(group):
                transport.close()


class VirtualNvlinkWorld:
    """P ranks of the NVLink backend in one process on one device (module docstring).

    dispatch(xs, weights, indices) takes every rank's tensors (lists indexed by rank) and returns every
    rank's `Dispatched`; combine(ys, handles) returns every rank's output. Both are differentiable, as one
    autograd node for all ranks.
    """

    def __init__(self, num_experts: int, num_ranks: int, *, max_tokens_per_rank: int, capacity: int | None = None,
                 num_sms: int = DEFAULT_NUM_SMS, device="cuda"):
        check_int("VirtualNvlinkWorld", "num_ranks", num_ranks, minimum=1, maximum=MAX_RANKS)
        _check_knobs("VirtualNvlinkWorld", max_tokens_per_rank, capacity, num_sms)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_ranks = num_ranks
        self.dispatchers = [NvlinkVirtualRank(num_experts, num_ranks, r) for r in range(num_ranks)]
        self.engine = _Engine(_VirtualTransport(num_ranks, self.device), num_experts, max_tokens_per_rank, capacity,
                              num_sms)

    def dispatch(self, xs, weights, indices, *, align: int = 1, scales=None) -> list[Dispatched]:
        P = self.num_ranks
        scales = [None] * P if scales is None else list(scales)
        if not (len(xs) == len(weights) == len(indices) == len(scales) == P):
            raise ValueError(f"VirtualNvlinkWorld.dispatch: pass one tensor per rank ({P}) in each list")
        for x in xs:
            if x.device != self.device:
                raise ValueError(f"VirtualNvlinkWorld.dispatch: `x` is on {x.device}, the world on {self.device}")
        C = _kernels(xs[0], "VirtualNvlinkWorld")
        checked = [self.dispatchers[r]._check(xs[r], weights[r], indices[r], align, scales[r]) for r in range(P)]
        op = "VirtualNvlinkWorld.dispatch"
        _check_agreed(op, "x", [(*_dispatch_layout(x, i, s), x.shape[0]) for x, i, s in zip(xs, checked, scales)],
                      self.engine.M)
        _check_payloads(op, xs)
        box: list = []
        _DispatchFn.apply(self.engine, C, box, align, P, *[x.contiguous() for x in xs], *weights,
                          *[i.contiguous() for i in checked],
                          *[None if s is None else s.contiguous() for s in scales])
        return [_dispatched(o, w) for o, w in zip(box, weights)]

    def combine(self, ys, handles, *, weighted: bool = True) -> list[Tensor]:
        P = self.num_ranks
        if len(ys) != P or len(handles) != P:
            raise ValueError(f"VirtualNvlinkWorld.combine: pass one tensor and one handle per rank ({P})")
        op = "VirtualNvlinkWorld.combine"
        _check_combine(op, ys, handles)
        _check_agreed(op, "y", [(*_combine_layout(y, h), 0) for y, h in zip(ys, handles)], self.engine.M)
        _check_outputs(op, ys)
        C = _kernels(ys[0], "VirtualNvlinkWorld")
        return list(_CombineFn.apply(self.engine, C, list(handles), weighted, P, *ys, *[h.weights for h in handles]))

    def dropped_tokens(self) -> int:
        return self.engine.dropped_tokens()


class NvlinkVirtualRank(Dispatcher):
    """Rank r's view (its expert range and argument checks); the world moves the data."""

    def dispatch(self, *a, **kw):
        raise TypeError("a virtual rank dispatches through VirtualNvlinkWorld.dispatch (all ranks at once)")

    def combine(self, *a, **kw):
        raise TypeError("a virtual rank combines through VirtualNvlinkWorld.combine (all ranks at once)")
