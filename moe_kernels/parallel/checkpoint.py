"""Sharded checkpoints of a parallelize()d model with torch.distributed.checkpoint (DCP): every rank
writes its own shards, and a checkpoint saved under one layout loads under another (FSDP over 4 ranks,
HSDP 2 x 2, ...): DCP reshards the DTensors.

    save_sharded(par, optimizer, "ckpt/step_100")          # every rank calls it
    load_sharded(par, optimizer, "ckpt/step_100")          # into a model parallelized the same way or not

Not yet: expert-parallel layouts (ep > 1 or etp > 1) and tensor-parallel ones (tp > 1). Their experts and slices are
plain local tensors per rank (FSDP-sharded over the data-parallel ranks only), so the checkpoint would not
know which experts or which slice a shard holds; they need a DTensor placement over ep and tp first. The
full Hugging Face export (moe_kernels.models.save_hf_checkpoint) works from a full state dict.
"""

from __future__ import annotations

from pathlib import Path

import torch


def _check(par, what: str) -> None:
    if par.layout.ep > 1:
        raise NotImplementedError(f"{what}: sharded checkpoints of expert-parallel layouts (ep={par.layout.ep}) are "
                                  "not implemented yet (their experts are not DTensors over ep)")
    if par.layout.etp > 1:
        raise NotImplementedError(f"{what}: sharded checkpoints of expert-tensor-parallel layouts (etp={par.layout.etp}) "
                                  "are not implemented yet (the experts' ffn slices are not DTensors over etp)")
    if par.layout.tp > 1:
        raise NotImplementedError(f"{what}: sharded checkpoints of tensor-parallel layouts (tp={par.layout.tp}) are "
                                  "not implemented yet (the tensor-parallel slices are not DTensors over tp)")


def _state(par, optimizer, what: str) -> dict:
    """The model's (and optimizer's) state dicts as DCP sees them: this rank's shards, by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _check(par, what)
    model_sd, optim_sd = get_state_dict(par.model, optimizer if optimizer is not None else [])
    return {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}


def save_sharded(par, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Writes the model's (and the optimizer's) shards of every rank under `path` (a shared directory)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(par, optimizer, "save_sharded"), checkpoint_id=str(path))


def load_sharded(par, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Loads `path` into the model (and optimizer), resharding to this layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(par, optimizer, "load_sharded")
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(par.model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
