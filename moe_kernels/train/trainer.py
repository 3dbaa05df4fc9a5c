"""A small, honest trainer for the MoE models: AdamW, warmup + cosine, clipping, mixed precision on a GPU
(bf16 parameters with fp32 master weights and gradients: moe_kernels.train.master; under FSDP2 its
mixed-precision policy), optional activation checkpointing, periodic eval, atomic checkpoints, bit-identical
resume; on one GPU the whole step optionally captured in a CUDA graph (moe_kernels.train.graphs)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moe_kernels.models import PRESETS, build_model, flops_per_token
from moe_kernels.parallel import apply_global_load_balancing
from moe_kernels.parallel.full_state import model_from_state, optimizer_names
from moe_kernels.quant import RECIPES, weight_cache
import torch.distributed as dist

from moe_kernels.train import checkpoint, distributed, graphs
from moe_kernels.train.data import TokenData, fingerprint, load_tokens
from moe_kernels.train.metrics import MetricsLogger, format_line, memory_gib, peak_flops


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    preset: str = "tiny-qwen3-moe"
    num_layers: int | None = None  # override the preset's depth
    data: str | None = None  # None: the embedded corpus
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    out_dir: str = "runs/default"
    seed: int = 0
    device: str | None = None  # None: cuda if available
    bf16: bool = True  # bf16 compute on a GPU (ignored on the CPU): master weights below, or autocast
    # bf16 parameters for compute, fp32 master weights and main gradients held for the optimizer, no autocast
    # (moe_kernels.train.master; under a parallelize() layout FSDP2's bf16 / fp32-reduce policy). None: on with
    # bf16 on CUDA; True also on the CPU (bf16 compute there); False: fp32 parameters, autocast with bf16 on CUDA.
    master_weights: bool | None = None
    precision: str = "bf16"  # expert GEMMs: "bf16" (the autocast/input precision), "fp8-blockwise" or "nvfp4"
    activation_checkpointing: bool = False
    # The cross-entropy with the lm_head, over chunks of tokens (moe_kernels.nn.linear_cross_entropy): no [tokens, V]
    # fp32 logits. False: F.cross_entropy over the logits (the same loss within fp32 rounding).
    fused_ce: bool = True
    tensorboard: bool = False
    expert_parallel: int = 1  # ranks per expert-parallel group (under torchrun; must divide the world)
    # A parallelize() layout (under torchrun): sharded data, tensor / sequence, context and expert tensor
    # parallelism; any of them set trains through moe_kernels.parallel.parallelize (dp_shard None: what the
    # world leaves).
    dp_shard: int | None = None
    dp_replicate: int = 1
    tp: int = 1
    cp: int = 1
    etp: int = 1
    pp: int = 1  # pipeline stages (with a parallelize() layout)
    microbatches: int | None = None  # the pipeline's micro-batches a step (None: pp; each a batch_size share)
    pp_schedule: str = "1f1b"  # "1f1b", "gpipe" or "interleaved-1f1b" (two stages a rank)
    ep_backend: str = "all_to_all"  # token dispatch between the expert-parallel ranks (moe_kernels.dispatch)
    global_load_balancing: bool = False  # under torchrun: the aux loss's expert frequencies over all ranks
    grad_accum: int = 1  # batches of batch_size a step accumulates (the step's objective: their mean)
    capacity_factor: float | None = None  # nvlink: expert rows a rank receives, x the balanced load (None: worst case)
    save_full: bool = False  # under torchrun: full-state checkpoint files (rank 0 writes) instead of sharded ones
    pg_timeout_minutes: float = 10.0  # the process group's collective timeout (under torchrun)
    # The whole step (forward, backward, clipping, AdamW, the lr schedule, the expert-bias update) captured once in
    # a CUDA graph and replayed (moe_kernels.train.graphs): one process on one GPU, bf16 expert GEMMs.
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "expert_parallel", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError("warmup_steps must be in [0, steps]")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")
        from moe_kernels.dispatch import BACKENDS as EP_BACKENDS

        if self.ep_backend not in EP_BACKENDS:
            raise ValueError(f"unknown ep_backend {self.ep_backend!r}; choose from {sorted(EP_BACKENDS)}")
        if self.ep_backend != "all_to_all" and self.expert_parallel == 1:
            raise ValueError(f"ep_backend={self.ep_backend!r} moves tokens between expert-parallel ranks: "
                             "it needs expert_parallel > 1")
        for name in ("dp_replicate", "tp", "cp", "etp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp == 1 and (self.microbatches is not None or self.pp_schedule != "1f1b"):
            raise ValueError("microbatches and pp_schedule are for pipeline parallelism (pp > 1)")
        if self.pp > 1:  # the schedules' rules, before any process group starts
            from moe_kernels.parallel.pipeline import check_schedule

            layers = self.num_layers if self.num_layers is not None else PRESETS[self.preset]().num_layers
            check_schedule(self.pp, self.num_microbatches, self.pp_schedule, self.stages_per_rank, layers, "moe-train")
            if self.batch_size % self.num_microbatches:
                raise ValueError(f"batch_size {self.batch_size} must split into {self.num_microbatches} micro-batches")
        if self.grad_accum > 1 and self.pp > 1:
            raise ValueError(f"grad_accum={self.grad_accum} with pp={self.pp}: a pipeline step already accumulates its "
                             "micro-batches; set microbatches (and batch_size) instead")
        if self.capacity_factor is not None:
            if self.ep_backend != "nvlink":
                raise ValueError(f"capacity_factor bounds the nvlink backend's expert rows; ep_backend is "
                                 f"{self.ep_backend!r} (it sends every routed row)")
            if not self.capacity_factor > 0:
                raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if not self.pg_timeout_minutes > 0:
            raise ValueError(f"pg_timeout_minutes must be > 0, got {self.pg_timeout_minutes}")
        if self.dp_shard is not None and self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1, got {self.dp_shard}")
        if self.precision not in RECIPES:
            raise ValueError(f"unknown precision {self.precision!r}; choose from {sorted(RECIPES)}")
        if RECIPES[self.precision] is not None:  # the recipe's shape rules, checked before anything is built
            PRESETS[self.preset](recipe=RECIPES[self.precision])
        why = graphs.refusal(self) if self.cuda_graphs else None
        if why is not None:
            raise ValueError(why)

    @property
    def sharded(self) -> bool:
        """Trains through parallelize() (a layout beyond replicated data + expert parallelism)."""
        return (self.dp_shard is not None or self.dp_replicate > 1 or self.tp > 1 or self.cp > 1 or self.etp > 1
                or self.pp > 1)

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule == "interleaved-1f1b" else 1

    def parallel_config(self):
        from moe_kernels.parallel.layout import ParallelConfig

        return ParallelConfig(dp_shard=self.dp_shard, dp_replicate=self.dp_replicate, tp=self.tp, cp=self.cp,
                              pp=self.pp, ep=self.expert_parallel, etp=self.etp)


# Settings that a checkpoint's weights, optimizer state and batch stream belong to: resuming with other
# values would not continue the run. (lr, weight decay and the betas live in the saved optimizer and
# scheduler state, so new values would be silently ignored.) steps, warmup, logging, eval and checkpoint
# intervals, device, seed (the saved RNG and data seed are restored) and the like may change.
RESUME_FIELDS = ("preset", "num_layers", "data", "batch_size", "seq_len", "lr", "weight_decay", "beta1", "beta2",
                 "grad_accum")


class ResumeMismatchError(ValueError):
    """A checkpoint was written with settings (RESUME_FIELDS) that differ from the resuming run's."""

    def __init__(self, path: Path, differences: dict[str, tuple]):
        self.path, self.differences = path, differences
        lines = [f"  {name}: {old} in the checkpoint, {new} now" for name, (old, new) in differences.items()]
        super().__init__(f"{path} was written with other settings ({', '.join(differences)}):\n" + "\n".join(lines))


def _describe_data(source: str | None, fp: dict) -> str:
    return f"{source or 'embedded corpus'} ({fp['tokens']:,} tokens, sha256 {fp['sha256'][:12]})"


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    def __init__(self, cfg: TrainConfig, *, echo=print):
        self.cfg = cfg
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else distributed.launched_world()
        self.device = distributed.device_for(world, cfg.device)
        if cfg.cuda_graphs:
            graphs.check_device(self.device, world)
        if cfg.ep_backend == "nvlink" and self.device.type != "cuda":
            raise ValueError("ep_backend='nvlink' writes into the other GPUs' memory: it needs CUDA devices; "
                             "use ep_backend='all_to_all' on CPUs")
        on = cfg.bf16 and self.device.type == "cuda"
        self.master_weights = on if cfg.master_weights is None else cfg.master_weights
        layout = None
        if cfg.sharded:  # checked before the process group starts: a clear error, not a hang
            layout = cfg.parallel_config().resolve(world)
            if world == 1:  # every dimension 1: one process
                layout = None
        # None: one process. With a parallelize() layout the process group only (the layout has its meshes).
        self.par = distributed.setup(1 if layout is not None else cfg.expert_parallel, self.device,
                                     timeout_minutes=cfg.pg_timeout_minutes)
        self.is_main = self.par is None or self.par.is_main
        if cfg.tensorboard:  # checked on every rank: only rank 0 writes, but all must stop together
            try:
                importlib.import_module("torch.utils.tensorboard")
            except ImportError as exc:
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
        self.echo = echo if self.is_main else (lambda *args, **kwargs: None)
        self.out_dir = Path(cfg.out_dir)
        self._seed_everything(cfg.seed)
        tokens, vocab = load_tokens(cfg.data)
        rank, world = (0, 1) if self.par is None else (self.par.rank, self.par.world)
        if layout is not None:  # the cp x tp ranks of one batch (in every pipeline stage) read the same batch
            stage_rank = rank % (world // layout.pp)
            rank, world = stage_rank // (layout.cp * layout.tp), layout.dp_replicate * layout.dp_shard
        self.data = TokenData(tokens, vocab, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=rank, world=world)
        self.data_fingerprint = fingerprint(tokens, vocab)
        overrides = {"vocab_size": vocab, "max_seq_len": cfg.seq_len}
        if cfg.num_layers is not None:
            overrides["num_layers"] = cfg.num_layers
        if RECIPES[cfg.precision] is not None:
            overrides["recipe"] = RECIPES[cfg.precision]
        self.model_config = PRESETS[cfg.preset](**overrides)
        # fp32 master weights. Under torchrun the model is built on the meta device and each rank materialises
        # and draws only its pieces after sharding (moe_kernels.models.init: the same values in every layout).
        distributed_run = layout is not None or self.par is not None
        self.model = build_model(self.model_config, device="meta" if distributed_run else self.device, seed=cfg.seed)
        self._num_parameters = sum(p.numel() for p in self.model.parameters())
        self.parallelized = None  # moe_kernels.parallel.Parallelized with a parallelize() layout
        if cfg.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        if layout is not None:
            from moe_kernels.parallel.parallelize import parallelize

            tokens_per_rank = cfg.batch_size * cfg.seq_len // (layout.cp * layout.tp)
            if layout.pp > 1:  # the dispatcher sees one micro-batch at a time
                tokens_per_rank //= cfg.num_microbatches
            pipeline = dict(num_microbatches=cfg.num_microbatches, schedule=cfg.pp_schedule,
                            stages_per_rank=cfg.stages_per_rank) if layout.pp > 1 else {}
            self.parallelized = parallelize(self.model, layout, self.device, mixed_precision=self.master_weights,
                                            ep_backend=cfg.ep_backend,
                                            max_tokens_per_rank=tokens_per_rank if cfg.ep_backend == "nvlink" else None,
                                            capacity=cfg.capacity_factor, seed=cfg.seed, fused_loss=cfg.fused_ce,
                                            **pipeline)
            self.model = self.parallelized.model  # with pp: this rank's stages, under the full model's names
            # Over the ranks that run the same layers (a pipeline stage of dense layers has no router).
            if cfg.global_load_balancing and any(True for _ in self.model.moe_layers()):
                apply_global_load_balancing(self.model, self.parallelized.stage_group)
        elif self.par is not None:
            # The nvlink backend's buffers hold one micro-batch of this rank's tokens.
            distributed.shard_model(self.model, self.par, cfg.ep_backend, cfg.batch_size * cfg.seq_len,
                                    capacity=cfg.capacity_factor, device=self.device, seed=cfg.seed)
            if cfg.global_load_balancing:
                apply_global_load_balancing(self.model)
        # fp32 masters, bf16 compute copies (the paths without FSDP; parallelize applied FSDP's policy above).
        self.master = None
        if self.master_weights and self.parallelized is None:
            from moe_kernels.train.master import MasterWeights, fp32_parameter_names

            self.master = MasterWeights(self.model, fp32_parameter_names(self.model_config))
        # FP8 expert weights quantized once per optimizer step (moe_kernels.quant.weight_cache): exact where every
        # change of a weight bumps its version, so not under FSDP2, which refills its parameters without. There,
        # parallelize() has each rank quantize its shard once a step and gather the codes (quant.fsdp_fp8); a
        # layer where that does not apply quantizes its gathered bf16 weights in every forward.
        weight_cache.enable(self.parallelized is None)
        for why in sorted(set(self.parallelized.fp8_all_gather_reasons if self.parallelized else [])):
            warnings.warn(f"FP8 recipe under FSDP2: experts gathered in bf16 and quantized every forward ({why})",
                          stacklevel=2)
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
            **graphs.optimizer_flags(self.device, cfg.cuda_graphs),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0
        # The captured step (cuda_graphs): the schedule on the device, the batch in static buffers.
        self.lr_schedule = self.step_graph = None
        if cfg.cuda_graphs:
            self.lr_schedule = graphs.DeviceLRSchedule(cfg, self.device)
            self.step_graph = graphs.StepGraph(self._static_step, (cfg.grad_accum, cfg.batch_size, cfg.seq_len),
                                               self.device)
        self._new_metrics = True  # the first train() of a run that did not resume starts a new metrics file
        self._optimizer_times: list = []  # the optimizer's time per step since the last log (train())
        self.flops_per_token = flops_per_token(self.model_config, cfg.seq_len)
        self.peak = peak_flops(self.device)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _autocast(self):
        """bf16 autocast on CUDA without master weights. Under FSDP's mixed precision too: its units gather bf16
        parameters (the routers fp32, which compute in fp32 anyway), so autocast casts activations only."""
        enabled = self.device.type == "cuda" and self.cfg.bf16 and self.master is None
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _compute(self):
        """The parameters' bf16 copies for a forward (and backward), with master weights."""
        return self.master.compute() if self.master is not None else contextlib.nullcontext()

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        targets = targets.to(self.device, non_blocking=True)
        with self._autocast():
            if self.cfg.fused_ce:  # the lm_head inside the loss, chunk by chunk (in the autocast dtype)
                loss, aux = self.model(inputs.to(self.device, non_blocking=True), targets)
                return loss, aux.float()
            logits, aux = self.model(inputs.to(self.device, non_blocking=True))
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss, aux.float()

    def num_parameters(self) -> int:
        """Of the full model."""
        return self._num_parameters

    def layout(self) -> str:
        if self.parallelized is not None:
            return f" ({self.parallelized.layout.describe()}, {self.cfg.ep_backend} dispatch)"
        if self.par is None:
            return ""
        return (f" x {self.par.world} ranks (expert-parallel groups of {self.par.expert_parallel}, "
                f"{self.cfg.ep_backend} dispatch)")

    def close(self) -> None:
        """Leaves the process group this trainer started (under torchrun), after freeing the nvlink dispatchers'
        peer buffers in order (every rank unmaps its peers' regions, then the regions are freed)."""
        if self.par is not None and self.par.owns_process_group and dist.is_initialized():
            from moe_kernels.dispatch import NvlinkDispatcher

            groups = {id(d.group): d.group for d in self._dispatchers() if isinstance(d, NvlinkDispatcher)}
            for group in groups.values():
                NvlinkDispatcher.release_buffers(group)
            dist.destroy_process_group()

    # -- checkpoints -------------------------------------------------------------------------------

    def _run_state(self) -> dict:
        """What a checkpoint holds besides the model and optimizer (rank 0's RNG state)."""
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
            # batches: f(seed, step, rank, world)
            "data": {"seed": self.data.seed, "fingerprint": self.data_fingerprint, "world": self.data.world},
            "train_config": dataclasses.asdict(self.cfg),
        }

    def _sharded_target(self):
        """What moe_kernels.parallel.checkpoint saves and loads: the Parallelized, the expert-parallel model (its
        splits found from its dispatchers), or the one-process model."""
        if self.parallelized is not None:
            return self.parallelized
        if self.par is not None:
            return _ModelShards(self.model)
        return self.model

    def state(self) -> dict | None:
        """The full training state; under torchrun every rank must call it and rank 0 gets it (the others
        None), expert shards gathered."""
        if self.par is None:
            model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
            optimizer_state["param_names"] = optimizer_names(self.model, self.optimizer)
        else:
            full = (self.parallelized.full_state(self.optimizer) if self.parallelized is not None else
                    distributed.full_state(self.model, self.optimizer, self.par))
            if full is None:
                return None
            model_state, optimizer_state = full
            optimizer_state.setdefault("param_names", optimizer_names(self.model, self.optimizer))
        return {"model": model_state, "optimizer": optimizer_state, **self._run_state()}

    def save(self) -> Path:
        """Writes a checkpoint of this step and points `latest` at it; every rank calls it. Under torchrun a
        sharded checkpoint (each rank writes its shards, moe_kernels.parallel.checkpoint), unless save_full;
        in one process, or with save_full, the full state in one file (rank 0 writes it)."""
        if self.par is not None and not self.cfg.save_full:
            return self._save_sharded()
        state = self.state()
        path = self.out_dir / "checkpoints" / f"step_{self.step:07d}.pt"
        error = None
        if self.is_main:
            try:
                path = checkpoint.save(self.out_dir / "checkpoints", self.step, state, keep=self.cfg.keep_checkpoints)
            except Exception as exc:  # disk full, permissions: every rank stops, not rank 0 alone
                error = exc
        # Also makes sure the file exists before any rank goes on (and may resume from it).
        if self.par is not None and not distributed.all_ranks_ok(error is None, self.device):
            raise RuntimeError(f"saving the step-{self.step} checkpoint failed on rank 0") from error
        if error is not None:
            raise error
        return path

    def _save_sharded(self) -> Path:
        from moe_kernels.parallel.checkpoint import save_sharded

        directory = self.out_dir / "checkpoints"
        path = directory / f"step_{self.step:07d}"
        save_sharded(self._sharded_target(), self.optimizer, path, extra=self._run_state() if self.is_main else None)
        error = None
        if self.is_main:
            try:
                checkpoint.point_latest(directory, path, keep=self.cfg.keep_checkpoints)
            except Exception as exc:  # every rank stops, not rank 0 alone
                error = exc
        if not distributed.all_ranks_ok(error is None, self.device):
            raise RuntimeError(f"pointing {directory / checkpoint.LATEST} at the step-{self.step} checkpoint failed "
                               "on rank 0") from error
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Loads `path`, or the latest checkpoint under out_dir. Returns False when there is none. Raises
        ResumeMismatchError when the checkpoint was written with other RESUME_FIELDS settings, and
        FileNotFoundError when out_dir holds checkpoints but `latest` names none of them."""
        directory = self.out_dir / "checkpoints"
        path = Path(path) if path else checkpoint.latest(directory)
        if self.par is not None:  # every rank resumes from the checkpoint rank 0 sees
            chosen = distributed.broadcast_path(path, self.device)
            path = None if chosen is None else Path(chosen)
        if path is None:
            found = checkpoint.checkpoints(directory)
            if found:
                raise FileNotFoundError(
                    f"{directory / checkpoint.LATEST} is missing or names a missing file, but {directory} holds "
                    f"{', '.join(p.name for p in found)}: write the name of the one to resume from into "
                    f"{directory / checkpoint.LATEST}"
                )
            return False
        if checkpoint.is_sharded(path):  # each rank reads its shards, resharded to this layout
            from moe_kernels.parallel.checkpoint import load_extra, load_sharded

            state = load_extra(path)
            if state is None:
                raise FileNotFoundError(f"{path} is a sharded checkpoint without its training state")
            self.check_resumable(path, state)
            load_sharded(self._sharded_target(), self.optimizer, path)
            self._restore_run_state(path, state)
            return True
        state = checkpoint.load(path)
        self.check_resumable(path, state)
        if self.par is None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        elif self.parallelized is not None:
            self.parallelized.load_full_state(state["model"], self.optimizer, state["optimizer"])
        else:
            distributed.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"], self.par)
        self._restore_run_state(path, state)
        return True

    def _restore_run_state(self, path: Path, state: dict) -> None:
        if self.master is not None:  # the loaded masters' bf16 copies
            self.master.write_compute_copies()
        flags = graphs.optimizer_flags(self.device, self.cfg.cuda_graphs)
        for group in self.optimizer.param_groups:  # this run's implementation, whichever wrote the checkpoint
            group.update(flags)
            for p in group["params"] if flags["fused"] or flags["capturable"] else ():
                saved = self.optimizer.state.get(p, {})
                if torch.is_tensor(saved.get("step")):  # their step counts: fp32 on the parameter's device
                    saved["step"] = saved["step"].to(p.device, torch.float32)
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.data.seed = state["data"]["seed"]
        self.step = state["step"]
        if self.step_graph is not None:  # the loaded optimizer state is new tensors: capture again
            self.lr_schedule.reset(self.step)
            self.step_graph.reset()
        self._new_metrics = False
        self.echo(f"resumed from {path} at step {self.step}")

    def export_hf(self, path: str | Path) -> Path:
        """Writes the full model as a transformers checkpoint (config.json + safetensors) on rank 0, gathered
        from any layout; under torchrun every rank calls it."""
        from moe_kernels.models import save_hf_checkpoint

        error = None
        try:  # every rank stops on a failure, not rank 0 alone
            if self.par is None:
                model = self.model
            elif self.parallelized is not None:
                model = self.parallelized.full_model()
            else:
                full = distributed.full_state(self.model, self.optimizer, self.par)
                model = None if full is None else model_from_state(self.model_config, full[0])
            if model is not None:
                save_hf_checkpoint(model, path)
        except Exception as exc:
            error = exc
        if self.par is not None and not distributed.all_ranks_ok(error is None, self.device):
            raise RuntimeError(f"writing the transformers checkpoint {path} failed on rank 0") from error
        if error is not None:
            raise error
        return Path(path)

    def check_resumable(self, path: Path, state: dict) -> None:
        """Raises ResumeMismatchError listing the RESUME_FIELDS whose saved values differ from this run's.
        The data are compared by content when the checkpoint has their fingerprint, so a moved file
        still resumes."""
        saved = state.get("train_config")
        if saved is None:
            return
        now = dataclasses.asdict(self.cfg)
        saved_data = state.get("data", {}).get("fingerprint")
        differences = {}
        saved_world = state.get("data", {}).get("world", 1)
        for name in RESUME_FIELDS:
            if name == "batch_size" and name in saved:  # the global batch: per rank x ranks
                was, now_global = saved[name] * saved_world, now[name] * self.data.world
                if was != now_global:
                    differences["global batch"] = (f"{saved[name]} x {saved_world} ranks = {was}",
                                                   f"{now[name]} x {self.data.world} ranks = {now_global}")
            elif name == "data" and saved_data is not None:
                if saved_data != self.data_fingerprint:
                    differences[name] = (_describe_data(saved.get(name), saved_data),
                                         _describe_data(now[name], self.data_fingerprint))
            elif name in saved and saved[name] != now[name]:
                differences[name] = (saved[name], now[name])
        if differences:
            raise ResumeMismatchError(Path(path), differences)

    def _dispatchers(self) -> list:
        """The token dispatchers of this rank's MoE layers (under expert tensor parallelism the ep one inside)."""
        return [d for layer in self.model.moe_layers() for d in [getattr(layer.dispatcher, "inner", layer.dispatcher)]
                if d is not None]

    def dropped_tokens(self) -> int | None:
        """Token copies the expert dispatchers dropped for capacity since the last call, summed over the layers
        and the ranks (every rank calls it; one small all_reduce); None when no dispatcher has a capacity
        (only the nvlink backend drops)."""
        dispatchers = [d for d in self._dispatchers() if hasattr(d, "dropped_tokens")]
        if not dispatchers:
            return None
        with warnings.catch_warnings():  # the count goes to the log instead
            warnings.simplefilter("ignore", RuntimeWarning)
            total = sum(int(d.dropped_tokens()) for d in dispatchers)
        if self.par is not None:
            flag = torch.tensor([total], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag)
            total = int(flag.item())
        return total

    # -- loops -------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        if self.parallelized is not None:  # each batch's loss, equal on its ranks; the mean over batches below
            with self._autocast():
                losses = [self.parallelized.evaluate(x.to(self.device), y.to(self.device))
                          for x, y in self.data.eval_batches(self.cfg.eval_batches)]
        else:
            with self._compute():
                losses = [self._loss(x, y)[0] for x, y in self.data.eval_batches(self.cfg.eval_batches)]
        self.model.train()
        loss = torch.stack(losses).mean()
        return float(loss if self.par is None else distributed.mean_over_ranks(loss))

    def _accumulating(self, last: bool):
        """Gradients of a batch before the step's last stay local: no FSDP reduce-scatter, no bucket of the
        expert-parallel path's all-reduce."""
        if self.cfg.grad_accum == 1:
            return contextlib.nullcontext()
        if self.parallelized is not None:
            self.model.set_requires_gradient_sync(last)  # the FSDP root, every unit below it
        elif self.par is not None and self.par.grad_reducer is not None and not last:
            return self.par.grad_reducer.no_sync()
        return contextlib.nullcontext()

    def train_step(self) -> dict:
        if self.step_graph is not None:
            return self._captured_train_step()
        N = self.cfg.grad_accum
        losses = []
        with self._compute():  # with master weights: on exit the fp32 masters, the fp32 sums as gradients
            for j in range(N):  # the step's objective: the mean of its N batches' losses
                inputs, targets = self.data.batch(self.step, j, N)
                with self._accumulating(j == N - 1):
                    if self.parallelized is not None:  # the batch's losses (with pp: the mean over its micro-batches)
                        with self._autocast():
                            losses.append(self.parallelized.forward_backward(
                                inputs.to(self.device), targets.to(self.device), scale=1.0 / N))
                    else:
                        loss, aux = self._loss(inputs, targets)
                        ((loss + aux) / N if N > 1 else loss + aux).backward()
                        losses.append((loss.detach(), aux.detach()))
        loss, aux = (torch.stack(v).mean() for v in zip(*losses)) if N > 1 else losses[0]
        if self.par is None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        elif self.parallelized is not None:  # FSDP reduced the gradients; the norm is over every mesh
            grad_norm = self.parallelized.clip_grad_norm_(self.cfg.grad_clip)
            self.parallelized.reduce_expert_counts()
            loss, aux = distributed.mean_over_ranks(torch.stack([loss.detach(), aux.detach()]))
        else:  # the step's loss is the mean of the ranks' losses; expert-bias counts summed too
            # With master weights after the backward, over the fp32 main gradients (the overlapped buckets would
            # reduce the bf16 gradients before their fold).
            distributed.reduce_gradients(self.model, self.par, overlap=self.master is None)
            grad_norm = distributed.clip_grad_norm(self.model, self.cfg.grad_clip, self.par)
            loss, aux = distributed.mean_over_ranks(torch.stack([loss.detach(), aux.detach()]))
        timer = self._optimizer_timer()
        self.optimizer.step()
        if self.master is not None:
            self.master.write_compute_copies()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        timer()
        for layer in self.model.moe_layers():
            if layer.router.expert_bias is not None:
                layer.router.update_expert_bias()
        self.step += 1
        return {"loss": loss.detach(), "aux_loss": aux.detach(), "grad_norm": grad_norm.detach()}

    def _captured_train_step(self) -> dict:
        """The step through the StepGraph: the batch into its static buffers, then a replay (after the eager
        warm-up steps and the capture)."""
        N = self.cfg.grad_accum
        batches = [self.data.batch(self.step, j, N) for j in range(N)]
        out = self.step_graph(torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches]))
        self.scheduler.step()  # host arithmetic only: the logged lr and the checkpoints' scheduler state
        self.step += 1
        return out

    def _static_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """One training step on device batches [grad_accum, B, S] with no host sync and no value from the host:
        what the StepGraph captures. The same math as train_step in one process, but for the learning rate:
        the device schedule's fp32 tensor (DeviceLRSchedule) instead of LambdaLR's float."""
        loss, aux = self._static_forward_backward(inputs, targets)
        return self._static_update(loss, aux)

    def _static_forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor):
        N = inputs.shape[0]
        losses, auxes = [], []
        with self._compute():
            for j in range(N):
                loss, aux = self._loss(inputs[j], targets[j])
                ((loss + aux) / N if N > 1 else loss + aux).backward()
                losses.append(loss.detach())
                auxes.append(aux.detach())
        if N == 1:
            return losses[0], auxes[0]
        return torch.stack(losses).mean(), torch.stack(auxes).mean()

    def _static_update(self, loss: torch.Tensor, aux: torch.Tensor) -> dict:
        """Clipping, AdamW with the device learning rate, the bf16 copies, the schedule's next value, the
        expert-bias update: all on the device."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        with graphs.device_lr(self.optimizer, self.lr_schedule.lr):
            self.optimizer.step()
        if self.master is not None:
            self.master.write_compute_copies()
        self.lr_schedule.advance()
        self.optimizer.zero_grad(set_to_none=True)
        for layer in self.model.moe_layers():
            if layer.router.expert_bias is not None:
                layer.router.update_expert_bias()
        return {"loss": loss, "aux_loss": aux, "grad_norm": grad_norm.detach()}

    def _optimizer_timer(self):
        """Starts timing the optimizer's part of a step; the returned call ends it. On a GPU, a pair of CUDA
        events (no sync: they are read at the next log, after its synchronize), else the host clock."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._optimizer_times.append((start, end))
            return end.record
        t0 = time.perf_counter()
        return lambda: self._optimizer_times.append(time.perf_counter() - t0)

    def _optimizer_seconds(self) -> float:
        """The optimizer time of the steps since the last call (their events complete: read after a sync)."""
        times, self._optimizer_times = self._optimizer_times, []
        return sum(t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3 for t in times)

    def train(self, progress=None) -> list[dict]:
        """Runs to cfg.steps; returns the logged records. `progress(step)` is called after each step."""
        cfg = self.cfg
        logger = (MetricsLogger(self.out_dir, tensorboard=cfg.tensorboard, echo=self.echo,
                                resume_step=None if self._new_metrics else self.step)
                  if self.is_main else _NoLogger())
        self._new_metrics = False
        records: list[dict] = []
        self.model.train()
        self._optimizer_times = []
        window_start, window_steps = time.perf_counter(), 0
        try:
            while self.step < cfg.steps:
                out = self.train_step()
                window_steps += 1
                if progress is not None:
                    progress(self.step)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    ranks = 1 if self.par is None else self.par.world
                    # all ranks: batch_size sequences per batch, data.world x grad_accum batches a step
                    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * self.data.world
                    tokens_per_s = window_steps * tokens_per_step / elapsed
                    flops = tokens_per_s / ranks * self.flops_per_token  # per GPU, as MFU is
                    record = {
                        "kind": "train", "step": self.step, "loss": float(out["loss"]),
                        "aux_loss": float(out["aux_loss"]), "grad_norm": float(out["grad_norm"]),
                        "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s, "tflops": flops / 1e12,
                        "mfu": flops / self.peak if self.peak else None, "memory_gib": memory_gib(self.device),
                        "tokens_per_step": tokens_per_step,
                        # None with cuda_graphs: the optimizer runs inside the step's one graph
                        "optimizer_share": (min(1.0, self._optimizer_seconds() / elapsed)
                                            if elapsed > 0 and self.step_graph is None else None),
                    }
                    dropped = self.dropped_tokens()
                    if dropped is not None:
                        record["dropped_tokens"] = dropped
                    logger.log(record, line=format_line(record))
                    records.append(record)
                    window_start, window_steps = time.perf_counter(), 0
                paused = time.perf_counter()  # eval and checkpoint time stays out of tokens/s
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    record = {"kind": "eval", "step": self.step, "loss": self.evaluate()}
                    logger.log(record, line=f"step {self.step:>6}  eval_loss {record['loss']:7.4f}")
                    records.append(record)
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self.save()
                window_start += time.perf_counter() - paused
        finally:
            logger.close()
        return records


@dataclasses.dataclass
class _ModelShards:
    """An expert-parallel model as moe_kernels.parallel.checkpoint takes it (its splits from its dispatchers)."""

    model: torch.nn.Module
    sharding: object = None
    stage_group: object = None


class _NoLogger:
    """Ranks other than 0 log nothing."""

    def log(self, record: dict, *, line: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass
