"""`moe-train`: train a preset MoE model on the embedded corpus or your own data."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

app = typer.Typer(add_completion=False, help=__doc__)

# TrainConfig fields that are options of this command (--batch-size sets batch_size, ...).
OPTION_FIELDS = ("preset", "num_layers", "data", "batch_size", "seq_len", "lr")


@app.command()
def train(
    preset: str = typer.Option("tiny-qwen3-moe", help="Model preset (see --list-presets)."),
    data: Optional[Path] = typer.Option(None, help="Text file (byte tokens) or .npy of token ids; default: embedded corpus."),
    steps: int = typer.Option(300, help="Optimizer steps."),
    batch_size: int = typer.Option(8),
    seq_len: int = typer.Option(128),
    lr: float = typer.Option(3e-3, help="Peak learning rate (linear warmup, then cosine)."),
    warmup_steps: int = typer.Option(20),
    num_layers: Optional[int] = typer.Option(None, help="Override the preset's number of layers."),
    out: Path = typer.Option(Path("runs/default"), help="Run directory: metrics.jsonl, checkpoints/."),
    resume: bool = typer.Option(False, help="Continue from the latest checkpoint in --out."),
    overwrite: bool = typer.Option(False, help="Delete the checkpoints and metrics already in --out, then start anew."),
    log_every: int = typer.Option(10),
    eval_every: int = typer.Option(100),
    checkpoint_every: int = typer.Option(100),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when available)."),
    bf16: bool = typer.Option(True, help="bf16 compute on a GPU (master weights, or autocast with "
                              "--no-master-weights)."),
    master_weights: Optional[bool] = typer.Option(None, "--master-weights/--no-master-weights", help="bf16 "
                                                  "parameters for compute, fp32 master weights and gradients for "
                                                  "AdamW, no autocast (under --dp-shard etc.: FSDP's bf16 / fp32 "
                                                  "policy). Default: on with --bf16 on a GPU; forced on, on the CPU "
                                                  "too."),
    precision: str = typer.Option("bf16", help="Expert GEMMs: bf16 (the autocast precision), fp8-blockwise "
                                  "(DeepSeek-V3's FP8 recipe; hidden and expert sizes multiples of 16) or nvfp4 "
                                  "(the NVFP4 recipe's numerics, not faster on Hopper; sizes multiples of 16)."),
    activation_checkpointing: bool = typer.Option(False, help="Recompute each block in the backward pass."),
    fused_ce: bool = typer.Option(True, help="The lm_head and cross-entropy fused over chunks of tokens (no "
                                  "tokens x vocabulary fp32 logits); --no-fused-ce: F.cross_entropy over the logits."),
    tensorboard: bool = typer.Option(False, help="Also write TensorBoard logs to --out/tensorboard."),
    seed: int = typer.Option(0),
    expert_parallel: int = typer.Option(1, "--ep", "--expert-parallel",
                                        help="Under torchrun: ranks per expert-parallel group (divides the number of "
                                        "ranks); the rest of the model is data-parallel."),
    plan: bool = typer.Option(False, "--plan", help="Print the layout's per-GPU memory (parameters, gradients, "
                              "optimizer state, activations) and whether it fits, without torchrun or weights; exit."),
    world_size: Optional[int] = typer.Option(None, help="With --plan: the number of GPUs (default: the fewest the "
                                             "layout allows)."),
    dp_shard: Optional[int] = typer.Option(None, help="FSDP ranks (default: what the world leaves; given, the run "
                                           "shards parameters, gradients and optimizer state)."),
    dp_replicate: int = typer.Option(1, help="Data-parallel replicas (HSDP with --dp-shard)."),
    tp: int = typer.Option(1, help="Tensor-parallel ranks (attention heads, dense layers; sequence parallel)."),
    cp: int = typer.Option(1, help="Context-parallel ranks (each holds part of every sequence)."),
    pp: int = typer.Option(1, help="Pipeline stages (consecutive layers; each stage's ranks shard it as above)."),
    microbatches: Optional[int] = typer.Option(None, help="With --pp: micro-batches a step (default: --pp); each "
                                               "holds batch-size / microbatches sequences."),
    pp_schedule: str = typer.Option("1f1b", help="With --pp: 1f1b, gpipe or interleaved-1f1b (two stages a rank)."),
    etp: int = typer.Option(1, help="Expert tensor parallelism (each expert's ffn split over etp ranks)."),
    gpu_memory_gb: float = typer.Option(80.0, help="With --plan: the GPU memory the verdict compares with."),
    ep_backend: str = typer.Option("all_to_all", help="Token dispatch between expert-parallel ranks: all_to_all "
                                   "(torch.distributed, any devices), all_gather (small groups, large k) or nvlink "
                                   "(our kernels over peer GPU buffers within one node, no host sync)."),
    global_load_balancing: bool = typer.Option(False, help="Under torchrun: the load-balancing loss counts "
                                               "experts over the global batch (Qwen's global-batch balancing)."),
    grad_accum: int = typer.Option(1, help="Batches of --batch-size each step accumulates (its loss: their mean)."),
    capacity_factor: Optional[float] = typer.Option(None, help="With --ep-backend nvlink: the expert rows a rank "
                                                    "receives at most, as a factor of the balanced load (tokens past "
                                                    "it are dropped and logged); default: the worst case, none "
                                                    "dropped."),
    save_full: bool = typer.Option(False, help="Under torchrun: write each checkpoint as one full-state file (rank 0 "
                                   "gathers and writes it) instead of sharded checkpoints (every rank writes its "
                                   "shards; resumable under any layout)."),
    pg_timeout: float = typer.Option(10.0, help="Under torchrun: minutes a collective may wait before the run fails."),
    cuda_graphs: bool = typer.Option(False, "--cuda-graphs", help="Capture the whole training step (forward, "
                                     "backward, clipping, AdamW, lr schedule) in one CUDA graph after two eager "
                                     "steps and replay it: one process on one GPU, bf16 expert GEMMs, no "
                                     "activation checkpointing."),
    export_hf: Optional[Path] = typer.Option(None, help="After training, write the full model (gathered from any "
                                             "layout) as a transformers checkpoint (config.json + safetensors) here."),
    list_presets: bool = typer.Option(False, "--list-presets", help="Print the presets and exit."),
) -> None:
    from moe_kernels.models import PRESETS
    from moe_kernels.train import checkpoint
    from moe_kernels.train.trainer import TrainConfig, Trainer

    console = Console(stderr=True)
    if list_presets:
        for name in sorted(PRESETS):
            print(name)
        raise typer.Exit()
    from moe_kernels.parallel.layout import ParallelConfig

    try:
        layout = ParallelConfig(dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, cp=cp, pp=pp, ep=expert_parallel,
                                etp=etp)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if plan:
        _plan(layout, preset, num_layers, batch_size, seq_len, activation_checkpointing, world_size, gpu_memory_gb,
              ep_backend=ep_backend, capacity_factor=capacity_factor, microbatches=microbatches,
              pp_schedule=pp_schedule, fused_ce=fused_ce, master_weights=bf16 if master_weights is None else master_weights)
        raise typer.Exit()
    if world_size is not None:
        raise typer.BadParameter("--world-size is for --plan only (the world size is torchrun's)",
                                 param_hint="'--world-size'")
    try:
        cfg = TrainConfig(
            preset=preset, data=str(data) if data else None, steps=steps, batch_size=batch_size, seq_len=seq_len,
            lr=lr, warmup_steps=min(warmup_steps, steps), num_layers=num_layers, out_dir=str(out), log_every=log_every,
            eval_every=eval_every, checkpoint_every=checkpoint_every, device=device, bf16=bf16,
            master_weights=master_weights, precision=precision,
            activation_checkpointing=activation_checkpointing, fused_ce=fused_ce, tensorboard=tensorboard, seed=seed,
            expert_parallel=expert_parallel, ep_backend=ep_backend, global_load_balancing=global_load_balancing,
            dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, cp=cp, etp=etp, pp=pp, microbatches=microbatches,
            pp_schedule=pp_schedule, grad_accum=grad_accum, capacity_factor=capacity_factor, save_full=save_full,
            pg_timeout_minutes=pg_timeout, cuda_graphs=cuda_graphs,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    checkpoints = out / "checkpoints"
    if resume and overwrite:
        raise typer.BadParameter("--overwrite discards what --resume would continue: pass one of them",
                                 param_hint="'--overwrite'")
    has_run = bool(checkpoint.checkpoints(checkpoints)) or (checkpoints / checkpoint.LATEST).exists()
    if has_run and not resume and not overwrite:
        raise typer.BadParameter(
            f"{out} already holds checkpoints of a run. Pass --resume to continue it, --overwrite to delete its "
            f"checkpoints and metrics and start anew, or choose another --out.", param_hint="'--out'",
        )
    try:
        trainer = Trainer(cfg, echo=print)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        _start(trainer, cfg, console, out, checkpoints, resume, overwrite)
        if export_hf is not None:
            trainer.export_hf(export_hf)
            if trainer.is_main:
                print(f"wrote a transformers checkpoint to {export_hf}")
    finally:
        trainer.close()


def _plan(layout, preset: str, num_layers, batch_size: int, seq_len: int, checkpointing: bool, world_size,
          gpu_memory_gb: float, *, ep_backend: str = "all_to_all", capacity_factor: float | None = None,
          microbatches: int | None = None, pp_schedule: str = "1f1b", fused_ce: bool = True,
          master_weights: bool = True) -> None:
    """moe-train --plan: the layout, its per-GPU memory table and the verdict; exit 1 for an impossible layout.
    With pipeline stages the step's batch splits into micro-batches, as training splits it. A layout that trains
    without FSDP (expert parallelism alone, or one GPU) counts master weights unless they are off; one under
    FSDP counts FSDP's fp32 shards and bf16 gathered copies."""
    from moe_kernels.models import PRESETS
    from moe_kernels.parallel.plan import plan_memory

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}", param_hint="'--preset'")
    overrides = {"max_seq_len": max(seq_len, PRESETS[preset]().max_seq_len)}
    if num_layers is not None:
        overrides["num_layers"] = num_layers
    cfg = PRESETS[preset](**overrides)
    without_fsdp = (layout.dp_shard is None and layout.dp_replicate * layout.tp * layout.cp * layout.pp
                    * layout.etp == 1)  # TrainConfig.sharded is False
    try:
        layout = layout.resolve(world_size)
        n_mb = (microbatches or layout.pp) if layout.pp > 1 else 1
        if batch_size % n_mb:
            raise ValueError(f"batch_size {batch_size} must split into {n_mb} micro-batches")
        memory = plan_memory(cfg, layout, batch_size=batch_size // n_mb, seq_len=seq_len,
                             activation_checkpointing=checkpointing, gpu_bytes=gpu_memory_gb * 1e9,
                             ep_backend=ep_backend, capacity=capacity_factor,
                             num_microbatches=n_mb if layout.pp > 1 else None, schedule=pp_schedule,
                             fused_loss=fused_ce, master_weights=master_weights and without_fsdp)
    except ValueError as exc:
        print(f"moe-train --plan: {preset}: {exc}")
        raise typer.Exit(1) from exc
    print(f"moe-train --plan: {preset}, {layout.describe()}"
          f"{f', {ep_backend} dispatch' if layout.ep * layout.etp > 1 else ''}"
          f"{f', capacity {capacity_factor:g}x' if capacity_factor is not None else ''}")
    print(f"per GPU, {batch_size // n_mb} x {seq_len} tokens per micro-batch"
          f"{f' ({n_mb} a step, {pp_schedule})' if layout.pp > 1 else ''}"
          f"{', activation checkpointing' if checkpointing else ''}:")
    print(memory.table())
    print(memory.verdict())


def _start(trainer, cfg, console: Console, out: Path, checkpoints: Path, resume: bool, overwrite: bool) -> None:
    from moe_kernels.train import checkpoint, metrics
    from moe_kernels.train.trainer import ResumeMismatchError

    if overwrite and trainer.is_main:
        checkpoint.clear(checkpoints)
        metrics.clear(out)
    if trainer.par is not None:
        import torch.distributed as dist

        dist.barrier()
    try:
        resumed = resume and trainer.resume()
    except ResumeMismatchError as exc:
        names = ["batch_size" if name == "global batch" else name for name in exc.differences]
        options = [f"'--{name.replace('_', '-')}'" for name in names if name in OPTION_FIELDS]
        raise typer.BadParameter(
            f"{exc}\nResume with the checkpoint's settings, or start a new run with another --out (or --overwrite).",
            param_hint=", ".join(options) or "'--resume'",
        ) from exc
    except FileNotFoundError as exc:
        raise typer.BadParameter(f"{exc}, or start anew with --overwrite.", param_hint="'--resume'") from exc
    if not trainer.is_main:
        pass
    elif resume and not resumed:
        console.print(f"no checkpoint in {checkpoints}: starting from step 0")
    elif resumed and trainer.step >= cfg.steps:
        console.print(f"the checkpoint is at step {trainer.step}, --steps is {cfg.steps}: nothing to train")
    _run(trainer, cfg, console, out)


def _run(trainer, cfg, console: Console, out: Path) -> None:
    if not trainer.is_main:  # one rank reports
        trainer.train()
        return
    n_params = trainer.num_parameters()
    print(
        f"moe-train: {cfg.preset} ({n_params / 1e6:.2f}M parameters) on {trainer.device}{trainer.layout()}, "
        f"{trainer.data.vocab_size}-token vocabulary, {len(trainer.data.train):,} training tokens, "
        f"{trainer.flops_per_token / 1e6:.1f} MFLOP/token"
    )
    if console.is_terminal:
        with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("train", total=cfg.steps, completed=trainer.step)
            records = trainer.train(progress=lambda s: bar.update(task, completed=s))
    else:
        records = trainer.train()
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    if evals:
        print(f"done: eval loss {evals[-1]:.4f} after {trainer.step} steps; metrics in {out / 'metrics.jsonl'}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
