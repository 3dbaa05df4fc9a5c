"""`parallelize(model, ParallelConfig(...))`: sharded data parallelism (FSDP2) folded with expert
parallelism, applied to a finished model from outside (ARCHITECTURE.md, decision 7).

Two meshes over the same W = dp_replicate * dp_shard ranks (moe_kernels.parallel.layout):
  attention  ("dp_replicate", "dp_shard")   rank = replica * dp_shard + shard
  experts    ("edp", "ep")                  rank = edp * ep + ep_rank (ep consecutive ranks of one replica)
Each MoE layer keeps E / ep experts (apply_expert_parallel over "ep", tokens dispatched), FSDP-sharded
over all W / ep ranks of "edp" (the replicas included: expert weights are the bulk of a MoE model);
every other parameter is FSDP-sharded over "dp_shard" (HSDP: replicated over "dp_replicate"), one FSDP
unit per transformer block plus the root.

Gradients: each rank's loss is the mean over its own tokens and the step's objective is the mean over
ranks. FSDP averages the dense gradients over all W ranks. An expert's gradient already sums the
contributions of its EP group's tokens (the dispatcher brought them), so its FSDP reduction, over the
W / ep ranks holding that expert, divides by W instead of its mesh size: the same mean.

Mixed precision: bf16 parameters for compute and fp32 gradient reduction on CUDA (the fp32 master
weights stay sharded); fp32 throughout on the CPU (gloo tests compare with one process).

Not yet: tensor / sequence parallelism (tp), context parallelism (cp), pipeline parallelism (pp) and
expert tensor parallelism (etp) raise NotImplementedError; `moe-train --plan` sizes them already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from moe_kernels.parallel.layout import ParallelConfig


@dataclass
class Parallelized:
    """What parallelize set up: the resolved layout and its meshes, and the global operations on them."""

    model: nn.Module
    layout: ParallelConfig
    attention_mesh: object  # DeviceMesh ("dp_replicate", "dp_shard")
    expert_mesh: object  # DeviceMesh ("edp", "ep")

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The global gradient norm of the full model: every shard's squares summed over all ranks, the
        dense shards' divided by dp_replicate (each replica holds them); expert shards are held once."""
        sq = torch.zeros(2, dtype=torch.float32, device=_device_of(self.model))
        experts = {id(p) for p in expert_parameters(self.model)}
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad
                g = g.to_local() if hasattr(g, "to_local") else g
                sq[int(id(p) in experts)] += g.detach().float().square().sum()
        dist.all_reduce(sq)
        return (sq[0] / self.layout.dp_replicate + sq[1]).sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scales every gradient as torch.nn.utils.clip_grad_norm_ would scale the full model's; returns the
        global norm (before clipping)."""
        norm = self.grad_norm()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    def reduce_expert_counts(self) -> None:
        """Sums the routers' expert-bias counts over every rank (all saw tokens) before update_expert_bias()."""
        from moe_kernels.parallel.data_parallel import all_reduce_expert_counts

        all_reduce_expert_counts(self.model, None)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.device if not hasattr(p, "to_local") else p.to_local().device


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("parallelize: the model has no `layers` (a moe_kernels.models MoETransformer is expected)")
    return list(layers)


def parallelize(model: nn.Module, layout: ParallelConfig, device: torch.device | str | None = None, *,
                mixed_precision: bool | None = None, ep_backend: str = "all_to_all",
                max_tokens_per_rank: int | None = None) -> Parallelized:
    """Shard `model` (built identically on every rank) over the default process group's ranks, in place.

    layout: the sizes (dp_shard None: what the world leaves). device: the ranks' device type (default: the
    model's). mixed_precision: bf16 compute + fp32 reduction (default: on CUDA). ep_backend and
    max_tokens_per_rank: the token dispatcher of the experts (apply_expert_parallel).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("parallelize: initialise torch.distributed first (torchrun, or init_process_group)")
    world = dist.get_world_size()
    pc = layout.resolve(world)
    missing = [f"{n}={getattr(pc, n)}" for n in ("tp", "cp", "pp", "etp") if getattr(pc, n) != 1]
    if missing:
        raise NotImplementedError(f"parallelize: {', '.join(missing)} is not implemented yet (data, sharded data and "
                                  "expert parallelism are); moe-train --plan sizes such layouts")
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "moe"):
        pc.check_model(cfg, cfg.max_seq_len)
    device_type = torch.device(device).type if device is not None else _device_of(model).type
    attention = init_device_mesh(device_type, (pc.dp_replicate, pc.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    experts = init_device_mesh(device_type, (world // pc.ep, pc.ep), mesh_dim_names=("edp", "ep"))
    if pc.ep > 1:
        apply_expert_parallel(model, experts.get_group("ep"), backend=ep_backend,
                              max_tokens_per_rank=max_tokens_per_rank)
    if mixed_precision is None:
        mixed_precision = device_type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else \
        MixedPrecisionPolicy()
    dense_mesh = attention if pc.dp_replicate > 1 else attention["dp_shard"]
    expert_mesh = experts["edp"]
    sharded = {id(p) for p in expert_parameters(model)}
    for block in _blocks(model):
        for m in block.modules():
            if getattr(m, "experts", None) is not None and any(id(p) in sharded for p in m.experts.parameters()):
                unit = fully_shard(m.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=True)
                unit.set_gradient_divide_factor(float(world))  # the mean over every rank (module docstring)
                # A sum, then the division: gloo has no pre-multiplied sum (NCCL's PREMUL_SUM).
                unit.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense_mesh, mp_policy=mp)
    fully_shard(model, mesh=dense_mesh, mp_policy=mp)
    return Parallelized(model, pc, attention, experts)
