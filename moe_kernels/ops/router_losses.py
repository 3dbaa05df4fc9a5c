"""Load-balancing losses, capacity (token dropping) and aux-loss-free bias updates (specs/ops.md).

Shapes: T tokens (B sequences of S tokens for the sequence-wise loss), E experts, k slots per token.
These are reductions over a few small tensors; one implementation, written in PyTorch ops that run on
any device without a host sync, serves the CPU and the GPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_kernels.ops._checks import FLOAT_DTYPES, check_int, check_shape, check_tensor

_COUNT_DTYPES = (torch.int32, torch.int64)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _aux_scale(coeff: float, E: int, k: int, T: int) -> float:
    return coeff * E / (k * T * T) if T > 0 else 0.0


# ---------------------------------------------------------------------------------------------------
# aux_loss = coeff * E / (k * T^2) * sum_e (sum_t scores[t, e]) * c_e


@torch.library.custom_op("moe_kernels::aux_loss", mutates_args=())
def _aux_loss(scores: Tensor, tokens_per_expert: Tensor, k: int, coeff: float) -> Tensor:
    op = "aux_loss"
    check_tensor(op, "scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "tokens_per_expert", tokens_per_expert, ndim=1, dtypes=_COUNT_DTYPES, device=scores.device)
    check_shape(op, "tokens_per_expert", tokens_per_expert, (scores.shape[1],), "one count per expert")
    check_int(op, "k", k, minimum=1)
    T, E = scores.shape
    acc = _acc_dtype(scores)
    per_expert = scores.to(acc).sum(0)  # [E]
    return (per_expert * tokens_per_expert.to(acc)).sum() * _aux_scale(coeff, E, k, T)


@_aux_loss.register_fake
def _(scores, tokens_per_expert, k, coeff):
    return scores.new_empty((), dtype=_acc_dtype(scores))


def _aux_loss_setup(ctx, inputs, output):
    scores, counts, k, coeff = inputs
    ctx.save_for_backward(counts)
    ctx.shape, ctx.dtype = scores.shape, scores.dtype
    ctx.scale = _aux_scale(coeff, scores.shape[1], k, scores.shape[0])


def _aux_loss_backward(ctx, grad):
    (counts,) = ctx.saved_tensors
    g = (grad * ctx.scale * counts.to(grad.dtype)).to(ctx.dtype)  # [E]
    return g.expand(ctx.shape), None, None, None


_aux_loss.register_autograd(_aux_loss_backward, setup_context=_aux_loss_setup)


# ---------------------------------------------------------------------------------------------------
# seq_aux_loss: mean over sequences of aux_loss computed on each sequence alone


def _seq_counts(indices: Tensor, B: int, S: int, E: int) -> Tensor:
    """[B, E] counts of (token, slot) pairs per sequence and expert; -1 ignored."""
    flat = indices.reshape(B, S * indices.shape[1]).long()
    valid = flat >= 0
    counts = torch.zeros((B, E + 1), dtype=torch.int64, device=indices.device)
    counts.scatter_add_(1, torch.where(valid, flat, E), valid.long())
    return counts[:, :E]


def _check_seq(scores, indices, seq_len) -> None:
    op = "seq_aux_loss"
    check_tensor(op, "scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "indices", indices, ndim=2, dtypes=_COUNT_DTYPES, device=scores.device)
    check_int(op, "seq_len", seq_len, minimum=1)
    if indices.shape[0] != scores.shape[0]:
        raise ValueError(f"{op}: `indices` has {indices.shape[0]} rows, `scores` {scores.shape[0]}")
    if scores.shape[0] % seq_len:
        raise ValueError(f"{op}: {scores.shape[0]} rows of `scores` are not whole sequences of `seq_len`={seq_len}")
    if indices.shape[1] < 1:
        raise ValueError(f"{op}: `indices` must have at least one slot per token")


@torch.library.custom_op("moe_kernels::seq_aux_loss", mutates_args=())
def _seq_aux_loss(scores: Tensor, indices: Tensor, coeff: float, seq_len: int) -> Tensor:
    _check_seq(scores, indices, seq_len)
    rows, E = scores.shape
    B, S, k = rows // seq_len, seq_len, indices.shape[1]
    acc = _acc_dtype(scores)
    if B == 0:
        return scores.new_zeros((), dtype=acc)
    per_seq = scores.to(acc).view(B, S, E).sum(1)  # [B, E]
    counts = _seq_counts(indices, B, S, E).to(acc)
    return (per_seq * counts).sum(-1).mean() * _aux_scale(coeff, E, k, S)


@_seq_aux_loss.register_fake
def _(scores, indices, coeff, seq_len):
    _check_seq(scores, indices, seq_len)
    return scores.new_empty((), dtype=_acc_dtype(scores))


def _seq_setup(ctx, inputs, output):
    scores, indices, coeff, seq_len = inputs
    rows, E = scores.shape
    ctx.save_for_backward(indices)
    ctx.B, ctx.S, ctx.E, ctx.dtype = rows // seq_len, seq_len, E, scores.dtype
    ctx.scale = _aux_scale(coeff, E, indices.shape[1], seq_len) / max(ctx.B, 1)


def _seq_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    counts = _seq_counts(indices, ctx.B, ctx.S, ctx.E).to(grad.dtype)  # [B, E]
    g = (grad * ctx.scale * counts)[:, None, :].expand(ctx.B, ctx.S, ctx.E)
    return g.reshape(ctx.B * ctx.S, ctx.E).to(ctx.dtype), None, None, None


_seq_aux_loss.register_autograd(_seq_backward, setup_context=_seq_setup)


# ---------------------------------------------------------------------------------------------------
# z_loss = coeff * mean_t logsumexp(logits[t])^2


@torch.library.custom_op("moe_kernels::z_loss", mutates_args=())
def _z_loss(logits: Tensor, coeff: float) -> Tensor:
    check_tensor("z_loss", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    acc = _acc_dtype(logits)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=acc)
    return torch.logsumexp(logits.to(acc), dim=-1).square().mean() * coeff


@_z_loss.register_fake
def _(logits, coeff):
    return logits.new_empty((), dtype=_acc_dtype(logits))


def _z_setup(ctx, inputs, output):
    logits, coeff = inputs
    ctx.save_for_backward(logits)
    ctx.coeff = coeff


def _z_backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    x = logits.to(_acc_dtype(logits))
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    g = grad * ctx.coeff * 2.0 / max(x.shape[0], 1) * lse * torch.softmax(x, dim=-1)
    return g.to(logits.dtype), None


_z_loss.register_autograd(_z_backward, setup_context=_z_setup)


# ---------------------------------------------------------------------------------------------------
# Capacity


def capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T * k / E * capacity_factor)."""
    return math.ceil(num_tokens * k / num_experts * capacity_factor)


def _check_capacity(weights, indices, num_experts, capacity_factor, policy) -> None:
    op = "apply_capacity"
    check_tensor(op, "weights", weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "indices", indices, ndim=2, dtypes=(torch.int32,), device=weights.device)
    check_shape(op, "indices", indices, weights.shape, "same as weights: [T, k]")
    check_int(op, "num_experts", num_experts, minimum=1)
    if not capacity_factor > 0:
        raise ValueError(f"{op}: `capacity_factor` must be > 0, got {capacity_factor}")
    if policy not in ("probs", "position"):
        raise ValueError(f"{op}: `policy` must be 'probs' or 'position', got {policy!r}")


@torch.library.custom_op("moe_kernels::apply_capacity", mutates_args=())
def _apply_capacity(
    weights: Tensor, indices: Tensor, num_experts: int, capacity_factor: float, policy: str
) -> tuple[Tensor, Tensor]:
    _check_capacity(weights, indices, num_experts, capacity_factor, policy)
    T, k = indices.shape
    C = capacity(T, k, num_experts, capacity_factor)
    flat_e = indices.reshape(-1).long()
    order = torch.arange(T * k, device=indices.device)  # (token, slot) order
    if policy == "probs":  # larger weight first; stable sort keeps ties in token order
        order = order[torch.sort(-weights.reshape(-1), stable=True).indices]
    # Group by expert (dropped slots last), keeping the policy's order inside each expert.
    key = torch.where(flat_e >= 0, flat_e, num_experts)
    order = order[torch.sort(key[order], stable=True).indices]
    sorted_e = key[order]
    counts = torch.bincount(sorted_e, minlength=num_experts + 1)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(T * k, device=indices.device) - first[sorted_e]
    keep = torch.zeros(T * k, dtype=torch.bool, device=indices.device)
    keep[order] = (rank < C) & (sorted_e < num_experts)
    keep = keep.view(T, k)
    return torch.where(keep, weights, 0.0), torch.where(keep, indices, -1)


@_apply_capacity.register_fake
def _(weights, indices, num_experts, capacity_factor, policy):
    _check_capacity(weights, indices, num_experts, capacity_factor, policy)
    return torch.empty_like(weights), torch.empty_like(indices)


def _cap_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _cap_backward(ctx, grad_weights, _grad_indices):
    (kept,) = ctx.saved_tensors
    return torch.where(kept >= 0, grad_weights, 0.0), None, None, None, None


_apply_capacity.register_autograd(_cap_backward, setup_context=_cap_setup)


# ---------------------------------------------------------------------------------------------------
# Aux-loss-free balancing


@torch.library.custom_op("moe_kernels::update_expert_bias", mutates_args=("bias",))
def _update_expert_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> None:
    op = "update_expert_bias"
    check_tensor(op, "bias", bias, ndim=1, dtypes=(torch.float32, torch.float64))
    check_tensor(op, "tokens_per_expert", tokens_per_expert, ndim=1, device=bias.device)
    check_shape(op, "tokens_per_expert", tokens_per_expert, bias.shape, "one count per expert")
    c = tokens_per_expert.to(bias.dtype)
    bias.add_(torch.sign(c.mean() - c) * rate)


@_update_expert_bias.register_fake
def _(bias, tokens_per_expert, rate):
    return None


# ---------------------------------------------------------------------------------------------------
# Public API


def aux_loss(scores, tokens_per_expert, k: int, coeff: float):
    """coeff * E / (k * T^2) * sum_e (sum_t scores[t, e]) * c_e (Megatron-Core's normalisation):
    uniform scores with even counts give exactly `coeff`. Differentiable w.r.t. scores."""
    return torch.ops.moe_kernels.aux_loss(scores, tokens_per_expert, k, float(coeff))


def seq_aux_loss(scores, indices, coeff: float, *, seq_len: int):
    """Mean over the B = rows / seq_len sequences of aux_loss computed on each sequence alone, with
    k = indices.shape[1] (DeepSeek-V2/V3 sequence-wise balance loss)."""
    return torch.ops.moe_kernels.seq_aux_loss(scores, indices, float(coeff), seq_len)


def z_loss(logits, coeff: float):
    """coeff * mean_t logsumexp(logits[t])^2."""
    return torch.ops.moe_kernels.z_loss(logits, float(coeff))


def apply_capacity(weights, indices, num_experts: int, capacity_factor: float, policy: str = "probs"):
    """Keep at most C = ceil(T * k / E * capacity_factor) (token, slot) pairs per expert: the C largest
    weights ("probs", ties to the lower token) or the C lowest tokens ("position"). Dropped pairs get
    index -1 and weight 0; weights are not renormalised."""
    if indices.dtype == torch.int64:
        indices = indices.to(torch.int32)
    return torch.ops.moe_kernels.apply_capacity(weights, indices, num_experts, float(capacity_factor), policy)


def update_expert_bias(bias, tokens_per_expert, rate: float) -> None:
    """In place: bias += rate * sign(mean(c) - c) (aux-loss-free balancing)."""
    torch.ops.moe_kernels.update_expert_bias(bias, tokens_per_expert, float(rate))
