"""Data parallelism for the replicated parts of a (possibly expert-parallel) model.

Every rank of the data-parallel group trains on its own batch; the loss of a step is the mean of the
ranks' losses. So each gradient is divided by the group's size W after summing:
- replicated parameters (embeddings, attention, routers, shared experts): summed over the group;
- expert-parallel parameters (`apply_expert_parallel`): the dispatcher's backward already brought the
  gradients of every rank of the expert group that routed tokens to them, so they are summed only over
  `expert_dp_group`, the ranks that hold the same experts (None when each expert lives on one rank).
Call it between backward() and the optimizer step.

Gradients travel in buckets of at most `BUCKET_BYTES` (DDP's 25 MiB), formed in reverse parameter order
(the order the backward produces them), one kind, device and dtype each: one collective per bucket, and
the only extra memory one bucket's buffer. `GradientReducer` keeps the buckets and, with `overlap`, launches
each bucket's all_reduce from post-accumulate-grad hooks as soon as the backward has produced all of its
gradients (buckets strictly in order, so every rank issues the same collectives in the same order), at
most `max_in_flight` at a time; `reduce()` waits for them before the optimizer step. Each element is
summed over the same ranks, then divided by W, as one flat buffer would do it: bit-identical to it on two
ranks; on more, gloo's ring sums an element in an order that depends on its offset in the buffer, so any
other bucketing differs at the last bit.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moe_kernels.nn import MoELayer, Router
from moe_kernels.parallel.expert_parallel import expert_parameters


BUCKET_BYTES = 25 * 2**20


def _by_device_dtype(tensors) -> dict[tuple, list[Tensor]]:
    out: dict[tuple, list[Tensor]] = defaultdict(list)
    for t in tensors:
        out[(t.device, t.dtype)].append(t)
    return out


def _copy_back(flat: Tensor, tensors: list[Tensor]) -> None:
    """`flat` (from _flatten_dense_tensors(tensors)) into `tensors`; nothing to do when it is the one tensor."""
    if len(tensors) > 1 or flat.data_ptr() != tensors[0].data_ptr():
        torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))


def _sum_in_place(tensors: list[Tensor], group) -> None:
    """Sums `tensors` over `group` in place: one all_reduce per device and dtype."""
    for same in _by_device_dtype(tensors).values():
        flat = _flatten_dense_tensors(same)  # (one tensor: a view of it, reduced in place)
        dist.all_reduce(flat, group=group)
        _copy_back(flat, same)


def local_grads(model: nn.Module, expert_modules) -> tuple[list[Tensor], list[Tensor]]:
    """This rank's gradients of `model` as plain local tensors (a DTensor's local shard), split into those of
    the parameters outside and inside `expert_modules` (an iterable of modules)."""
    from torch.distributed.tensor import DTensor

    experts = {id(p) for m in expert_modules for p in m.parameters()}
    dense, expert = [], []
    for p in model.parameters():
        g = p.grad
        if g is not None:
            (expert if id(p) in experts else dense).append(g._local_tensor if isinstance(g, DTensor) else g)
    return dense, expert


def grad_squares(grads: list[Tensor], device: torch.device) -> Tensor:
    """The sum of the squares of every element of `grads` (plain local tensors), in fp32 on `device`: one
    foreach norm per device and dtype, as torch.nn.utils.clip_grad_norm_ computes it."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for same in _by_device_dtype(grads).values():
        norms = torch._foreach_norm(same, 2.0, dtype=torch.float32)
        total += torch.linalg.vector_norm(torch.stack(norms)).square().to(device)
    return total


def scale_grads_(grads: list[Tensor], scale: Tensor) -> None:
    """Multiplies `grads` (plain local tensors) by the fp32 scalar tensor `scale`, as
    torch.nn.utils.clip_grad_norm_ applies its clipping coefficient: one foreach op per device and dtype."""
    for (where, _), same in _by_device_dtype(grads).items():
        torch._foreach_mul_(same, scale.to(where))


class _Bucket:
    __slots__ = ("params", "group", "pending")

    def __init__(self, group):
        self.params: list[nn.Parameter] = []
        self.group = group  # None: no collective (only the division)
        self.pending = 0  # parameters whose gradient the current backward has not produced yet


class GradientReducer:
    """Averages `model`'s gradients over the data-parallel `group` (default: the world) as the module
    docstring says, in buckets of `bucket_bytes`; expert-parallel parameters over `expert_dp_group`.

    overlap=False: `reduce()` after the backward runs the buckets one after the other (one bucket's memory).
    overlap=True: hooks launch each bucket's all_reduce during the backward, in bucket order, at most
    `max_in_flight` at a time (a further one first finishes the oldest); `reduce()` waits for them and runs
    what the backward did not launch (a bucket with a parameter that got no gradient, and every later one).
    Accumulating over several backward passes needs `no_sync()` around all but the last of them.
    Parameters without a gradient are skipped, on every rank alike (the buckets are formed once: parameters
    without a gradient when the reducer is built come last)."""

    def __init__(self, model: nn.Module, group=None, *, expert_dp_group=None, bucket_bytes: int = BUCKET_BYTES,
                 overlap: bool = False, max_in_flight: int = 2):
        self.model_ref = weakref.ref(model)
        self.world = dist.get_world_size(group)
        experts = {id(p) for p in expert_parameters(model)}
        if expert_dp_group is not None and dist.get_world_size(expert_dp_group) == 1:
            expert_dp_group = None
        params = [p for p in model.parameters() if p.requires_grad]
        ordered = [p for p in reversed(params) if p.grad is not None] + [p for p in reversed(params) if p.grad is None]
        self.buckets: list[_Bucket] = []
        open_: dict[tuple, tuple[_Bucket, list]] = {}
        for p in ordered:
            expert = id(p) in experts
            key = (expert, p.device, p.dtype)
            if key not in open_:
                group_of = expert_dp_group if expert else ((group or dist.group.WORLD) if self.world > 1 else None)
                open_[key] = (_Bucket(group_of), [0])
            bucket, size = open_[key]
            bucket.params.append(p)
            size[0] += p.numel() * p.element_size()
            if size[0] >= bucket_bytes:
                self.buckets.append(bucket)
                del open_[key]
        self.buckets += [bucket for bucket, _ in open_.values()]
        self.max_in_flight = max(1, max_in_flight)
        self._in_flight: deque = deque()  # (bucket, grads, buffer, work), in launch order
        self._next = 0  # the first bucket not launched in this backward
        self._where: dict[int, _Bucket] = {}
        self._seen: set[int] = set()
        self._armed = overlap
        self._lock = threading.Lock()  # (the autograd engine runs each device's hooks on its own thread)
        self._handles = []
        if overlap:
            for bucket in self.buckets:
                for p in bucket.params:
                    self._where[id(p)] = bucket
                    self._handles.append(p.register_post_accumulate_grad_hook(self._ready))
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._seen.clear()
        self._next = 0

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without launching collectives."""
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._armed = armed

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._armed = False

    @torch.no_grad()
    def _ready(self, p: Tensor) -> None:
        if not self._armed:
            return
        with self._lock:
            if id(p) in self._seen:
                raise RuntimeError("GradientReducer: a second backward before reduce(); accumulate the gradients "
                                   "of all but the last backward under reducer.no_sync()")
            self._seen.add(id(p))
            self._where[id(p)].pending -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self.buckets[self._next], copy=True)
                self._next += 1
                while len(self._in_flight) > self.max_in_flight:
                    self._finish(*self._in_flight.popleft())

    def _launch(self, bucket: _Bucket, copy: bool) -> None:
        if bucket.group is None:  # divided in reduce()
            return
        grads = [p.grad for p in bucket.params if p.grad is not None]
        if not grads:
            return
        # During the backward the buffer is a copy even for one gradient (nothing else may write to it while
        # the collective runs); after it, one gradient is reduced in place.
        flat = _flatten_dense_tensors(grads)
        if copy and len(grads) == 1:
            flat = flat.clone()
        work = dist.all_reduce(flat, group=bucket.group, async_op=True)
        self._in_flight.append((bucket, grads, flat, work))

    def _finish(self, bucket: _Bucket, grads: list[Tensor], flat: Tensor, work) -> None:
        work.wait()
        if self.world > 1:
            flat.div_(self.world)
        _copy_back(flat, grads)

    @torch.no_grad()
    def reduce(self) -> None:
        """Call after the (last) backward, before the optimizer step: every gradient summed and divided."""
        while self._in_flight:
            self._finish(*self._in_flight.popleft())
        for bucket in self.buckets[self._next:]:  # what the backward did not launch, one bucket at a time
            self._launch(bucket, copy=False)
            if self._in_flight:
                self._finish(*self._in_flight.popleft())
        if self.world > 1:
            local = [p.grad for b in self.buckets if b.group is None for p in b.params if p.grad is not None]
            for same in _by_device_dtype(local).values():
                torch._foreach_div_(same, self.world)
        self._reset()


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, group=None, *, expert_dp_group=None,
                         bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average `model`'s gradients over the data-parallel `group` (default: the world), as described in
    the module docstring, one bucket at a time. Parameters without a gradient are skipped (on every rank
    alike). For overlap with the backward, keep a GradientReducer(overlap=True) instead."""
    GradientReducer(model, group, expert_dp_group=expert_dp_group, bucket_bytes=bucket_bytes).reduce()


@torch.no_grad()
def all_reduce_expert_counts(model: nn.Module, group=None) -> None:
    """Sum every router's accumulated expert counts (`tokens_seen`) over `group`, so that the
    expert-bias update (Router.update_expert_bias) is the same on every rank: one collective for all
    routers (per device and dtype)."""
    counts = [m.tokens_seen for m in model.modules() if isinstance(m, Router) and m.tokens_seen is not None]
    if counts:
        _sum_in_place(counts, group)


def apply_global_load_balancing(model: nn.Module, group=None) -> nn.Module:
    """Global-batch load balancing (Qwen's): every router's aux loss takes the expert frequencies f_e over
    the whole data-parallel batch (its counts summed over `group` in each forward) and the mean scores P_e
    over its own tokens, divided by the group's size. With equal token counts per rank, the mean of the
    ranks' losses is then the aux loss of the global batch. With tensor or context parallelism the group must
    hold every rank of the batches it covers (the default, the world, does). Returns the model."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers:
        raise ValueError("apply_global_load_balancing: the model has no Router")
    if any(isinstance(m, MoELayer) and m.config.backend == "torch" for m in model.modules()):
        raise ValueError("apply_global_load_balancing: the torch-native backend computes its own aux loss")
    for r in routers:
        r.balance_group = group if group is not None else dist.group.WORLD
    return model
