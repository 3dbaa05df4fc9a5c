"""Sharded checkpoints of a parallelize()d model with torch.distributed.checkpoint (DCP): every rank writes
its own shards, and a checkpoint saved under one layout loads under any other (FSDP over 4 ranks, HSDP
2 x 2, TP 2 x FSDP 2 with experts EP 2 x ETP 2, ...) or into one process's model: DCP reshards.

    save_sharded(par, optimizer, "ckpt/step_100")          # every rank calls it
    load_sharded(par, optimizer, "ckpt/step_100")          # into a model parallelized the same way or not
    load_sharded(model, None, "ckpt/step_100")             # one process, no process group: the full model

A save is atomic: every rank writes into `path`.tmp, which rank 0 renames to `path` after all have written
(a crash leaves the previous checkpoint whole; a re-save replaces the directory, never mixes two saves).

With pipeline parallelism each rank writes its stages' tensors (under the full model's names), so a
checkpoint of pipeline stages loads under any layout, with or without them, and the other way round. The
optimizer's parameter groups are stored by their settings (lr, betas, ...), each rank keeping its own
parameter lists.

What a checkpoint holds: every parameter (and its optimizer states) under the unsplit model's name, as one
global tensor of the unsplit model's shape, each rank's shard placed in it. The tensor-parallel slices,
the experts of an ep rank and their etp slices are plain local tensors in the model (tensor_parallel,
expert_parallel), FSDP-sharded over their data-parallel ranks; here each becomes a DTensor over a mesh of
the same ranks whose outer dimensions are the splits (tp: the dimension it split; ep: the experts; etp:
the ffn slice) and whose inner ones are FSDP's (an outer replicated dimension where ranks hold the same
piece without FSDP: the expert data-parallel replicas of moe-train's expert-parallel path), so DCP knows
where every shard sits. One exception to the
model's shapes: a GroupedExperts' w13 [E, 2F, H] is stored as [E, 2, F, H] (gate, up), where an etp slice,
rows of the gate and rows of the up projection, is one block. Those meshes are bookkeeping for DCP only
(no process groups are created for them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.parallel.full_state import _full_shape, _is_dtensor, splits_of

def _model_of(par) -> nn.Module:
    return par if isinstance(par, nn.Module) else par.model


def _splits(par) -> dict:
    if isinstance(par, nn.Module):
        return {}
    return splits_of(par.model, None if par.sharding is None else par.sharding.tp_group)


def _gate_up_names(model: nn.Module) -> set[str]:
    """The w13 parameters of gated GroupedExperts, stored as [E, 2, F, H] (squared-ReLU experts' as they are)."""
    from moe_kernels.nn import GroupedExperts

    return {f"{name}.w13" if name else "w13" for name, m in model.named_modules()
            if isinstance(m, GroupedExperts) and m.gated}


def _check_experts(model: nn.Module, splits: dict) -> None:
    from moe_kernels.nn import MoELayer
    from moe_kernels.nn.lora import experts_path, unwrapped

    for name, m in model.named_modules():
        if isinstance(m, MoELayer) and m.dispatcher is not None:
            prefix = f"{name}.{experts_path(m)}." if name else f"{experts_path(m)}."  # (inside adapter wrappers)
            other = [prefix + n for n, _ in unwrapped(m.experts).named_parameters() if prefix + n not in splits]
            if other:
                raise NotImplementedError(f"sharded checkpoints: the expert-parallel experts hold parameters the "
                                          f"checkpoint cannot place ({other[:3]})")


class _Meshes:
    """The DCP meshes of the split tensors: (split groups..., the FSDP mesh's dimensions...) over the same
    ranks. Every rank lists what it needs in the same order (the state dicts' order), then one all-gather
    of every rank's coordinates lays them out."""

    def __init__(self):
        self.keys: list = []
        self.coords: list = []
        self.sizes: list = []
        self.device_types: list = []
        self.meshes: dict = {}

    @staticmethod
    def key(splits, fsdp_mesh):
        return tuple(id(group) for _, group, _ in splits), None if fsdp_mesh is None else id(fsdp_mesh)

    def need(self, splits, fsdp_mesh, device_type: str) -> None:
        k = self.key(splits, fsdp_mesh)
        if k in self.keys:
            return
        self.keys.append(k)
        groups = [group for _, group, _ in splits]
        coords = [dist.get_rank(g) for g in groups] + ([] if fsdp_mesh is None else list(fsdp_mesh.get_coordinate()))
        sizes = [dist.get_world_size(g) for g in groups] + ([] if fsdp_mesh is None else list(fsdp_mesh.shape))
        self.coords.append(coords)
        self.sizes.append(sizes)
        self.device_types.append(device_type)

    def build(self, group=None) -> None:
        """group: the ranks that hold the same tensors (a pipeline stage's; None: the world). Ranks holding the
        same piece (the expert data-parallel replicas of a model without FSDP) make an outer replicated
        dimension."""
        from torch.distributed.device_mesh import DeviceMesh

        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.coords, group=group)
        for i, k in enumerate(self.keys):
            pieces = max(1, int(torch.tensor(self.sizes[i]).prod()))
            replicas = len(everyone) // pieces
            ranks = torch.full([replicas, *self.sizes[i]], -1, dtype=torch.int64)
            seen: dict[tuple, int] = {}
            for r, coords in enumerate(everyone):
                where = tuple(coords[i])
                copy = seen.get(where, 0)
                seen[where] = copy + 1
                if copy < replicas:
                    ranks[(copy, *where)] = r if group is None else dist.get_global_rank(group, r)
            if replicas * pieces != len(everyone) or bool((ranks < 0).any()):
                raise RuntimeError(f"sharded checkpoints: the split groups and FSDP mesh (sizes {self.sizes[i]}) do "
                                   f"not tile the {len(everyone)} ranks")
            self.meshes[k] = DeviceMesh(self.device_types[i], ranks if replicas > 1 else ranks[0], _init_backend=False)

    def get(self, splits, fsdp_mesh):
        return self.meshes[self.key(splits, fsdp_mesh)]


def _global_view(t: Tensor, splits: list, gate_up: bool, meshes: _Meshes):
    """`t` (this rank's parameter or optimizer state: an FSDP DTensor or a plain tensor) as DCP should store
    it: a view of its storage, in the checkpoint's global shape."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not splits and not gate_up:
        return t
    dtensor = _is_dtensor(t)
    fsdp_mesh = t.device_mesh if dtensor else None
    local = t.to_local() if dtensor else t
    full = list(_full_shape(tuple(t.shape), splits))
    shift = (lambda d: d if d == 0 else d + 1) if gate_up else (lambda d: d)
    placements = [Shard(shift(d)) for _, _, d in splits]
    if dtensor:
        for p in t.placements:
            placements.append(Shard(shift(p.dim)) if isinstance(p, Shard) else p)
    if gate_up:
        E, F2, H = full
        if F2 % 2 or local.shape[1] % 2:
            raise ValueError(f"sharded checkpoints: w13 of shape {tuple(t.shape)} has no gate and up halves")
        full = [E, 2, F2 // 2, H]
        local = local.view(local.shape[0], 2, local.shape[1] // 2, local.shape[2])
    if not placements:  # one process: a plain tensor, viewed
        return local
    mesh = meshes.get(splits, fsdp_mesh) if splits else fsdp_mesh
    if mesh.ndim > len(placements):  # the replicas of this piece
        placements = [Replicate()] * (mesh.ndim - len(placements)) + placements
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(full),
                              stride=torch.empty(full, device="meta").stride())


def _state(par, optimizer) -> tuple[dict, dict]:
    """(the state dicts, as get_state_dict gives them: this rank's tensors by name; the same in the checkpoint's
    global views, for DCP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model_of(par)
    splits = _splits(par)
    _check_experts(model, splits)
    gate_up = _gate_up_names(model)
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}

    def entries():
        for name, t in model_sd.items():
            yield model_sd, name, name, t
        if optimizer is not None:
            for name, entry in optim_sd["state"].items():
                for k, v in entry.items():
                    if torch.is_tensor(v) and v.ndim > 0:
                        yield entry, k, name, v

    items = list(entries())
    meshes = _Meshes()
    distributed = dist.is_available() and dist.is_initialized()
    for _, _, name, t in items:
        if splits.get(name):
            meshes.need(splits[name], t.device_mesh if _is_dtensor(t) else None,
                        (t.to_local() if _is_dtensor(t) else t).device.type)
    if distributed and splits:  # (every rank of a stage has splits, or none has)
        meshes.build(getattr(par, "stage_group", None))
    views = {"model": dict(model_sd)}
    if optimizer is not None:
        # The groups' settings without their parameter lists: those differ between pipeline stages, and DCP
        # keeps one rank's copy of a non-tensor entry. Every rank keeps its own lists (get_state_dict's).
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optim_sd["param_groups"]]
        views["optim"] = {"state": {n: dict(e) for n, e in optim_sd["state"].items()}, "param_groups": groups}
    for container, key, name, t in items:
        target = views["model"] if container is model_sd else views["optim"]["state"][name]
        target[key] = _global_view(t, splits.get(name, []), name in gate_up, meshes)
    return state, views


EXTRA = "extra.pt"  # what save_sharded's `extra` holds, in the checkpoint directory


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(par, optimizer: torch.optim.Optimizer | None, path: str | Path, *, extra: dict | None = None) -> None:
    """Writes the model's (and the optimizer's) shards of every rank under `path` (a directory every rank
    sees), atomically: into `path`.tmp, renamed to `path` by rank 0 once every rank has written its shards,
    so a crash leaves no directory mixing shards of two saves (a re-save replaces the old directory whole).
    `extra`: a small picklable dict rank 0 stores beside the shards (read back by `load_extra`). `par`: a
    Parallelized (every rank calls it), an object with its `model` (and `sharding`) attributes, or a model in
    one process."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    main = _is_main()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted save left
        tmp.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    _, views = _state(par, optimizer)
    dcp.save(views, checkpoint_id=str(tmp))  # raises on every rank when any rank failed to write
    if main:
        if extra is not None:
            with open(tmp / EXTRA, "wb") as f:
                torch.save(extra, f)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()  # the directory is in place before any rank goes on


def load_extra(path: str | Path) -> dict | None:
    """The `extra` dict save_sharded stored in `path` (None when it stored none)."""
    f = Path(path) / EXTRA
    return torch.load(f, map_location="cpu", weights_only=False) if f.exists() else None


def load_sharded(par, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Loads `path` into the model (and optimizer), resharding to this layout. `par`: a Parallelized (every
    rank calls it) or a model in one process (without a process group: the full model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, views = _state(par, optimizer)
    dcp.load(views, checkpoint_id=str(path))  # into the views: the state dicts' own storage
    if optimizer is not None:  # the loaded settings (lr, betas, ...) with this rank's parameter lists
        for own, loaded in zip(state["optim"]["param_groups"], views["optim"]["param_groups"]):
            own.update({k: v for k, v in loaded.items() if k != "params"})
    set_state_dict(_model_of(par), optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
