"""Data + expert parallel training on torch.distributed (torchrun), for the Trainer.

W ranks each train on their own slice of the global batch (batch_size per rank); the experts of every MoE
layer are spread over expert-parallel groups of P consecutive ranks (P divides W), the rest of the model
is replicated. Ranks holding the same experts form the expert-data-parallel groups. The model is built on
the meta device and each rank materialises its experts only (shard_model). Checkpoints are sharded (every
rank writes its shards: moe_kernels.parallel.checkpoint) or, with save_full, the full state gathered to
rank 0 (`full_state` below); either way a run saved with one layout resumes with another, or on one
process (--out on a file system every rank sees).

The routing losses are computed on each rank's own tokens, as Megatron-Core does per micro-batch: the
global load-balancing loss of W ranks is the mean of W per-rank losses, not the loss of the global batch
(the sequence-wise loss is per sequence either way).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.parallel import (
    all_reduce_expert_counts,
    apply_expert_parallel,
    expert_parallel_mesh,
    expert_parameters,
)
from moe_kernels.parallel.data_parallel import GradientReducer, grad_squares, scale_grads_
from moe_kernels.parallel.full_state import optimizer_names


@dataclass
class Parallel:
    rank: int
    world: int
    expert_parallel: int
    ep_group: object  # this rank's expert-parallel group (P ranks), None when P == 1
    edp_group: object  # the ranks holding the same experts (W / P ranks), None when W == P
    owns_process_group: bool
    grad_reducer: object = field(default=None, repr=False)  # reduce_gradients' GradientReducer, built on first use

    @property
    def ep_rank(self) -> int:
        return self.rank % self.expert_parallel

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(expert_parallel: int, device: torch.device, *, timeout_minutes: float | None = None) -> Parallel | None:
    """Joins (or starts, under torchrun) the default process group, its collectives timing out after
    `timeout_minutes` (None: torch's default); None for a one-process run."""
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else launched_world()
    if world == 1 and expert_parallel == 1:
        return None
    if world % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} must divide the number of ranks ({world})")
    owns = False
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators and barriers use the current device
    if not initialized:
        # torch.distributed.nn.functional binds the default group into its functions' defaults when first
        # imported (torch imports it lazily, e.g. with torch._dynamo); imported before the group exists,
        # they hold None, so destroy_process_group frees the group and joins its threads before exit.
        import torch.distributed.nn as _early  # noqa: F401  (bound to another name: `torch` stays the module's)

        timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)

        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        owns = True
    rank, world = dist.get_rank(), dist.get_world_size()
    # ("edp", "ep"): rank = edp * P + ep; communicators only for the dimensions larger than one.
    mesh = expert_parallel_mesh(expert_parallel, device.type)
    return Parallel(rank, world, expert_parallel, mesh.ep_group if expert_parallel > 1 else None, mesh.edp_group,
                    owns)


def device_for(parallel_world: int, preference: str | None) -> torch.device:
    """cuda:LOCAL_RANK under torchrun with GPUs (for --device cuda too), else the preference (default:
    cuda when available)."""
    wants_cuda = preference in (None, "cuda") and torch.cuda.is_available()
    if wants_cuda and parallel_world > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if wants_cuda:
        return torch.device("cuda")
    return torch.device(preference or "cpu")


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """True when `ok` holds on every rank (so a failure on one rank stops all of them, not just it)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def broadcast_path(path, device: torch.device):
    """Rank 0's value on every rank (e.g. which checkpoint to resume from)."""
    box = [None if path is None else str(path)]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def shard_model(model: nn.Module, par: Parallel, backend: str = "all_to_all", max_tokens_per_rank: int | None = None,
                *, capacity: float | None = None, device: torch.device | None = None, seed: int | None = None) -> None:
    """Expert parallelism over each rank's group; `max_tokens_per_rank` sizes the nvlink backend's buffers and
    `capacity` (nvlink: a factor of the balanced load max_tokens_per_rank * k rows, None for the worst case)
    bounds its expert rows. A model on the meta device is then materialised on `device`, each rank drawing
    its experts only, from `seed` (moe_kernels.models.init)."""
    from moe_kernels.parallel.parallelize import _capacity_rows

    if capacity is not None and par.expert_parallel == 1:
        raise ValueError(f"capacity={capacity} is the expert-parallel dispatcher's; expert_parallel is 1")
    if par.expert_parallel > 1:
        apply_expert_parallel(model, par.ep_group, backend=backend,
                              max_tokens_per_rank=max_tokens_per_rank if backend == "nvlink" else None,
                              capacity=_capacity_rows(model, capacity, max_tokens_per_rank, backend))
    if next(model.parameters()).device.type == "meta":
        from moe_kernels.parallel.full_state import splits_of

        if device is None or seed is None:
            raise ValueError("shard_model: a model on the meta device needs `device=` and `seed=`")
        model.to_empty(device=device)
        model.init_weights(seed, splits_of(model))


def reduce_gradients(model: nn.Module, par: Parallel, overlap: bool = True) -> None:
    """Averages the gradients over the ranks and sums the routers' expert counts; call it after the step's
    backward. The first call builds `par.grad_reducer` (moe_kernels.parallel.data_parallel.GradientReducer:
    25 MiB buckets; with `overlap`, hooks launch them during the following steps' backward passes); a model
    other than the reducer's gets a new one."""
    reducer = par.grad_reducer
    if reducer is None or reducer.model_ref() is not model:
        if reducer is not None:
            reducer.remove_hooks()
        reducer = par.grad_reducer = GradientReducer(
            model, None, expert_dp_group=par.edp_group if par.expert_parallel > 1 else None, overlap=overlap)
    reducer.reduce()
    all_reduce_expert_counts(model, None)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, par: Parallel) -> Tensor:
    """The global gradient norm of the full model (replicated parameters counted once, every expert shard
    once), and the gradients scaled as torch.nn.utils.clip_grad_norm_ would scale the full model's."""
    sharded = {id(p) for p in expert_parameters(model)}
    dense, experts = [], []
    for p in model.parameters():
        if p.grad is not None:
            (experts if id(p) in sharded else dense).append(p.grad)
    device = (dense or experts)[0].device if dense or experts else torch.device("cpu")
    expert_sq = grad_squares(experts, device)
    if par.expert_parallel > 1:
        dist.all_reduce(expert_sq, group=par.ep_group)
    norm = (grad_squares(dense, device) + expert_sq).sqrt()
    scale_grads_(dense + experts, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def mean_over_ranks(values: Tensor) -> Tensor:
    out = values.detach().clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


# -- full checkpoints from expert shards ------------------------------------------------------------


def _expert_names(model: nn.Module) -> set[str]:
    ids = {id(p) for p in expert_parameters(model)}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def _gather_experts(t: Tensor, par: Parallel) -> Tensor | None:
    """The full tensor on rank 0 (on the CPU, one tensor at a time so the GPU holds one extra tensor at
    most); None elsewhere. Only rank 0's expert-parallel group takes part (the others hold replicas)."""
    if par.rank >= par.expert_parallel:
        return None
    parts = [torch.empty_like(t) for _ in range(par.expert_parallel)] if par.rank == 0 else None
    dist.gather(t.contiguous(), parts, dst=0, group=par.ep_group)
    return torch.cat([p.cpu() for p in parts]) if parts is not None else None


def _slice_experts(t: Tensor, par: Parallel) -> Tensor:
    n = t.shape[0] // par.expert_parallel
    return t[par.ep_rank * n : (par.ep_rank + 1) * n].clone()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, par: Parallel) -> tuple[dict, dict] | None:
    """Model and optimizer state dicts of the full model on rank 0 (expert tensors gathered to its CPU);
    None on the other ranks. Every rank must call it."""
    experts = _expert_names(model)
    model_state = {k: (_gather_experts(v, par) if k in experts else v) for k, v in model.state_dict().items()}
    opt_state = optimizer.state_dict()
    names = optimizer_names(model, optimizer)
    state = {}
    for index, entry in opt_state["state"].items():
        if names[index] in experts:
            entry = {k: (_gather_experts(v, par) if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in entry.items()}
        state[index] = entry
    return (model_state, {**opt_state, "state": state}) if par.is_main else None


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, opt_state: dict,
                    par: Parallel) -> None:
    """Loads full state dicts into an expert-parallel model: each rank keeps its experts' slices."""
    experts = _expert_names(model)
    model.load_state_dict({k: (_slice_experts(v, par) if k in experts else v) for k, v in model_state.items()})
    names = optimizer_names(model, optimizer)
    state = {}
    for index, entry in opt_state["state"].items():
        if names[int(index)] in experts:
            entry = {k: (_slice_experts(v, par) if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in entry.items()}
        state[index] = entry
    optimizer.load_state_dict({**opt_state, "state": state})
