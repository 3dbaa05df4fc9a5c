"""Router module: the gating linear (fp32), fused top-k, balancing losses, capacity, expert bias."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed
import torch.nn.functional as F
from torch import Tensor, nn

from moe_kernels.nn import fused
from moe_kernels.ops.permute import tokens_per_expert, tokens_per_expert_reference
from moe_kernels.ops.router import (
    SCORES,
    resolve_topk_options,
    router_aux_scores,
    router_aux_scores_reference,
    router_topk,
    router_topk_reference,
)
from moe_kernels.ops.router_fused import FUSED_MAX_EXPERTS
from moe_kernels.ops.router_losses import (
    _aux_scale,
    _seq_counts,
    apply_capacity,
    apply_capacity_reference,
    aux_loss,
    aux_loss_reference,
    seq_aux_loss,
    seq_aux_loss_reference,
    update_expert_bias,
    z_loss,
    z_loss_reference,
)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Routing of one MoE layer. Loss coefficients of 0 turn a loss off; several may be on at once."""

    hidden_size: int
    num_experts: int
    k: int
    score: str = "softmax"
    pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    group_score_topk: int | None = None
    scaling_factor: float | None = None
    normalize: bool | None = None
    expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3): a selection-only bias per expert
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    capacity_policy: str = "probs"

    def __post_init__(self):
        if self.hidden_size < 1 or self.num_experts < 1:
            raise ValueError("RouterConfig: hidden_size and num_experts must be >= 1")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"RouterConfig: k must be in [1, num_experts={self.num_experts}], got {self.k}")
        if self.score not in SCORES:
            raise ValueError(f"RouterConfig: score must be one of {SCORES}, got {self.score!r}")
        if self.expert_bias and self.score == "softmax" and not self.pre_softmax:
            raise ValueError("RouterConfig: expert_bias with score='softmax' needs pre_softmax=True (the bias is added "
                             "to the probabilities)")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("RouterConfig: num_groups and group_topk go together")
        if self.num_groups is not None and self.num_experts % self.num_groups:
            raise ValueError("RouterConfig: num_groups must divide num_experts")
        if min(self.aux_loss_coeff, self.seq_aux_loss_coeff, self.z_loss_coeff) < 0:
            raise ValueError("RouterConfig: loss coefficients must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError("RouterConfig: capacity_factor must be > 0")
        if self.capacity_policy not in ("probs", "position"):
            raise ValueError("RouterConfig: capacity_policy must be 'probs' or 'position'")


_recompute_state = threading.local()
_GATING_DTYPES = (torch.float32, torch.float64)  # the router weight's precisions the logits take as they are
_THIN_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x the router region takes (no wider than its copy)


@contextmanager
def recomputation() -> Iterator[None]:
    """Marks a forward pass that activation checkpointing re-runs in the backward: routers inside it
    do not add their counts to `tokens_seen` a second time. Pass it to torch.utils.checkpoint as
    `context_fn=lambda: (nullcontext(), recomputation())`."""
    depth = getattr(_recompute_state, "depth", 0)
    _recompute_state.depth = depth + 1
    try:
        yield
    finally:
        _recompute_state.depth = depth


def _recomputing() -> bool:
    return getattr(_recompute_state, "depth", 0) > 0


@dataclass
class RouterOutput:
    weights: Tensor  # [T, k] fp32, 0 where dropped
    indices: Tensor  # [T, k] int32, -1 where dropped
    aux_loss: Tensor  # scalar fp32: the sum of the configured losses (0 when none)
    logits: Tensor  # [T, E] fp32
    tokens_per_expert: Tensor  # [E] int32, after capacity


class Router(nn.Module):
    """logits = x @ W^T in fp32 (as Megatron-Core keeps its router), then router_topk and the losses.

    The expert-bias buffer accumulates routed counts while training; `update_expert_bias()` (or the
    optimizer hook from `register_bias_update_hook`) applies bias += rate * sign(mean - count) and
    clears them. Sum the counts over data-parallel ranks before updating (`tokens_seen`).
    """

    def __init__(self, config: RouterConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer("tokens_seen", torch.zeros(config.num_experts, dtype=torch.int64))
        else:
            self.expert_bias = None
            self.tokens_seen = None
        # Global-batch load balancing (moe_kernels.parallel.apply_global_load_balancing sets it): the aux
        # loss takes its expert counts over this data-parallel group. None: this rank's tokens only.
        self.balance_group = None
        # Sequence parallelism (moe_kernels.parallel sets it): the ranks holding the other parts of these
        # sequences. Counts are summed over it and each rank's losses are its share: the shares of the group
        # add up to the losses of the whole sequences. None: the sequences are whole here.
        self.sequence_group = None
        self.spec = fused.router_spec(config)  # the options as the kernels take them
        self._fits: dict[int, bool] = {}  # extension module -> whether its fused router takes self.spec
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.config.hidden_size**-0.5)

    def forward(self, x: Tensor, *, seq_len: int | None = None, reference: bool = False,
                launch: fused.Launch | None | type(...) = ...) -> RouterOutput:
        """x: [T, H]. `seq_len` is needed by the sequence-wise loss (T = batch * seq_len). `reference` runs
        the plain PyTorch references instead of the ops (the MoE layer's reference backend). `launch` is the
        MoE layer's (moe_kernels.nn.fused): the router region runs on it, or on the registered ops when None;
        by default the router resolves it from x."""
        # The logits in fp32 (or the weight's own precision when wider, e.g. fp64 for gradcheck), autocast or not
        if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(device_type=x.device.type, enabled=False):
                weights, indices, counts, loss, logits = self._route(x, seq_len, reference, launch)
        else:
            weights, indices, counts, loss, logits = self._route(x, seq_len, reference, launch)
        if self.tokens_seen is not None and self.training and not _recomputing():
            self.tokens_seen.add_(counts)
        return RouterOutput(weights, indices, loss, logits, counts)

    def _route(self, x: Tensor, seq_len: int | None, reference: bool, launch) -> tuple[Tensor, ...]:
        """(weights, indices, counts, loss, logits): the gating linear and the routing on its logits. Eagerly the
        linear keeps x in its own dtype for the backward, not its fp32 copy (moe_kernels.nn.gating)."""
        weight = self.weight if self.weight.dtype in _GATING_DTYPES else fused.as_dtype(self.weight, torch.float32)
        if reference:
            logits = F.linear(fused.as_dtype(x, weight.dtype), weight)  # [T, E]
            return (*self._route_reference(logits, seq_len), logits)
        if launch is ...:
            launch = fused.launch_for(x)
        if launch is not None and not self._thin_path_fits(x, weight, launch):
            launch = None
        return fused.run("router", launch, self, x, weight, seq_len)

    def _thin_path_fits(self, x: Tensor, weight: Tensor, launch: fused.Launch) -> bool:
        """The router region takes one rank's x in fp32, bf16 or fp16 and an fp32 weight (the losses of a balance or
        sequence group all-reduce between the statistics and the loss: the registered ops do that)."""
        if (weight.dtype != torch.float32 or x.dtype not in _THIN_X_DTYPES or self.balance_group is not None
                or self.sequence_group is not None):
            return False
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            return False
        fits = self._fits.get(id(launch.C))
        if fits is None:
            fits = self._fits[id(launch.C)] = fused.router_fits(launch.C, self.spec)
        return fits

    def checked_seq_len(self, logits: Tensor, seq_len: int | None) -> int:
        """The sequence length the sequence-wise loss takes (1 when it is off), checked against the rows."""
        if self.config.seq_aux_loss_coeff <= 0:
            return 1
        if seq_len is None:
            raise ValueError("Router: the sequence-wise aux loss needs forward(..., seq_len=...)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or logits.shape[0] % seq_len:
            raise ValueError(f"Router: {logits.shape[0]} tokens are not whole sequences of seq_len={seq_len!r}")
        return seq_len

    def _fused_op_fits(self) -> bool:
        """One rank's losses and options the fused router kernel takes (router_fused)."""
        return (self.balance_group is None and self.sequence_group is None and self.config.num_experts <= FUSED_MAX_EXPERTS
                and self.spec.k <= 32 and self.spec.num_groups <= 32)

    def route_with_ops(self, logits: Tensor, seq_len: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(weights, indices, counts, loss) through the registered custom ops (compile, export, groups)."""
        cfg = self.config
        if self._fused_op_fits():
            sp = self.spec
            weights, indices, counts, _, _, loss = torch.ops.moe_kernels.router_fused(
                logits, self.expert_bias, sp.k, cfg.score, sp.pre_softmax, sp.num_groups, sp.group_topk,
                sp.group_score_topk, sp.scale, sp.normalize, sp.aux_coeff, sp.seq_coeff,
                self.checked_seq_len(logits, seq_len), sp.z_coeff)
            if cfg.capacity_factor is not None:
                weights, indices = apply_capacity(weights, indices, cfg.num_experts, cfg.capacity_factor,
                                                  cfg.capacity_policy)
                counts = tokens_per_expert(indices, cfg.num_experts)
            return weights, indices, counts, loss
        weights, indices = router_topk(
            logits, cfg.k, score=cfg.score, pre_softmax=cfg.pre_softmax, num_groups=cfg.num_groups,
            group_topk=cfg.group_topk, group_score_topk=cfg.group_score_topk, scaling_factor=cfg.scaling_factor,
            expert_bias=self.expert_bias, normalize=cfg.normalize,
        )
        if cfg.capacity_factor is not None:
            weights, indices = apply_capacity(weights, indices, cfg.num_experts, cfg.capacity_factor,
                                              cfg.capacity_policy)
        counts = tokens_per_expert(indices, cfg.num_experts)
        return weights, indices, counts, self._losses(logits, seq_len)

    def _route_reference(self, logits: Tensor, seq_len: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cfg = self.config
        G, g, gst, scale, norm = resolve_topk_options(cfg.k, cfg.num_groups, cfg.group_topk, cfg.group_score_topk,
                                                      cfg.scaling_factor, cfg.normalize, cfg.num_experts,
                                                      score=cfg.score)
        weights, indices = router_topk_reference(logits, cfg.k, cfg.score, cfg.pre_softmax, G, g, gst, scale,
                                                 self.expert_bias, norm)
        if cfg.capacity_factor is not None:
            weights, indices = apply_capacity_reference(weights, indices, cfg.num_experts, cfg.capacity_factor,
                                                        cfg.capacity_policy)
        counts = tokens_per_expert_reference(indices, cfg.num_experts)
        return weights, indices, counts, self._losses(logits, seq_len, reference=True)

    def _losses(self, logits: Tensor, seq_len: int | None, reference: bool = False) -> Tensor:
        """The configured losses of this rank's tokens. With a sequence group of n ranks (each 1/n of every
        sequence) each loss is this rank's share; the n shares add up to the loss of the whole sequences."""
        cfg = self.config
        loss = logits.new_zeros(())
        n_seq = 1 if self.sequence_group is None else torch.distributed.get_world_size(self.sequence_group)
        if cfg.aux_loss_coeff > 0 or cfg.seq_aux_loss_coeff > 0:
            if reference:
                scores, aux_indices = router_aux_scores_reference(logits, cfg.k, cfg.score)
            else:
                scores, aux_indices = router_aux_scores(logits, cfg.k, score=cfg.score)
            if cfg.aux_loss_coeff > 0:
                count = tokens_per_expert_reference if reference else tokens_per_expert
                balance = aux_loss_reference if reference else aux_loss
                counts = count(aux_indices, cfg.num_experts)
                group = self.balance_group if self.balance_group is not None else self.sequence_group
                if group is None:
                    loss = loss + balance(scores, counts, cfg.k, cfg.aux_loss_coeff)
                else:
                    # f_e over the group's tokens (W ranks x T), P_e over this rank's: balance() normalises by
                    # T^2, so its sum over the W ranks is W^2 times the group's loss, which holds W / n_seq
                    # batches (each one term of the data-parallel mean): divide by W * n_seq.
                    W = torch.distributed.get_world_size(group)
                    if W % n_seq:
                        raise ValueError(f"Router: the balance group ({W} ranks) must hold whole sequence groups "
                                         f"({n_seq} ranks share each sequence)")
                    counts = counts.clone()
                    torch.distributed.all_reduce(counts, group=group)
                    loss = loss + balance(scores, counts, cfg.k, cfg.aux_loss_coeff) / (W * n_seq)
            if cfg.seq_aux_loss_coeff > 0:
                if seq_len is None:
                    raise ValueError("Router: the sequence-wise aux loss needs forward(..., seq_len=...)")
                if self.sequence_group is not None:
                    loss = loss + self._seq_aux_share(scores, aux_indices, seq_len, n_seq)
                elif reference:
                    loss = loss + seq_aux_loss_reference(scores, aux_indices, cfg.seq_aux_loss_coeff, seq_len)[0]
                else:
                    loss = loss + seq_aux_loss(scores, aux_indices, cfg.seq_aux_loss_coeff, seq_len=seq_len)
        if cfg.z_loss_coeff > 0:
            z = z_loss_reference(logits, cfg.z_loss_coeff)[0] if reference else z_loss(logits, cfg.z_loss_coeff)
            loss = loss + z / n_seq  # a mean over tokens: each rank holds 1/n_seq of them
        return loss

    def _seq_aux_share(self, scores: Tensor, indices: Tensor, seq_len: int, n_seq: int) -> Tensor:
        """This rank's share of the sequence-wise aux loss when each sequence is split over the sequence group
        (seq_len of its n_seq * seq_len tokens here): per-sequence counts summed over the group, this rank's
        scores, the normalisation of the whole sequence; the shares add up to seq_aux_loss of the sequences."""
        cfg = self.config
        rows, E = scores.shape
        B = rows // seq_len
        if B * seq_len != rows:
            raise ValueError(f"Router: {rows} tokens are not whole sequences of seq_len={seq_len}")
        counts = _seq_counts(indices, B, seq_len, E)
        torch.distributed.all_reduce(counts, group=self.sequence_group)
        if B == 0:
            return scores.new_zeros(())
        acc = torch.promote_types(scores.dtype, torch.float32)
        per_seq = scores.to(acc).view(B, seq_len, E).sum(1)  # [B, E]
        scale = _aux_scale(cfg.seq_aux_loss_coeff, E, cfg.k, seq_len * n_seq)  # the whole sequences' length
        return (per_seq * counts.to(acc)).sum(-1).mean() * scale

    @torch.no_grad()
    def update_expert_bias(self, counts: Tensor | None = None) -> None:
        """Aux-loss-free balancing step; uses (and clears) the accumulated counts unless given."""
        if self.expert_bias is None:
            raise RuntimeError("Router.update_expert_bias: the router was built without expert_bias")
        update_expert_bias(self.expert_bias, self.tokens_seen if counts is None else counts, self.config.bias_update_rate)
        self.tokens_seen.zero_()

    def register_bias_update_hook(self, optimizer: torch.optim.Optimizer):
        """Update the expert bias after every optimizer step. Returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self.update_expert_bias())
