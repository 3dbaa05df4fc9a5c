"""Full (one-process) state dicts of a parallelize()d model and its optimizer, and back.

`full_state(par, optimizer)` gathers, on rank 0, the model's and the optimizer's state dicts in the format
one process would write (the unsplit model's parameter names and shapes, the optimizer's states by index),
so a checkpoint saved under one layout loads under any other, or in one process: every parameter's FSDP
shards are gathered (DTensor.full_tensor), then its tensor-parallel slices (the dimension the split
recorded), its etp slices (the gate and up rows separately for a gated w13, the rows of one without a gate, the
columns of w2) and its experts over
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
    from moe_kernels.nn.lora import experts_path, unwrapped
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
            experts = prefix + experts_path(m)  # (inside adapter wrappers: experts.base_layer...)
            gated = unwrapped(m.experts).gated
            # w13's etp slice: gate rows and up rows each chunked (SwiGLU), or its rows chunked (no gate)
            out[f"{experts}.w13"] = ep + ([("gate_up" if gated else "dim", etp_group, 1)] if etp_group is not None
                                          else [])
            out[f"{experts}.w2"] = ep + ([("dim", etp_group, 2)] if etp_group is not None else [])
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
    the other ranks. Every rank must call it. The optimizer's state dict also lists the parameter of each
    index under "param_names" (the full model's names), so any layout, pipeline stages included, finds its own.
    With pipeline parallelism each stage gathers its part on its first rank, which sends it to rank 0."""
    splits = splits_of(par.model, None if par.sharding is None else par.sharding.tp_group)
    stage_group = getattr(par, "stage_group", None)
    main = dist.get_rank(stage_group) == 0 if stage_group is not None else dist.get_rank() == 0

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
        optim_state = {**sd, "state": state, "param_names": names}
    if not main:
        return None
    pipeline = getattr(par, "pipeline", None)
    if pipeline is None:
        return model_state, optim_state
    # The stages' first ranks send their parts to rank 0 one stage at a time, tensor by tensor (through the
    # device for NCCL: one tensor there at a time, not a pickled stage).
    group, device = pipeline.group, device_of(par.model)
    if dist.get_rank() != 0:
        _send_part((model_state, optim_state), 0, group, device)
        return None
    parts = [(model_state, optim_state)]
    for s in range(1, dist.get_world_size(group)):
        parts.append(_recv_part(dist.get_global_rank(group, s), group, device))
    return _merge_stages(parts, par.full_names)


class _Slot:
    """A tensor's place in a part's skeleton (sent as an object; the tensor follows on its own)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _walk(x, leaf):
    if isinstance(x, dict):
        return {k: _walk(v, leaf) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_walk(v, leaf) for v in x)
    return leaf(x)


def _object_device(device: torch.device):
    return device if device.type == "cuda" else None


def _send_part(part, dst: int, group, device: torch.device) -> None:
    tensors: list[Tensor] = []

    def leaf(x):
        if torch.is_tensor(x):
            tensors.append(x)
            return _Slot(x.shape, x.dtype)
        return x

    dist.send_object_list([_walk(part, leaf)], dst=dst, group=group, device=_object_device(device))
    for t in tensors:
        dist.send(t.to(device).contiguous(), dst=dst, group=group)


def _recv_part(src: int, group, device: torch.device):
    box = [None]
    dist.recv_object_list(box, src=src, group=group, device=_object_device(device))

    def leaf(x):
        if isinstance(x, _Slot):
            t = torch.empty(x.shape, dtype=x.dtype, device=device)
            dist.recv(t, src=src, group=group)
            return t.cpu()
        return x

    return _walk(box[0], leaf)


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's (local) parameters."""
    p = next(model.parameters())
    return p.to_local().device if _is_dtensor(p) else p.device


def model_from_state(config, state: dict) -> nn.Module:
    """A moe_kernels model of `config` holding the tensors of a full state dict (built on the meta device, the
    tensors assigned, not copied)."""
    from moe_kernels.models import build_model

    model = build_model(config, device="meta")
    model.load_state_dict(state, assign=True)
    return model


def _merge_stages(parts: list, full_names: list[str]) -> tuple[dict, dict | None]:
    """One state dict pair from the pipeline stages' (model, optimizer) parts: the model's entries in the full
    model's order, the optimizer's indexed as one process's optimizer with the same groups would index them
    (group by group, each group's parameters in the model's order)."""
    order = {n: i for i, n in enumerate(full_names)}
    model_state: dict = {}
    for m, _ in parts:
        model_state.update(m)
    model_state = dict(sorted(model_state.items(), key=lambda kv: order.get(kv[0], len(order))))
    optims = [o for _, o in parts]
    if optims[0] is None:
        return model_state, None
    groups = len(optims[0]["param_groups"])
    if any(len(o["param_groups"]) != groups for o in optims):
        raise ValueError("full_state: the pipeline stages' optimizers have different numbers of parameter groups")
    names, entries, param_groups = [], {}, []
    for g in range(groups):
        members = []
        for o in optims:
            for i in o["param_groups"][g]["params"]:
                members.append(o["param_names"][i])
                if i in o["state"]:
                    entries[o["param_names"][i]] = o["state"][i]
        members.sort(key=lambda n: order.get(n, len(order)))
        first = len(names)
        names += members
        hyper = {k: v for k, v in optims[0]["param_groups"][g].items() if k != "params"}
        param_groups.append({**hyper, "params": list(range(first, len(names)))})
    state = {i: entries[n] for i, n in enumerate(names) if n in entries}
    return model_state, {"state": state, "param_groups": param_groups, "param_names": names}


@torch.no_grad()
def load_full_state(par, optimizer: torch.optim.Optimizer | None, model_state: dict, optim_state: dict | None) -> None:
    """Loads full (one-process) state dicts: every rank keeps its pieces (with pipeline parallelism, its
    stages'). The optimizer's entries are found by parameter name when the state dict lists them
    ("param_names"), else by index (the same model's order)."""
    splits = splits_of(par.model, None if par.sharding is None else par.sharding.tp_group)
    own = par.model.state_dict()
    known = set(getattr(par, "full_names", None) or own)
    missing = sorted(set(own) - set(model_state))
    unexpected = sorted(set(model_state) - known)
    if missing or unexpected:
        raise KeyError(f"load_full_state: the state dict does not fit the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    names = params = source = None
    if optimizer is not None and optim_state is not None:
        names = optimizer_names(par.model, optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_names = optim_state.get("param_names")
        if saved_names is not None:
            position = {n: i for i, n in enumerate(saved_names)}
            absent = [n for n in names if n not in position]
            if absent:
                raise KeyError(f"load_full_state: the optimizer state has no entries for {absent[:5]}")
            source = [position[n] for n in names]
        elif getattr(par, "pipeline", None) is not None:
            raise ValueError("load_full_state: a pipeline stage finds its optimizer entries by parameter name; this "
                             "optimizer state dict has no 'param_names'")
        else:
            if len(optim_state["state"]) > len(params):
                raise ValueError(f"load_full_state: the optimizer state holds {len(optim_state['state'])} parameters, "
                                 f"the optimizer {len(params)}")
            source = list(range(len(params)))
        if len(optim_state["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"load_full_state: the optimizer state has {len(optim_state['param_groups'])} parameter "
                             f"groups, the optimizer {len(optimizer.param_groups)}")
    # Every shape first: nothing is loaded unless everything fits.
    for name, t in own.items():
        _check_shape(name, model_state[name], tuple(t.shape), splits.get(name, []))
    if params is not None:
        for i, j in enumerate(source):
            for k, v in optim_state["state"].get(j, {}).items():
                if torch.is_tensor(v) and v.ndim > 0:
                    _check_shape(f"the optimizer's {k} of {names[i]}", v, tuple(params[i].shape),
                                 splits.get(names[i], []))
    for name, t in own.items():
        value = _place(_piece(model_state[name], splits.get(name, [])), t)
        (t.to_local() if _is_dtensor(t) else t).copy_(value.to_local() if _is_dtensor(value) else value)
    if params is None:
        return
    state = {}
    for i, j in enumerate(source):
        if j in optim_state["state"]:
            p = params[i]
            state[i] = {k: (_place(_piece(v, splits.get(names[i], [])), p) if torch.is_tensor(v) and v.ndim > 0 else v)
                        for k, v in optim_state["state"][j].items()}
    own_groups = optimizer.state_dict()["param_groups"]
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": mine["params"]}
              for saved, mine in zip(optim_state["param_groups"], own_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
