"""`parallelize(model, ParallelConfig(...))`: sharded data parallelism (FSDP2), tensor / sequence and
context parallelism, folded with expert parallelism, applied to a finished model from outside
(ARCHITECTURE.md, decision 7).

Two meshes over the same W = pp * dp_replicate * dp_shard * cp * tp ranks (moe_kernels.parallel.layout), each
stage's W / pp ranks consecutive (pipeline parallelism below; pp = 1 without it):
  attention  ("pp", "dp_replicate", "dp_shard", "cp", "tp")  rank in a stage = ((replica * dp_shard + shard) * cp + c) * tp + t
  experts    ("pp", "edp", "ep", "etp")                      rank in a stage = (edp * ep + ep_rank) * etp + etp_rank
The cp x tp ranks of one (replica, shard) train on the same batch, each on its share of every sequence
(moe_kernels.parallel.sequence): context parallelism gives rank c two of the 2cp chunks and its attention
gathers every rank's keys and values (context_parallel); tensor parallelism splits attention heads and
dense MLP widths and leaves each rank 1/tp of the cp rank's tokens elsewhere (tensor_parallel). Each MoE
layer keeps E / ep experts (apply_expert_parallel over "ep", tokens dispatched), each with 1/etp of its ffn
width (the etp ranks gather their tokens first and reduce-scatter the outputs), FSDP-sharded over all
W / (ep * etp) ranks of "edp" (the replicas included: expert weights are the bulk of a MoE model). The
tensor-parallel slices (every parameter without tp) are FSDP-sharded over "dp_shard" x "cp" (HSDP:
replicated over "dp_replicate"); the parameters every tp rank holds whole (norms, routers, shared
experts, embeddings) over "dp_shard" x "cp" x "tp"; one FSDP unit of each kind per transformer block plus
the root's.

Gradients: the step's objective is the mean over the dp_replicate * dp_shard batches of each batch's loss;
each rank's loss is its share of its batch's (the whole loss without cp and tp: `cross_entropy` and the
routers' aux losses give shares). Each FSDP reduction sums the parts of the ranks that share a batch and
divides by the number of batches. An expert's gradient already sums the contributions of its EP group's
tokens (the dispatcher brought them; with etp the group's gathered tokens), so its FSDP reduction, over the
W / (ep * etp) ranks holding that slice, also divides by the number of batches instead of its mesh size.

Mixed precision: bf16 parameters for compute and fp32 gradient reduction on CUDA (the fp32 master
weights stay sharded); fp32 throughout on the CPU (gloo tests compare with one process). The routers are
their own FSDP units gathered in fp32 (they compute in fp32 as on one GPU), and the experts' units leave
their inputs' dtypes alone (routing weights applied in the activation stay fp32).

Construction: a model built on the meta device is sharded first and then materialised, every rank
allocating and drawing only its pieces (moe_kernels.models.init: the values of one process's
`build_model(cfg, seed=seed)`), so no rank ever holds the whole model.

Pipeline parallelism (pp > 1, `num_microbatches=`, `schedule=`): the pp dimension is the outermost of both
meshes (rank = pp_rank * W / pp + the rank within the stage). Each rank keeps its stage's blocks
(moe_kernels.parallel.pipeline; the embedding on the first stage, the final norm and lm_head on the last)
and shards them over its stage's ranks as above, one FSDP root per stage module, so
`Parallelized.model` holds this rank's part of the model under the full model's names. A step runs through
`forward_backward(inputs, labels)`: the schedule's micro-batches, each stage's hidden states sent over the
pp group (S / (cp * tp) tokens a rank), the last stage's loss a share of its micro-batch's; the schedule
divides the gradients by the number of micro-batches, FSDP by the number of batches. Tied embeddings are
refused with pp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.nn import MoELayer, Router
from moe_kernels.nn.lora import unwrapped
from moe_kernels.parallel.context_parallel import apply_context_parallel
from moe_kernels.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from moe_kernels.parallel.full_state import device_of, model_from_state, splits_of
from moe_kernels.parallel.layout import ParallelConfig
from moe_kernels.parallel.pipeline import LocalStages, Pipelined, check_pipeline, stage_modules
from moe_kernels.parallel.sequence import (
    SequenceSharding,
    apply_sequence_sharding,
    blocks_of,
    check_sequence_parallel,
    cross_entropy_share,
    linear_cross_entropy_share,
)
from moe_kernels.parallel.tensor_parallel import apply_tensor_parallel
from moe_kernels.quant.fsdp_fp8 import enable_fp8_all_gather, fp8_all_gather_applies


@dataclass
class Parallelized:
    """What parallelize set up: the resolved layout and its meshes, and the global operations on them."""

    model: nn.Module
    layout: ParallelConfig
    # The rank layouts ("pp", "dp_replicate", "dp_shard", "cp", "tp") and ("pp", "edp", "ep", "etp"): DeviceMeshes
    # for coordinates only, with no communicators (those this rank has are in `groups`).
    attention_mesh: object
    expert_mesh: object
    sharding: SequenceSharding | None = None  # how the cp x tp ranks of a batch split it (None: not split)
    expert_modules: list = field(default_factory=list)  # the experts FSDP-sharded over edp (held once in all)
    pipeline: object = None  # Pipelined: this rank's stages and the schedule (pp > 1), else None
    stage_group: object = None  # the ranks of this rank's pipeline stage (pp > 1), else None (the world)
    full_names: list = field(default_factory=list)  # the full model's state-dict names, in its order
    # This rank's communicators by dimension: "pp", "stage", "dp_replicate", "dp_shard_cp", "dp_shard_cp_tp",
    # "cp", "tp", "seq", "edp", "ep", "etp" (None for a single rank; one group for each rank set).
    groups: dict = field(default_factory=dict)
    # The loss from the final hidden states and the lm_head weight in chunks (moe_kernels.nn.linear_cross_entropy),
    # never the [tokens, V] logits; False: F.cross_entropy over the model's logits.
    fused_loss: bool = True
    # With the fp8-blockwise recipe: why a layer's experts are gathered in bf16 rather than E4M3 (one entry per
    # such layer; empty where every layer's are gathered in E4M3, moe_kernels.quant.fsdp_fp8).
    fp8_all_gather_reasons: list = field(default_factory=list)

    @torch.no_grad()
    def evaluate(self, inputs: Tensor, labels: Tensor) -> Tensor:
        """The batch's cross-entropy (a forward only; with pp through the schedule, micro-batch by micro-batch),
        equal on the ranks that share the batch. With pp, call it with no gradients pending (PyTorch's schedule
        runs its gradient reduction and scaling after an evaluation too)."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(inputs, labels)
        return self.batch_loss(self._forward(inputs, labels)[0])

    def forward_backward(self, inputs: Tensor, labels: Tensor, *, scale: float = 1.0) -> tuple[Tensor, Tensor]:
        """One batch's forward and backward on this rank: inputs and labels [B, S], the whole batch of this
        rank's data-parallel slot (every cp x tp rank, and with pp every stage, passes the same). Returns the
        batch's cross-entropy and aux loss (detached, equal on the ranks that share the batch); the gradients
        are accumulated, of the losses times `scale` (1 / N for one of N accumulated batches). With pp the
        objective is the mean over micro-batches of each one's losses (scale 1 only)."""
        if self.pipeline is not None:
            if scale != 1.0:
                raise ValueError("forward_backward: a pipeline step accumulates its own micro-batches (scale 1 only)")
            return self.pipeline.step(inputs, labels)
        ce, aux = self._forward(inputs, labels)
        ((ce + aux) * scale if scale != 1.0 else ce + aux).backward()
        return tuple(self.batch_loss(torch.stack([ce.detach(), aux.detach().float()])))

    def _forward(self, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's share of the batch's cross-entropy, and its aux loss."""
        if not self.fused_loss:
            logits, aux = self.model(inputs)
            return self.cross_entropy(logits, labels), aux
        # The vocabulary is never split (tensor parallelism leaves the lm_head whole): each rank's rows of its
        # tokens against the whole weight. Read after the forward: FSDP keeps the root's parameters, and with tp
        # the final unit's (parallelize), gathered until the backward.
        hidden, aux = self.model(inputs, return_hidden=True)
        return linear_cross_entropy_share(hidden, self.model.head_weight, labels, self.sharding), aux

    def local_tokens(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a batch tensor along the sequence: the tokens its logits cover."""
        return t if self.sharding is None else self.sharding.local(t, dim)

    def cross_entropy(self, logits: Tensor, labels: Tensor) -> Tensor:
        """This rank's share of the batch's mean cross-entropy: logits from the model, labels [B, S] of the
        whole batch. Add the model's aux loss (also a share) and call backward on the sum."""
        return cross_entropy_share(logits, labels, self.sharding)

    def batch_loss(self, share: Tensor) -> Tensor:
        """The batch's loss from this rank's share (summed over the cp x tp ranks), for logging; no gradient."""
        total = share.detach().clone()
        if self.sharding is not None:
            dist.all_reduce(total, group=self.sharding.group)
        return total

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The global gradient norm of the full model: every shard's squares summed over all ranks, the
        dense shards' divided by dp_replicate (each replica holds them); expert shards are held once."""
        from moe_kernels.parallel.data_parallel import grad_squares, local_grads

        dense, experts = local_grads(self.model, self.expert_modules)
        device = device_of(self.model)
        sq = torch.stack([grad_squares(dense, device), grad_squares(experts, device)])
        dist.all_reduce(sq)
        return (sq[0] / self.layout.dp_replicate + sq[1]).sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scales every gradient as torch.nn.utils.clip_grad_norm_ would scale the full model's; returns the
        global norm (before clipping)."""
        from moe_kernels.parallel.data_parallel import local_grads, scale_grads_

        norm = self.grad_norm()
        dense, experts = local_grads(self.model, self.expert_modules)
        scale_grads_(dense + experts, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def full_state(self, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None] | None:
        """The full model's (and optimizer's) state dicts, as one process would write them, on rank 0 (None
        elsewhere); every rank calls it (moe_kernels.parallel.full_state)."""
        from moe_kernels.parallel.full_state import full_state

        return full_state(self, optimizer)

    def full_model(self) -> nn.Module | None:
        """The full model in one process (on rank 0's CPU, built on the meta device and given the gathered
        tensors; None on the other ranks), e.g. for moe_kernels.models.save_hf_checkpoint; every rank calls it."""
        full = self.full_state(None)
        return None if full is None else model_from_state(self.model.config, full[0])

    def load_full_state(self, model_state: dict, optimizer: torch.optim.Optimizer | None = None,
                        optim_state: dict | None = None) -> None:
        """Loads full (one-process) state dicts, each rank keeping its pieces; every rank calls it."""
        from moe_kernels.parallel.full_state import load_full_state

        load_full_state(self, optimizer, model_state, optim_state)

    def reduce_expert_counts(self) -> None:
        """Sums the routers' expert-bias counts over every rank (all saw tokens) before update_expert_bias()."""
        from moe_kernels.parallel.data_parallel import all_reduce_expert_counts

        all_reduce_expert_counts(self.model, self.stage_group)


def _materialise_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _capacity_rows(model: nn.Module, capacity: float | None, max_tokens_per_rank: int | None,
                   backend: str, etp: int = 1) -> int | None:
    """The nvlink backend's expert rows per rank from a factor of the balanced load (each rank's tokens with
    their k slots: max_tokens_per_rank * etp * k rows, the etp group's tokens dispatched together); None: its
    worst case."""
    if capacity is None:
        return None
    if backend != "nvlink":
        raise ValueError(f"capacity={capacity}: a dispatch capacity is the nvlink backend's (ep_backend="
                         f"{backend!r} sends every routed row)")
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0 (a factor of the balanced load), got {capacity}")
    if max_tokens_per_rank is None:
        raise ValueError("capacity needs max_tokens_per_rank (the balanced load is max_tokens_per_rank * k rows)")
    ks = {m.config.router.k for m in model.modules() if isinstance(m, MoELayer)}
    return max(1, math.ceil(capacity * max_tokens_per_rank * etp * max(ks or {1})))


def _blocks(model: nn.Module) -> list[nn.Module]:
    if getattr(model, "layers", None) is None:
        raise ValueError("parallelize: the model has no `layers` (a moe_kernels.models MoETransformer is expected)")
    return blocks_of(model)


@dataclass
class _ProcessGroups:
    """This rank's communicators and FSDP meshes for a resolved layout (module docstring's grids)."""

    groups: dict  # name -> group: None where the dimension is a single rank (the stage's: one_rank)
    split: object  # FSDP mesh of the tp slices: dp_replicate x (dp_shard x cp)
    whole: object  # FSDP mesh of what every tp rank holds whole: dp_replicate x (dp_shard x cp x tp); None without tp
    experts: object  # FSDP mesh of the experts: edp (None when no unit uses it)
    pp_rank: int
    one_rank: object  # this rank's single-rank group where something needs one, else None
    attention: object  # coordinate-only DeviceMeshes of the two layouts
    expert: object


def _process_groups(pc: ParallelConfig, world: int, device_type: str, has_experts: bool) -> _ProcessGroups:
    """Communicators only for the dimensions larger than one (a DeviceMesh makes one for every dimension, so W
    single-rank groups for a dimension of size 1, and its flattened and sliced meshes more), each rank set
    created once: a dimension spanning the world is the default group, apart from "ep" (its own communicator:
    moe_kernels.parallel.mesh). The FSDP meshes are made from these groups (DeviceMesh.from_group creates
    none); where FSDP (or the dispatcher, or a one-rank stage) needs a group of one rank, all share one
    created by this rank alone. has_experts: the model has MoE layers."""
    from torch.distributed.device_mesh import DeviceMesh

    from moe_kernels.parallel.mesh import _groups_along

    PP, R, D, C, T, EP, ETP = pc.pp, pc.dp_replicate, pc.dp_shard, pc.cp, pc.tp, pc.ep, pc.etp
    stage = world // PP
    rank = dist.get_rank()
    attention = torch.arange(world).view(PP, R, D, C, T)
    experts = torch.arange(world).view(PP, stage // (EP * ETP), EP, ETP)
    # The experts are FSDP units over edp when expert-parallel, and with tp or cp (parallelize).
    shard_experts = has_experts and (EP * ETP > 1 or C * T > 1)
    made: dict = {}  # rank tuple -> group
    single: list = []

    def one_rank():
        if not single:  # no other rank takes part: local synchronisation
            single.append(dist.new_group([rank], use_local_synchronization=True, group_desc="one_rank"))
        return single[0]

    # Every rank creates the same lines in the same order (torch requires it): the order below is fixed.
    along = partial(_groups_along, made=made)
    g = {"pp": along(attention, (0,), "pp")}
    g["stage"] = (along(attention, (1, 2, 3, 4), "stage") or one_rank()) if PP > 1 else None
    g["dp_replicate"] = along(attention, (1,), "dp_replicate")
    g["dp_shard_cp"] = along(attention, (2, 3), "dp_shard_cp")
    g["dp_shard_cp_tp"] = along(attention, (2, 3, 4), "dp_shard_cp_tp") if T > 1 else None
    g["cp"] = along(attention, (3,), "cp")
    g["tp"] = along(attention, (4,), "tp")
    g["seq"] = along(attention, (3, 4), "seq")
    g["edp"] = along(experts, (1,), "edp") if shard_experts else None
    g["ep"] = _groups_along(experts, (2,), "ep", world=False) if has_experts else None
    g["etp"] = along(experts, (3,), "etp") if has_experts else None
    if has_experts and ETP > 1 and EP == 1:  # the dispatcher's expert-parallel group: this rank alone
        one_rank()

    pp_rank, t = rank // stage, rank % T

    def fsdp_mesh(shard, ranks, name):
        """(dp_replicate x) `name`: HSDP over the replicas when dp_replicate > 1; `ranks` [R, N] of this rank."""
        shard = shard or one_rank()
        if R == 1:
            return DeviceMesh.from_group(shard, device_type, mesh_dim_names=(name,))
        return DeviceMesh.from_group([g["dp_replicate"], shard], device_type, mesh=ranks,
                                     mesh_dim_names=("dp_replicate", name))

    split = fsdp_mesh(g["dp_shard_cp"], attention[pp_rank, :, :, :, t].reshape(R, D * C), "dp_shard_cp")
    whole = (fsdp_mesh(g["dp_shard_cp_tp"], attention[pp_rank].reshape(R, D * C * T), "dp_shard_cp_tp")
             if T > 1 else None)
    expert_fsdp = (DeviceMesh.from_group(g["edp"] or one_rank(), device_type, mesh_dim_names=("edp",))
                   if shard_experts else None)
    layouts = [DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False) for ranks, names in (
        (attention, ("pp", "dp_replicate", "dp_shard", "cp", "tp")), (experts, ("pp", "edp", "ep", "etp")))]
    return _ProcessGroups(g, split, whole, expert_fsdp, pp_rank, single[0] if single else None, *layouts)


def parallelize(model: nn.Module, layout: ParallelConfig, device: torch.device | str | None = None, *,
                mixed_precision: bool | None = None, ep_backend: str = "all_to_all",
                max_tokens_per_rank: int | None = None, capacity: float | None = None,
                num_microbatches: int | None = None, schedule: str = "1f1b", stages_per_rank: int = 1,
                seed: int | None = None, fused_loss: bool = True, fp8_all_gather: bool = True) -> Parallelized:
    """Shard `model` over the default process group's ranks, in place: a model built identically on every
    rank, or one built on the meta device (`build_model(cfg, device="meta")`), which is then materialised
    on `device` with each rank holding and initialising only its pieces, drawn from `seed` as one process's
    `build_model(cfg, seed=seed)` would draw them (moe_kernels.models.init).

    layout: the sizes (dp_shard None: what the world leaves). device: the ranks' device (default: the
    model's; required for a meta model). mixed_precision: bf16 compute + fp32 reduction, routers in fp32
    (default: on CUDA). ep_backend, max_tokens_per_rank and capacity: the token dispatcher of the experts
    (apply_expert_parallel; capacity, for nvlink: expert rows per rank as a factor of the balanced load
    max_tokens_per_rank * k, None for the worst case). num_microbatches, schedule ("1f1b", "gpipe",
    "interleaved-1f1b") and stages_per_rank: the pipeline's, with pp > 1. fused_loss: the cross-entropy from
    the final hidden states and the lm_head weight in chunks of tokens (moe_kernels.nn.linear_cross_entropy), in
    `forward_backward`, `evaluate` and the pipeline's last stage; False: over the [tokens, V] logits.
    fp8_all_gather: with the fp8-blockwise recipe, FSDP2 gathers the routed experts' weights as E4M3 codes and
    scales, each shard quantized once per optimizer step (moe_kernels.quant.fsdp_fp8: bit for bit the bf16
    gather's training, half its bytes), where its conditions hold; `fp8_all_gather_reasons` on the result
    says why not elsewhere.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("parallelize: initialise torch.distributed first (torchrun, or init_process_group)")
    world = dist.get_world_size()
    pc = layout.resolve(world)
    PP = pc.pp
    if PP > 1:
        if num_microbatches is None:
            raise ValueError(f"parallelize: pp={PP} needs num_microbatches (the micro-batches of a step)")
        check_pipeline(model, PP, num_microbatches, schedule, stages_per_rank, who="parallelize")
    elif num_microbatches is not None or stages_per_rank != 1:
        raise ValueError("parallelize: num_microbatches and stages_per_rank are for pp > 1")
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "moe"):
        pc.check_model(cfg, cfg.max_seq_len)
    if pc.cp * pc.tp > 1:
        check_sequence_parallel(model, pc.tp)
    on_meta = device_of(model).type == "meta"
    if on_meta and (device is None or torch.device(device).type == "meta"):
        raise ValueError("parallelize: a model on the meta device needs `device=` (where its pieces go)")
    if on_meta and seed is None:
        raise ValueError("parallelize: a model on the meta device is initialised from `seed=` (the same on every "
                         "rank); pass it, or build the model on its device first")
    if seed is not None and not on_meta:
        raise ValueError("parallelize: `seed=` initialises a model built on the meta device; this one already "
                         "holds its weights")
    if capacity is not None and pc.ep * pc.etp == 1:
        raise ValueError(f"parallelize: capacity={capacity} is the expert-parallel dispatcher's; this layout has no "
                         "expert parallelism")
    device_type = torch.device(device).type if device is not None else device_of(model).type
    if mixed_precision is None:
        mixed_precision = device_type == "cuda"
    R, D, C, T = pc.dp_replicate, pc.dp_shard, pc.cp, pc.tp
    EP, ETP = pc.ep, pc.etp
    pg = _process_groups(pc, world, device_type, any(isinstance(m, MoELayer) for m in model.modules()))
    groups = pg.groups
    batches = R * D  # the terms of the step's mean (module docstring)
    sharding = None
    if C * T > 1:  # the cp x tp ranks of one batch: one (sub)group each, and all of them together
        sharding = SequenceSharding(groups["cp"], groups["tp"], groups["seq"])
    pipeline = stage_group = None
    full_names = list(model.state_dict().keys())
    if PP > 1:
        stage_group = groups["stage"]
        modules, ids, num_stages = stage_modules(model, PP, pg.pp_rank, stages_per_rank)
        pipeline = Pipelined(modules, ids, num_stages, schedule, groups["pp"], num_microbatches,
                             loss_fn=partial(cross_entropy_share, sharding=sharding),
                             hidden_loss_fn=partial(linear_cross_entropy_share, sharding=sharding) if fused_loss else None,
                             seq_group=None if sharding is None else sharding.group, seq_split=C * T,
                             activation_dtype=torch.bfloat16 if mixed_precision else None)
        model = LocalStages(model, modules)
    replicated = apply_tensor_parallel(model, sharding.tp_group) if T > 1 else None
    if sharding is not None:
        apply_sequence_sharding(model, sharding)
    if C > 1:
        apply_context_parallel(model, sharding)
    if EP * ETP > 1 and any(isinstance(m, MoELayer) for m in model.modules()):  # (a stage of dense layers has none)
        apply_expert_parallel(model, groups["ep"] if EP > 1 else pg.one_rank, backend=ep_backend,
                              etp_group=groups["etp"],
                              max_tokens_per_rank=max_tokens_per_rank,
                              capacity=_capacity_rows(model, capacity, max_tokens_per_rank, ep_backend, ETP))
    if mixed_precision:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The routers compute in fp32 as on one GPU (Megatron-Core's router): their own units, gathered in
        # fp32; their inputs pass as they come (the router casts them). The experts' inputs keep their dtypes
        # too: the routing weights that scale rows in the activation stay fp32.
        router_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                         cast_forward_inputs=False)
        expert_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         cast_forward_inputs=False)
    else:
        mp = router_mp = expert_mp = MixedPrecisionPolicy()
    def summed(unit, mesh) -> None:
        if isinstance(unit, list):  # a unit of several modules shares one FSDP state
            unit = unit[0]
        unit.set_gradient_divide_factor(float(batches))
        # A sum, then the division: gloo has no pre-multiplied sum (NCCL's PREMUL_SUM). Not on one rank, where
        # there is no collective: torch 2.13's FSDP2 then divides the gradient twice when the sum is forced.
        if mesh.size() > 1:
            unit.set_force_sum_reduction_for_comms(True)

    # The tp slices (every parameter without tp): over dp_shard, their cp ranks' parts summed when cp > 1.
    split_mesh = pg.split
    # What every tp rank holds whole: over dp_shard x cp x tp, the parts summed.
    whole_mesh = pg.whole if replicated is not None else None
    expert_mesh = pg.experts

    def shard_split(module) -> None:
        unit = fully_shard(module, mesh=split_mesh, mp_policy=mp)
        if C > 1:
            summed(unit, split_mesh)

    ep_params = {id(p) for p in expert_parameters(model)}
    expert_modules = []
    fp8_reasons: list[str] = []
    for i, block in enumerate(_blocks(model)):
        routers = [m for m in block.modules() if isinstance(m, Router)]
        for router in routers:  # each its own unit, over the ranks its parameters would otherwise share
            if replicated is not None:
                summed(fully_shard(router, mesh=whole_mesh, mp_policy=router_mp), whole_mesh)
            else:
                unit = fully_shard(router, mesh=split_mesh, mp_policy=router_mp)
                if C > 1:
                    summed(unit, split_mesh)
        if replicated is not None:
            rest = [m for m in replicated[i] if not any(m is r for r in routers)]
            if rest:
                summed(fully_shard(rest, mesh=whole_mesh, mp_policy=mp), whole_mesh)
        for m in block.modules():
            routed = getattr(m, "experts", None)
            if routed is None or not isinstance(routed, nn.Module):
                continue
            # Inside adapter wrappers (peft's LoRA): the experts alone; the factors stay replicated with the block.
            routed = unwrapped(routed)
            if not any(True for _ in routed.parameters()):
                continue
            # Expert-parallel experts, and with tp or cp every rank's experts (their gradients are its tokens'
            # part): summed over edp, which holds the tp and cp ranks too.
            own_unit = any(id(p) in ep_params for p in routed.parameters()) or sharding is not None
            if fp8_all_gather and isinstance(m, MoELayer):
                mesh = expert_mesh if own_unit else split_mesh
                why = fp8_all_gather_applies(routed, m.config.recipe, mesh.size(mesh.ndim - 1))
                if why is None:
                    enable_fp8_all_gather(routed, m.config.recipe.pow2_scale)
                elif m.config.recipe is not None:
                    fp8_reasons.append(why)
            if own_unit:
                summed(fully_shard(routed, mesh=expert_mesh, mp_policy=expert_mp, reshard_after_forward=True),
                       expert_mesh)
                expert_modules.append(routed)
        shard_split(block)
    if replicated is not None and replicated[-1]:
        # Tied embeddings: the lm_head product reads embed_tokens.weight after the unit's last module (the
        # final norm) has run; the fused loss reads the lm_head weight after the forward (the lm_head module never
        # runs). Either way the unit keeps its parameters gathered until the backward.
        tied = getattr(model, "lm_head", None) is None and PP == 1
        head_read_later = fused_loss and getattr(model, "lm_head", None) is not None
        summed(fully_shard(replicated[-1], mesh=whole_mesh, mp_policy=mp,
                           reshard_after_forward=not (tied or head_read_later)), whole_mesh)
    for root in (pipeline.modules if pipeline is not None else [model]):  # one FSDP root per stage module
        shard_split(root)
    if on_meta:  # each rank allocates its own pieces and draws them (moe_kernels.models.init)
        from moe_kernels.models.init import init_parameters, model_rules

        model.to_empty(device=_materialise_device(device))
        init_parameters(model, model_rules(model, model.config), seed,
                        splits_of(model, None if sharding is None else sharding.tp_group))
    return Parallelized(model, pc, pg.attention, pg.expert, sharding, expert_modules, pipeline, stage_group,
                        full_names, groups, fused_loss, fp8_reasons)
