"""Pipeline parallelism for a moe_kernels MoETransformer on torch.distributed.pipelining, applied from outside.

`apply_pipeline_parallel(model, group, num_microbatches, schedule="1f1b")` keeps, on each of the P ranks of
`group`, the transformer blocks of its stage (contiguous, as even as the depth allows; "interleaved-1f1b"
gives each rank v stages, blocks round-robin over the P * v stages, `stages_per_rank=v`); the first stage
also embeds, the last also normalises and projects to the vocabulary and computes the loss. The returned
`Pipelined` runs a step's micro-batches through PyTorch's schedule (1F1B, GPipe or interleaved 1F1B):

    pipe = apply_pipeline_parallel(model, pp_group, num_microbatches=4)
    loss = pipe.step(ids[:, :-1], ids[:, 1:])     # the step's loss on every rank; gradients accumulated
    pipe.clip_grad_norm_(1.0); optimizer.step()   # optimizer over pipe.parameters()

The last stage's loss is fused by default (`fused_loss=True`): the stage returns the final norm's hidden states and
the schedule's loss function applies the lm_head weight in moe_kernels.nn.linear_cross_entropy, chunk by chunk,
so no [micro-batch tokens, V] logits exist; `fused_loss=False` returns the logits and computes the loss from them.

The objective is the mean over micro-batches of each micro-batch's cross-entropy plus its routing losses
(Megatron-Core's per-micro-batch aux losses). A stage's aux losses reach the backward through
`_AuxLossScaler` on the stage's output, the mechanism of Megatron-Core's MoEAuxLossAutoScaler: an identity
in the forward whose backward also starts the aux loss's backward (gradient 1; the schedule then divides
every gradient by the number of micro-batches, as it does the cross-entropy's). The stage modules keep the
model's parameter names (`layers.7.mlp.experts.w13` stays so), so a checkpoint of each stage's state dict
merges into the full model's.

`parallelize(model, ParallelConfig(pp=..., ...), num_microbatches=...)` composes the stages with the other
dimensions: each stage's ranks shard its blocks (FSDP, tp, cp, ep, etp) as they would the whole model, and
the pipeline runs over the pp group (`Parallelized.forward_backward`). Tied embeddings across the first and
last stage are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from moe_kernels.parallel.sequence import cross_entropy_share, linear_cross_entropy_share

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


class _AuxLossScaler(torch.autograd.Function):
    """forward(h, aux) = h; backward: the gradient of h, and 1 for aux (its backward runs with h's)."""

    @staticmethod
    def forward(ctx, h: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class PipelineStageModule(nn.Module):
    """Blocks [first, last) of a MoETransformer, with the embedding on stage 0 and the final norm and lm_head
    on the last stage: forward(ids or hidden [B, S, H]) -> hidden (on the last stage logits, or with
    `return_hidden` the final norm's hidden states for a fused loss)."""

    def __init__(self, model: nn.Module, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        self.embed_tokens = model.embed_tokens if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.activation_checkpointing = model.activation_checkpointing
        self.aux_values: list[Tensor] = []  # this stage's aux loss of each micro-batch of the step (detached)
        # The sequences' length (the rotary tables' rows): the hidden states hold fewer tokens a rank under
        # sequence or context parallelism. None: the hidden states' length.
        self.seq_len: int | None = None
        # The dtype of the hidden states sent to the next stage (the receiver's buffers are sized for it).
        self.activation_dtype: torch.dtype | None = None
        self.return_hidden = False  # the last stage returns norm(h), not logits (Pipelined with a fused loss)

    def forward(self, x: Tensor) -> Tensor:
        from moe_kernels.models.transformer import _checkpoint_contexts, rope_cos_sin

        S = x.shape[1] if self.is_first or self.seq_len is None else self.seq_len
        h = self.embed_tokens(x) if self.is_first else x
        cos, sin = rope_cos_sin(self.config, S, h.device, h.dtype)
        aux = torch.zeros((), device=h.device, dtype=torch.float32)
        for block in self.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                h, layer_aux = checkpoint(block, h, cos, sin, use_reentrant=False, context_fn=_checkpoint_contexts)
            else:
                h, layer_aux = block(h, cos, sin)
            aux = aux + layer_aux
        if self.is_last:
            h = self.norm(h) if self.return_hidden else self.lm_head(self.norm(h))
        if (not self.is_last or self.return_hidden) and self.activation_dtype is not None:
            h = h.to(self.activation_dtype)  # (the last stage's hidden states: the dtype its output was declared in)
        self.aux_values.append(aux.detach())
        return _AuxLossScaler.apply(h, aux) if aux.requires_grad else h

    def moe_layers(self):
        return (block.mlp for block in self.layers.values() if block.is_moe)


class LocalStages(nn.Module):
    """The part of a MoETransformer one pipeline rank holds, under the full model's names (`layers.7...`):
    its stages' blocks, the embedding on the first stage's rank, the final norm and lm_head on the last's.
    For state dicts, parameters and the MoE layers; the stages run through Pipelined."""

    def __init__(self, model: nn.Module, modules: list[PipelineStageModule]):
        super().__init__()
        self.config = model.config
        first = next((m for m in modules if m.is_first), None)
        last = next((m for m in modules if m.is_last), None)
        self.embed_tokens = first.embed_tokens if first is not None else None
        self.layers = nn.ModuleDict({k: b for m in modules for k, b in m.layers.items()})
        self.norm = last.norm if last is not None else None
        self.lm_head = last.lm_head if last is not None else None

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's stages run through the schedule: Parallelized.forward_backward(inputs, "
                           "labels)")

    def moe_layers(self):
        return (block.mlp for block in self.layers.values() if block.is_moe)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        raise RuntimeError("set activation checkpointing on the model before parallelize()")


@dataclass
class Pipelined:
    """What apply_pipeline_parallel set up on this rank: its stage modules, and the schedule (built at the first
    step, when the micro-batches' shapes are known: the stages then know their inputs' and outputs' shapes
    and dtypes and skip PyTorch's metadata inference, which would run each stage's forward once more on
    uninitialised tensors and count those tokens in the routers' expert-bias statistics)."""

    modules: list[PipelineStageModule]
    stage_ids: list[int]
    num_stages: int
    schedule_name: str
    group: object
    num_microbatches: int
    # (logits, the micro-batch's labels) -> its mean cross-entropy, or this rank's share of it
    loss_fn: object = partial(cross_entropy_share, sharding=None)
    # With it, the fused loss instead: (hidden, the lm_head weight, labels) -> the same (the last stage returns
    # its hidden states; linear_cross_entropy_share). None: loss_fn over the logits.
    hidden_loss_fn: object = partial(linear_cross_entropy_share, sharding=None)
    seq_group: object = None  # the ranks that share a batch's sequences (their losses are shares), or None
    seq_split: int = 1  # the tokens of a sequence a rank holds: S / seq_split
    activation_dtype: torch.dtype | None = None  # the hidden states' dtype between stages (None: the parameters')
    schedule: object = None
    _shapes: tuple | None = None

    def _build(self, inputs: Tensor) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        mb, S = inputs.shape[0] // self.num_microbatches, inputs.shape[1]
        shapes = (mb, S, torch.is_autocast_enabled(self._device().type))
        if self.schedule is not None:
            if shapes != self._shapes:
                raise ValueError(f"Pipelined.step: micro-batches of {mb} x {S} tokens (autocast {shapes[2]}); the "
                                 f"schedule was built for {self._shapes[0]} x {self._shapes[1]} (autocast "
                                 f"{self._shapes[2]})")
            return
        cfg = self.modules[0].config
        p = next(self.modules[0].parameters())
        dtype = self.activation_dtype or p.dtype
        if S % self.seq_split:
            raise ValueError(f"Pipelined.step: sequences of {S} tokens do not split over {self.seq_split} ranks")
        local = S // self.seq_split
        hidden = torch.empty(mb, local, cfg.hidden_size, dtype=dtype, device="meta")
        fused = self.hidden_loss_fn is not None
        logits_dtype = torch.get_autocast_dtype(p.device.type) if shapes[2] else dtype
        logits = (hidden if fused else  # the fused loss's last stage returns its hidden states (in `dtype`)
                  torch.empty(mb, local, cfg.vocab_size, dtype=logits_dtype, device="meta"))
        stages = []
        for m in self.modules:
            m.seq_len, m.activation_dtype, m.return_hidden = S, dtype, fused
        loss_fn = self.loss_fn
        if fused:
            last = next((m for m in self.modules if m.is_last), None)
            # The weight is read at each call: FSDP swaps the module's parameter between its shards and the
            # gathered tensor.
            loss_fn = partial(_head_loss, self.hidden_loss_fn, last)
        for m, s in zip(self.modules, self.stage_ids):
            # A hidden input requires its gradient (the previous stage's backward needs it).
            first = (torch.empty(mb, S, dtype=inputs.dtype, device="meta") if m.is_first else
                     hidden.clone().requires_grad_())
            stages.append(PipelineStage(m, s, self.num_stages, p.device, input_args=first,
                                        output_args=logits if m.is_last else hidden,
                                        input_grads=(None,) if m.is_first else hidden,
                                        output_grads=(None,) if m.is_last else hidden, group=self.group))
        if self.schedule_name == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, self.num_microbatches, loss_fn=loss_fn)
        else:
            cls = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
            self.schedule = cls(stages[0], self.num_microbatches, loss_fn=loss_fn)
        self._shapes = shapes

    def _device(self) -> torch.device:
        return next(self.modules[0].parameters()).device

    @property
    def is_first(self) -> bool:
        return any(m.is_first for m in self.modules)

    @property
    def is_last(self) -> bool:
        return any(m.is_last for m in self.modules)

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        seen = set()
        for m in self.modules:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def step(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """One step's forward and backward over its micro-batches (the batch dimension split evenly); every
        rank passes the whole batch (the first stage reads the inputs, the last the targets). Returns the
        step's mean cross-entropy and mean aux loss, on every rank; the gradients are accumulated."""
        return self._run(inputs, targets, train=True)

    @torch.no_grad()
    def evaluate(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The batch's mean cross-entropy over its micro-batches, forward only; on every rank. Call it with no
        gradients pending: PyTorch's schedule still runs its end-of-step gradient reduction and scaling."""
        return self._run(inputs, targets, train=False)[0]

    def _run(self, inputs: Tensor, targets: Tensor, train: bool) -> tuple[Tensor, Tensor]:
        """The schedule's step (train) or eval over the batch's micro-batches; the mean cross-entropy and aux
        loss, summed over the stages and the ranks that share the sequences."""
        B = inputs.shape[0]
        if B % self.num_microbatches:
            raise ValueError(f"Pipelined: the batch of {B} sequences does not split into "
                             f"num_microbatches={self.num_microbatches}")
        self._build(inputs)
        for m in self.modules:
            m.aux_values.clear()
        losses: list[Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        run = self.schedule.step if train else self.schedule.eval
        run(*args, **kwargs, return_outputs=False)  # (the last stage keeps no logits)
        device = self._device()
        # Each micro-batch's aux loss is the sum over the stages; the mean over micro-batches.
        aux = sum((torch.stack(m.aux_values).sum() for m in self.modules if m.aux_values),
                  torch.zeros((), device=device))
        ce = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
        out = torch.stack([ce.float(), aux.float()])
        dist.all_reduce(out, group=self.group)  # the last stage's losses, every stage's aux losses
        if self.seq_group is not None:  # the shares of the ranks that hold the batch's sequences
            dist.all_reduce(out, group=self.seq_group)
        return out[0] / self.num_microbatches, out[1] / self.num_microbatches

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        device = next(self.modules[0].parameters()).device
        sq = torch.zeros((), device=device, dtype=torch.float32)
        for _, p in self.named_parameters():
            if p.grad is not None:
                sq += p.grad.detach().float().square().sum()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clips by the norm over every stage's gradients (the full model's); returns that norm."""
        norm = self.grad_norm()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for _, p in self.named_parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    def moe_layers(self):
        for m in self.modules:
            yield from m.moe_layers()


def _head_loss(hidden_loss_fn, last: PipelineStageModule, hidden: Tensor, labels: Tensor) -> Tensor:
    return hidden_loss_fn(hidden, last.lm_head.weight, labels)


def stage_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[first, last) blocks of each stage: contiguous, the first num_layers % num_stages stages one longer."""
    base, extra = divmod(num_layers, num_stages)
    bounds, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (s < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def apply_pipeline_parallel(model: nn.Module, group=None, *, num_microbatches: int, schedule: str = "1f1b",
                            stages_per_rank: int = 1, fused_loss: bool = True) -> Pipelined:
    """Pipeline stages of `model` (a moe_kernels MoETransformer, built identically on every rank) over the
    ranks of `group` (default: the world); module docstring. Rank r holds stage r (interleaved: stages
    r, r + P, ...). fused_loss: the last stage's loss by linear_cross_entropy (no logits)."""
    check_pipeline(model, dist.get_world_size(group), num_microbatches, schedule, stages_per_rank)
    return Pipelined(*stage_modules(model, dist.get_world_size(group), dist.get_rank(group), stages_per_rank),
                     schedule, group, num_microbatches,
                     hidden_loss_fn=partial(linear_cross_entropy_share, sharding=None) if fused_loss else None)


def check_pipeline(model: nn.Module, P: int, num_microbatches: int, schedule: str, stages_per_rank: int,
                   who: str = "apply_pipeline_parallel") -> None:
    """ValueError (NotImplementedError for tied embeddings) when `model` cannot run as P ranks' stages; `who`
    names the caller in the messages."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "embed_tokens"):
        raise ValueError(f"{who}: a moe_kernels.models MoETransformer is expected")
    check_schedule(P, num_microbatches, schedule, stages_per_rank, len(layers), who)
    if model.lm_head is None and P > 1:
        raise NotImplementedError(f"{who}: tied embeddings (the first and last stage would share "
                                  "the embedding) are not supported")


def check_schedule(P: int, num_microbatches: int, schedule: str, stages_per_rank: int, num_layers: int,
                   who: str) -> None:
    """The schedules' rules for P pipeline ranks (ValueError naming the numbers), before anything is built."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{who}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    v = stages_per_rank
    if v < 1 or (v > 1) != (schedule == "interleaved-1f1b"):
        raise ValueError(f"{who}: stages_per_rank={v}: more than 1 with schedule="
                         "'interleaved-1f1b' only, which needs at least 2")
    if num_microbatches < 1:
        raise ValueError(f"{who}: num_microbatches must be >= 1, got {num_microbatches}")
    if schedule == "1f1b" and num_microbatches < P:
        raise ValueError(f"{who}: 1F1B needs num_microbatches={num_microbatches} >= the {P} pipeline "
                         "stages (GPipe takes fewer)")
    if schedule == "interleaved-1f1b" and num_microbatches % P:
        raise ValueError(f"{who}: the interleaved schedule needs num_microbatches="
                         f"{num_microbatches} to be a multiple of the {P} pipeline ranks")
    if num_layers < P * v:
        raise ValueError(f"{who}: {num_layers} layers do not fill {P * v} stages ({P} ranks x "
                         f"stages_per_rank={v})")


def stage_modules(model: nn.Module, P: int, r: int, v: int = 1) -> tuple[list[PipelineStageModule], list[int], int]:
    """Pipeline rank r's stage modules (of P * v stages), their stage ids, and the number of stages."""
    S = P * v
    bounds = stage_bounds(len(model.layers), S)
    ids = [r + k * P for k in range(v)]
    return [PipelineStageModule(model, *bounds[s], s == 0, s == S - 1) for s in ids], ids, S
