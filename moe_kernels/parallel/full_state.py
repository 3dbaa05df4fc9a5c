"""Full (one-process) state dicts of a parallelize()d model and its optimizer, and back.

`full_state(par, optimizer)` gathers, on rank 0, the model's and the optimizer's state dicts in the format
one process would write (the unsplit model's parameter names and shapes, the optimizer's states by index),
so a checkpoint saved under one layout loads under any other, or in one process: every parameter's FSDP
shards are gathered (DTensor.full_tensor), then its tensor-parallel slices (the dimension the split
recorded), its etp slices (the gate and up rows separately for w13, the columns of w2) and its experts over
the ep group. `load_full_state(par, optimizer, model_state, optim_state)` cuts every rank's pieces out of
full state dicts. Every rank calls both, in the same order; the full tensors pass through every rank's
memory one at a time (rank 0 keeps them, on the CPU), which suits the sizes one node trains, not a
sharded checkpoint format (moe_kernels.parallel.checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

# A split from the full tensor to a rank's piece: (kind, group, dim); kind "dim" (chunk `dim` over the
# group) or "gate_up" (w13's gate rows and up rows, each chunked over the group).
Split = tuple[str, Any, int]


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def splits_of(model: nn.Module, tp_group=None) -> dict[str, list[Split]]:
    """name -> the splits from the full tensor to this rank's logical tensor, outermost first (parameters
    not listed are whole on every rank, apart from FSDP's shards)."""
    from moe_kernels.nn import MoELayer
    from moe_kernels.parallel.expert_parallel import ExpertTensorParallelDispatcher
    from moe_kernels.parallel.tensor_parallel import SPLIT_DIMS

    out: dict[str, list[Split]] = {}
    for mname, m in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for pname, dim in m.__dict__.get(SPLIT_DIMS, {}).items():
            out[prefix + pname] = [("dim", tp_group, dim)]
        if isinstance(m, MoELayer) and m.dispatcher is not None:
            d, etp_group = m.dispatcher, None
            if isinstance(d, ExpertTensorParallelDispatcher):
                d, etp_group = d.inner, d.group
            ep = [("dim", d.group, 0)] if d.num_ranks > 1 else []
            out[f"{prefix}experts.w13"] = ep + ([("gate_up", etp_group, 1)] if etp_group is not None else [])
            out[f"{prefix}experts.w2"] = ep + ([("dim", etp_group, 2)] if etp_group is not None else [])
    return out


def _gather(t: Tensor, splits: list[Split]) -> Tensor:
    if _is_dtensor(t):
        t = t.full_tensor()
    for kind, group, dim in reversed(splits):  # the innermost split first
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        if kind == "gate_up":
            halves = [p.chunk(2, dim) for p in parts]
            t = torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
        else:
            t = torch.cat(parts, dim)
    return t


def _piece(full: Tensor, splits: list[Split]) -> Tensor:
    for kind, group, dim in splits:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if kind == "gate_up":
            gate, up = full.chunk(2, dim)
            full = torch.cat([gate.chunk(n, dim)[r], up.chunk(n, dim)[r]], dim)
        else:
            full = full.chunk(n, dim)[r]
    return full


def _full_shape(local: tuple, splits: list[Split]) -> tuple:
    """The full tensor's shape from this rank's logical shape."""
    shape = list(local)
    for _, group, dim in splits:
        shape[dim] *= dist.get_world_size(group)
    return tuple(shape)


def _check_shape(what: str, full: Tensor, local: tuple, splits: list[Split]) -> None:
    # Checked against the full shape (the same on every rank), so every rank raises or none does.
    want = _full_shape(local, splits)
    if tuple(full.shape) != want:
        raise ValueError(f"load_full_state: {what} has shape {tuple(full.shape)}; this layout's model needs {want}")


def _place(piece: Tensor, like: Tensor) -> Tensor:
    """`piece` (this rank's logical tensor) laid out as `like`: its FSDP shard for a DTensor."""
    piece = piece.to(device=like.device, dtype=like.dtype)
    if _is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(piece, like.device_mesh, like.placements, src_data_rank=None)
    return piece.contiguous()


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter name for each index of optimizer.state_dict()['state'] (the order of its groups)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _scalar(v: Any) -> Any:
    """A 0-d optimizer state (Adam's step) as a copy: the optimizer keeps updating its own in place."""
    if not torch.is_tensor(v):
        return v
    return (v.full_tensor() if _is_dtensor(v) else v).detach().cpu().clone()


def full_state(par, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None] | None:
    """(model state dict, optimizer state dict or None) of the full model on rank 0 (CPU tensors); None on
    the other ranks. Every rank must call it."""
    splits = splits_of(par.model, None if par.sharding is None else par.sharding.tp_group)
    main = dist.get_rank() == 0

    def full(t: Tensor, name: str) -> Tensor | None:
        t = _gather(t.detach(), splits.get(name, []))
        return t.cpu().clone() if main else None

    model_state = {k: full(v, k) for k, v in par.model.state_dict().items()}
    optim_state = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        names = optimizer_names(par.model, optimizer)
        state = {}
        for index, entry in sd["state"].items():
            state[index] = {k: (full(v, names[index]) if torch.is_tensor(v) and v.ndim > 0 else _scalar(v))
                            for k, v in entry.items()}
        optim_state = {**sd, "state": state}
    return (model_state, optim_state) if main else None


@torch.no_grad()
def load_full_state(par, optimizer: torch.optim.Optimizer | None, model_state: dict, optim_state: dict | None) -> None:
    """Loads full (one-process) state dicts: every rank keeps its pieces."""
    splits = splits_of(par.model, None if par.sharding is None else par.sharding.tp_group)
    own = par.model.state_dict()
    missing = sorted(set(own) - set(model_state))
    unexpected = sorted(set(model_state) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_state: the state dict does not fit the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    names = params = None
    if optimizer is not None and optim_state is not None:
        names = optimizer_names(par.model, optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if len(optim_state["state"]) > len(params):
            raise ValueError(f"load_full_state: the optimizer state holds {len(optim_state['state'])} parameters, "
                             f"the optimizer {len(params)}")
    # Every shape first: nothing is loaded unless everything fits.
    for name, t in own.items():
        _check_shape(name, model_state[name], tuple(t.shape), splits.get(name, []))
    if params is not None:
        for index, entry in optim_state["state"].items():
            i = int(index)
            for k, v in entry.items():
                if torch.is_tensor(v) and v.ndim > 0:
                    _check_shape(f"the optimizer's {k} of {names[i]}", v, tuple(params[i].shape),
                                 splits.get(names[i], []))
    for name, t in own.items():
        value = _place(_piece(model_state[name], splits.get(name, [])), t)
        (t.to_local() if _is_dtensor(t) else t).copy_(value.to_local() if _is_dtensor(value) else value)
    if params is None:
        return
    state = {}
    for index, entry in optim_state["state"].items():
        i = int(index)
        p = params[i]
        state[index] = {k: (_place(_piece(v, splits.get(names[i], [])), p) if torch.is_tensor(v) and v.ndim > 0 else v)
                        for k, v in entry.items()}
    optimizer.load_state_dict({**optim_state, "state": state})
