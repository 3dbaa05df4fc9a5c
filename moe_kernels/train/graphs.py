"""Whole-step CUDA graph capture for moe-train on one GPU (`--cuda-graphs`, `TrainConfig(cuda_graphs=True)`).

The static-shape training step (the forward and backward of its grad_accum micro-batches, gradient clipping,
AdamW, the master weights' bf16 copy, the learning-rate schedule and the expert-bias update) is captured once
in one torch.cuda.CUDAGraph and replayed every later step. What a replay needs from the host is the batch,
copied into static input buffers before it; the loss, aux loss and gradient norm are static outputs, read
(with the log's synchronize) only when a step is logged.

- The learning rate is a 0-dim fp32 device tensor that fused AdamW (capturable=True) reads from the device.
  The schedule runs on the device (DeviceLRSchedule): the trainer's warmup + cosine as fp64 tensor ops of a
  device step counter, advanced inside the graph after each optimizer step. The host's LambdaLR still steps
  (host arithmetic only, no device work) for the logged learning rate and the checkpoints.
- Clipping is torch.nn.utils.clip_grad_norm_ (foreach on CUDA): the norm and the clamped scale stay on the
  device. Aux-loss-free balancing updates the expert bias from the routers' device counts.
- Warm-up: the first WARMUP_STEPS steps run eagerly on a side stream (as torch.cuda.graphs asks: the
  optimizer state, cuBLAS handles and workspaces exist before capture); they are training steps like the
  rest, so a captured run equals the same step run eagerly throughout, bit for bit.

Refused (TrainConfig, Trainer): a device other than CUDA, more than one process (torchrun, expert
parallelism, FSDP2 and the other parallelize() layouts, pipeline parallelism), the nvlink capacity (tokens
dropped by the receiving rank), global load balancing (an all-reduce across ranks), activation checkpointing
(torch.utils.checkpoint saves and restores the RNG state on the host) and the FP8 / NVFP4 recipes (the FP8
weight cache is looked up on the host by version counter, which a replay does not repeat; NVFP4 copies host
constants to the device). The step reads nothing on the host (ARCHITECTURE decision 4; checked with
moe_kernels.testing.no_host_sync and torch's sync debug mode in tests/train/test_cuda_graphs_gpu.py).
Gradient accumulation is captured as N forwards and backwards in the one graph.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

WARMUP_STEPS = 2  # eager steps on a side stream before the capture

_UNCAPTURED_WARNING = "This instance was constructed with capturable=True"


def refusal(cfg) -> str | None:
    """Why `cfg` (a TrainConfig) cannot capture its step, or None. The device is checked by the trainer once it
    has resolved it (check_device)."""
    why = None
    if cfg.sharded:
        why = "a parallelize() layout (dp_shard, dp_replicate, tp, cp, etp, pp) runs collectives between processes"
    elif cfg.expert_parallel > 1:
        why = "expert parallelism exchanges tokens between processes"
    elif cfg.capacity_factor is not None:
        why = "capacity_factor drops tokens at the receiving rank"
    elif cfg.global_load_balancing:
        why = "global_load_balancing all-reduces the expert counts across processes"
    elif cfg.activation_checkpointing:
        why = "activation checkpointing saves and restores the RNG state on the host"
    elif cfg.precision != "bf16":
        why = (f"precision={cfg.precision!r} quantizes through host-side state (the FP8 weight cache is looked up "
               "by version counter, which a replay does not repeat; NVFP4 copies host constants to the device)")
    return None if why is None else f"cuda_graphs (--cuda-graphs) captures one GPU's whole step: {why}"


def check_device(device: torch.device, world: int) -> None:
    """Raises ValueError unless the trainer runs in one process on a CUDA device."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs (--cuda-graphs) captures the step in a CUDA graph: the device is {device}, "
                         "not a CUDA device")
    if world > 1:
        raise ValueError(f"cuda_graphs (--cuda-graphs) captures one GPU's whole step: this run has {world} "
                         "processes (torchrun); run it in one process")


def optimizer_flags(device: torch.device, cuda_graphs: bool) -> dict:
    """AdamW's implementation flags: fused on CUDA (and for the captured step on any device, the CPU's fused
    kernel taking the tensor learning rate without a host read); capturable where the step is captured."""
    return {"fused": device.type == "cuda" or cuda_graphs, "capturable": cuda_graphs and device.type == "cuda"}


class DeviceLRSchedule:
    """The trainer's schedule (moe_kernels.train.trainer.lr_factor: linear warmup, then cosine to min_lr_ratio)
    on the device: `lr` = cfg.lr * factor(`step`), a 0-dim fp32 tensor computed from the int64 device counter
    `step` by fp64 tensor ops, in the host formula's order of operations.

    Error model against the host's LambdaLR (fp64 Python floats): the warmup ratio, the progress and every
    product and sum are the same correctly rounded fp64 operations; only the cosine may differ (the device's
    fp64 cos is within 2 ulp, glibc's within 1), so the fp64 values agree within a few ulp of fp64, and the fp32
    learning rate AdamW reads is the host value rounded to fp32 unless the two straddle an fp32 rounding
    boundary (then one fp32 ulp apart)."""

    def __init__(self, cfg, device: torch.device, step: int = 0):
        self.base_lr, self.warmup_steps, self.steps, self.min_lr_ratio = (
            cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.reset(step)

    def factor(self) -> Tensor:
        """factor(step) in fp64: the host's lr_factor, as tensor ops (no host read)."""
        s = self.step.to(torch.float64)
        W = self.warmup_steps
        progress = (s - W) / max(1, self.steps - W)
        r = self.min_lr_ratio
        cosine = r + (1 - r) * 0.5 * (1 + torch.cos(math.pi * progress.clamp(max=1.0)))
        if W == 0:
            return cosine
        return torch.where(s < W, (s + 1) / W, cosine)

    def value(self) -> Tensor:
        """cfg.lr * factor(step) in fp64 (LambdaLR's base_lr * factor)."""
        return self.base_lr * self.factor()

    @torch.no_grad()
    def update(self) -> None:
        self.lr.copy_(self.value())

    @torch.no_grad()
    def advance(self) -> None:
        """After an optimizer step: step += 1 and the learning rate of the next (inside the graph)."""
        self.step.add_(1)
        self.update()

    @torch.no_grad()
    def reset(self, step: int) -> None:
        """The counter set from the host (at construction and on resume, outside the graph)."""
        self.step.fill_(step)
        self.update()


class device_lr:
    """Inside, every param group of `optimizer` reads its learning rate from the tensor `lr` (fused AdamW reads
    it on the device); on exit the groups get their host floats back, so LambdaLR and the optimizer's
    state_dict see what they do without graphs."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: Tensor):
        self.optimizer, self.lr = optimizer, lr

    def __enter__(self):
        self.saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def __exit__(self, *exc):
        for group, lr in zip(self.optimizer.param_groups, self.saved):
            group["lr"] = lr


class StepGraph:
    """A step `step_fn(inputs, targets) -> dict of tensors` over static input buffers: the first `warmup` calls
    run it eagerly on a side stream, the next captures it in a CUDAGraph and every call from then on copies its
    batch into the buffers and replays the graph, returning the same static output tensors (valid until the
    next call). With `capture` False (and on a device other than CUDA) every call runs eagerly: the reference a
    captured run is compared with."""

    def __init__(self, step_fn: Callable[[Tensor, Tensor], dict], shape: tuple[int, ...], device: torch.device,
                 *, warmup: int = WARMUP_STEPS, capture: bool = True):
        self.step_fn, self.warmup = step_fn, warmup
        self.capture = capture and device.type == "cuda"
        self.inputs = torch.zeros(shape, dtype=torch.int64, device=device)
        self.targets = torch.zeros(shape, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: dict | None = None
        self.eager_calls = 0
        self._side: torch.cuda.Stream | None = None  # the warm-up's stream, one for all its steps

    def reset(self) -> None:
        """Drops the graph (after a checkpoint load replaced the optimizer state it reads): the next calls warm
        up and capture again."""
        self.graph, self.outputs, self.eager_calls = None, None, 0

    def __call__(self, inputs: Tensor, targets: Tensor) -> dict:
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        if not self.capture:
            return self._eager()
        if self.eager_calls < self.warmup:
            if self._side is None:
                self._side = torch.cuda.Stream(self.inputs.device)
            self._side.wait_stream(torch.cuda.current_stream(self.inputs.device))
            with torch.cuda.stream(self._side):
                out = self._eager()
            torch.cuda.current_stream(self.inputs.device).wait_stream(self._side)
            return out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.step_fn(self.inputs, self.targets)
        self.graph, self.outputs = graph, outputs
        graph.replay()  # capture records the kernels without running them: this step runs now
        return outputs

    def _eager(self) -> dict:
        self.eager_calls += 1
        with warnings.catch_warnings():  # capturable AdamW stepping outside a capture: the warm-up does
            warnings.filterwarnings("ignore", message=_UNCAPTURED_WARNING)
            return self.step_fn(self.inputs, self.targets)
