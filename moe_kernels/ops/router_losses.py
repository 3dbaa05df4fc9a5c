"""Load-balancing losses, capacity (token dropping) and aux-loss-free bias updates (specs/ops.md).

Shapes: T tokens (B sequences of S tokens for the sequence-wise loss), E experts, k slots per token.
Each op has a reference in plain PyTorch (the CPU implementation, and the fallback on a GPU the
extension was not built for), CUDA kernels (csrc/router/balance.cu, capacity.cu) for fp32/bf16/fp16,
a fake implementation and autograd. The forward losses also return what their backward needs
(the per-sequence counts, the per-row log-sum-exp), so the backward re-reads nothing but its output.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.ops._checks import (
    CUDA_FLOAT_DTYPES,
    FLOAT_DTYPES,
    check_int,
    check_shape,
    check_tensor,
)
from moe_kernels.ops.permute import _INT32_MAX, _check_indices_values

_COUNT_DTYPES = (torch.int32, torch.int64)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _aux_scale(coeff: float, E: int, k: int, T: int) -> float:
    return coeff * E / (k * T * T) if T > 0 else 0.0


# ---------------------------------------------------------------------------------------------------
# Validation


def _check_aux(scores, tokens_per_expert, k) -> None:
    op = "aux_loss"
    check_tensor(op, "scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "tokens_per_expert", tokens_per_expert, ndim=1, dtypes=_COUNT_DTYPES, device=scores.device)
    check_shape(op, "tokens_per_expert", tokens_per_expert, (scores.shape[1],), "one count per expert")
    check_int(op, "k", k, minimum=1, maximum=2**31 - 1)  # an int32 in the kernel


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


def _check_capacity(weights, indices, num_experts, capacity_factor, policy) -> None:
    op = "apply_capacity"
    check_tensor(op, "weights", weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "indices", indices, ndim=2, dtypes=(torch.int32,), device=weights.device)
    check_shape(op, "indices", indices, weights.shape, "same as weights: [T, k]")
    check_int(op, "num_experts", num_experts, minimum=1, maximum=2**31 - 1)  # int32 indices
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"{op}: `capacity_factor` must be finite and > 0, got {capacity_factor}")
    if policy not in ("probs", "position"):
        raise ValueError(f"{op}: `policy` must be 'probs' or 'position', got {policy!r}")


def _check_bias(bias, tokens_per_expert, rate) -> None:
    op = "update_expert_bias"
    check_tensor(op, "bias", bias, ndim=1, dtypes=(torch.float32, torch.float64))
    check_tensor(op, "tokens_per_expert", tokens_per_expert, ndim=1, device=bias.device)
    check_shape(op, "tokens_per_expert", tokens_per_expert, bias.shape, "one count per expert")
    if not math.isfinite(rate):  # a NaN or inf step would leave every bias non-finite for good
        raise ValueError(f"{op}: `rate` must be finite, got {rate}")


# ---------------------------------------------------------------------------------------------------
# References: plain PyTorch, the definition of each op (also the fallback on a GPU without kernels)


def aux_loss_reference(scores: Tensor, tokens_per_expert: Tensor, k: int, coeff: float) -> Tensor:
    T, E = scores.shape
    acc = _acc_dtype(scores)
    per_expert = scores.to(acc).sum(0)  # [E]
    return (per_expert * tokens_per_expert.to(acc)).sum() * _aux_scale(coeff, E, k, T)


def _seq_counts(indices: Tensor, B: int, S: int, E: int) -> Tensor:
    """[B, E] int32 counts of (token, slot) pairs per sequence and expert; -1 ignored."""
    flat = indices.reshape(B, S * indices.shape[1]).long()
    valid = flat >= 0
    counts = torch.zeros((B, E + 1), dtype=torch.int64, device=indices.device)
    counts.scatter_add_(1, torch.where(valid, flat, E), valid.long())
    return counts[:, :E].to(torch.int32)


def seq_aux_loss_reference(scores: Tensor, indices: Tensor, coeff: float, seq_len: int) -> tuple[Tensor, Tensor]:
    rows, E = scores.shape
    B, S, k = rows // seq_len, seq_len, indices.shape[1]
    if indices.device.type == "cpu":
        _check_indices_values(indices, E, "seq_aux_loss")
    acc = _acc_dtype(scores)
    counts = _seq_counts(indices, B, S, E)
    if B == 0:
        return scores.new_zeros((), dtype=acc), counts
    per_seq = scores.to(acc).view(B, S, E).sum(1)  # [B, E]
    return (per_seq * counts.to(acc)).sum(-1).mean() * _aux_scale(coeff, E, k, S), counts


def balance_loss_bwd_reference(
    grad: Tensor, counts: Tensor, num_tokens: int, seq_len: int, scale: float, dtype: torch.dtype
) -> Tensor:
    per_seq = grad * scale * counts.to(grad.dtype)  # [B, E]
    rows = torch.arange(num_tokens, device=counts.device) // seq_len
    return per_seq[rows].to(dtype)


def z_loss_reference(logits: Tensor, coeff: float) -> tuple[Tensor, Tensor]:
    acc = _acc_dtype(logits)
    lse = torch.logsumexp(logits.to(acc), dim=-1)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=acc), lse
    return lse.square().mean() * coeff, lse


def z_loss_bwd_reference(grad: Tensor, logits: Tensor, lse: Tensor, coeff: float) -> Tensor:
    x = logits.to(_acc_dtype(logits))
    g = grad * coeff * 2.0 / max(x.shape[0], 1) * lse[:, None] * torch.exp(x - lse[:, None])
    return g.to(logits.dtype)


def capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T * k / E * capacity_factor), at most T * k (no expert can receive more: a larger factor keeps
    every pair, and a huge one does not overflow)."""
    c = num_tokens * k / num_experts * capacity_factor
    return num_tokens * k if c >= num_tokens * k else math.ceil(c)


def apply_capacity_reference(
    weights: Tensor, indices: Tensor, num_experts: int, capacity_factor: float, policy: str
) -> tuple[Tensor, Tensor]:
    if indices.device.type == "cpu":
        _check_indices_values(indices, num_experts, "apply_capacity")
    T, k = indices.shape
    C = capacity(T, k, num_experts, capacity_factor)
    flat_e = indices.reshape(-1).long()
    order = torch.arange(T * k, device=indices.device)  # (token, slot) order
    if policy == "probs":  # larger weight first; stable sort keeps ties in token order
        order = order[torch.sort(-weights.reshape(-1), stable=True).indices]
    # Group by expert (dropped slots last), keeping the policy's order inside each expert.
    key = torch.where((flat_e >= 0) & (flat_e < num_experts), flat_e, num_experts)
    order = order[torch.sort(key[order], stable=True).indices]
    sorted_e = key[order]
    counts = torch.bincount(sorted_e, minlength=num_experts + 1)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(T * k, device=indices.device) - first[sorted_e]
    keep = torch.zeros(T * k, dtype=torch.bool, device=indices.device)
    keep[order] = (rank < C) & (sorted_e < num_experts)
    keep = keep.view(T, k)
    return torch.where(keep, weights, 0.0), torch.where(keep, indices, -1)


def update_expert_bias_reference(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> None:
    c = tokens_per_expert
    if c.dtype.is_floating_point:
        c = c.to(bias.dtype)
        direction = torch.sign(c.mean() - c)
    else:  # exactly: sign(mean(c) - c_e) = sign(sum(c) - E * c_e)
        c = c.long()
        direction = torch.sign(c.sum() - c.numel() * c)
    bias.add_(direction.to(bias.dtype) * rate)


# ---------------------------------------------------------------------------------------------------
# Ops: schema, default (reference) implementation, fake, autograd


@torch.library.custom_op("moe_kernels::aux_loss", mutates_args=())
def _aux_loss(scores: Tensor, tokens_per_expert: Tensor, k: int, coeff: float) -> Tensor:
    _check_aux(scores, tokens_per_expert, k)
    return aux_loss_reference(scores, tokens_per_expert, k, coeff)


@_aux_loss.register_fake
def _(scores, tokens_per_expert, k, coeff):
    _check_aux(scores, tokens_per_expert, k)
    return scores.new_empty((), dtype=_acc_dtype(scores))


def _aux_loss_setup(ctx, inputs, output):
    scores, counts, k, coeff = inputs
    ctx.save_for_backward(counts)
    ctx.T, ctx.dtype = scores.shape[0], scores.dtype
    ctx.scale = _aux_scale(coeff, scores.shape[1], k, scores.shape[0])


def _grad_rows(counts, T, S):
    """(rows, seq_len) the balance backward writes: one row for one sequence (every row's gradient is the same
    [E], returned broadcast over the T rows, as sum's backward), else all T."""
    return (1, 1) if counts.shape[0] == 1 else (T, S)


def _balance_backward(grad, counts, T, S, scale, dtype):
    # With create_graph the composition keeps the (linear) dependence on `grad` differentiable.
    bwd = balance_loss_bwd_reference if torch.is_grad_enabled() else torch.ops.moe_kernels.balance_loss_bwd
    return bwd(grad, counts, *_grad_rows(counts, T, S), scale, dtype).expand(T, counts.shape[1])


def _aux_loss_backward(ctx, grad):
    (counts,) = ctx.saved_tensors
    return _balance_backward(grad, counts.view(1, -1), ctx.T, max(ctx.T, 1), ctx.scale, ctx.dtype), None, None, None


_aux_loss.register_autograd(_aux_loss_backward, setup_context=_aux_loss_setup)


@torch.library.custom_op("moe_kernels::seq_aux_loss", mutates_args=())
def _seq_aux_loss(scores: Tensor, indices: Tensor, coeff: float, seq_len: int) -> tuple[Tensor, Tensor]:
    _check_seq(scores, indices, seq_len)
    return seq_aux_loss_reference(scores, indices, coeff, seq_len)


@_seq_aux_loss.register_fake
def _(scores, indices, coeff, seq_len):
    _check_seq(scores, indices, seq_len)
    B = scores.shape[0] // seq_len
    return scores.new_empty((), dtype=_acc_dtype(scores)), indices.new_empty((B, scores.shape[1]), dtype=torch.int32)


def _seq_setup(ctx, inputs, output):
    scores, indices, coeff, seq_len = inputs
    rows, E = scores.shape
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.T, ctx.S, ctx.dtype = rows, seq_len, scores.dtype
    ctx.scale = _aux_scale(coeff, E, indices.shape[1], seq_len) / max(rows // seq_len, 1)


def _seq_backward(ctx, grad, _grad_counts):
    (counts,) = ctx.saved_tensors
    return _balance_backward(grad, counts, ctx.T, ctx.S, ctx.scale, ctx.dtype), None, None, None


_seq_aux_loss.register_autograd(_seq_backward, setup_context=_seq_setup)


@torch.library.custom_op("moe_kernels::balance_loss_bwd", mutates_args=())
def _balance_loss_bwd(
    grad: Tensor, counts: Tensor, num_tokens: int, seq_len: int, scale: float, dtype: torch.dtype
) -> Tensor:
    _check_balance_bwd(grad, counts, num_tokens, seq_len, dtype)
    return balance_loss_bwd_reference(grad, counts, num_tokens, seq_len, scale, dtype)


def _check_balance_bwd(grad, counts, num_tokens, seq_len, dtype) -> None:
    op = "balance_loss_bwd"
    check_tensor(op, "grad", grad, ndim=0, dtypes=(torch.float32, torch.float64))
    check_tensor(op, "counts", counts, ndim=2, dtypes=_COUNT_DTYPES, device=grad.device)
    check_int(op, "num_tokens", num_tokens, minimum=0)
    check_int(op, "seq_len", seq_len, minimum=1)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: `dtype` must be a floating dtype, got {dtype}")
    if counts.shape[0] < -(-num_tokens // seq_len):
        raise ValueError(f"{op}: `counts` has {counts.shape[0]} rows, {num_tokens} tokens need {-(-num_tokens // seq_len)}")


@_balance_loss_bwd.register_fake
def _(grad, counts, num_tokens, seq_len, scale, dtype):
    _check_balance_bwd(grad, counts, num_tokens, seq_len, dtype)
    return grad.new_empty((num_tokens, counts.shape[1]), dtype=dtype)


@torch.library.custom_op("moe_kernels::z_loss", mutates_args=())
def _z_loss(logits: Tensor, coeff: float) -> tuple[Tensor, Tensor]:
    check_tensor("z_loss", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    return z_loss_reference(logits, coeff)


@_z_loss.register_fake
def _(logits, coeff):
    check_tensor("z_loss", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    acc = _acc_dtype(logits)
    return logits.new_empty((), dtype=acc), logits.new_empty((logits.shape[0],), dtype=acc)


def _z_setup(ctx, inputs, output):
    logits, coeff = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.coeff = coeff


def _z_backward(ctx, grad, _grad_lse):
    logits, lse = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: a composition that stays differentiable in logits too
        x = logits.to(_acc_dtype(logits))
        g = grad * ctx.coeff * 2.0 / max(x.shape[0], 1) * torch.logsumexp(x, -1, keepdim=True) * torch.softmax(x, -1)
        return g.to(logits.dtype), None
    return torch.ops.moe_kernels.z_loss_bwd(grad, logits, lse, ctx.coeff), None


_z_loss.register_autograd(_z_backward, setup_context=_z_setup)


@torch.library.custom_op("moe_kernels::z_loss_bwd", mutates_args=())
def _z_loss_bwd(grad: Tensor, logits: Tensor, lse: Tensor, coeff: float) -> Tensor:
    _check_z_bwd(grad, logits, lse)
    return z_loss_bwd_reference(grad, logits, lse, coeff)


def _check_z_bwd(grad, logits, lse) -> None:
    op = "z_loss_bwd"
    check_tensor(op, "grad", grad, ndim=0, dtypes=(torch.float32, torch.float64))
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES, device=grad.device)
    check_tensor(op, "lse", lse, ndim=1, dtypes=(torch.float32, torch.float64), device=grad.device)
    check_shape(op, "lse", lse, (logits.shape[0],), "one log-sum-exp per row of logits")


@_z_loss_bwd.register_fake
def _(grad, logits, lse, coeff):
    _check_z_bwd(grad, logits, lse)
    return torch.empty_like(logits)


@torch.library.custom_op("moe_kernels::apply_capacity", mutates_args=())
def _apply_capacity(
    weights: Tensor, indices: Tensor, num_experts: int, capacity_factor: float, policy: str
) -> tuple[Tensor, Tensor]:
    _check_capacity(weights, indices, num_experts, capacity_factor, policy)
    return apply_capacity_reference(weights, indices, num_experts, capacity_factor, policy)


@_apply_capacity.register_fake
def _(weights, indices, num_experts, capacity_factor, policy):
    _check_capacity(weights, indices, num_experts, capacity_factor, policy)
    return torch.empty_like(weights), torch.empty_like(indices)


def _cap_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _cap_backward(ctx, grad_weights, _grad_indices):
    # The mask is one elementwise pass on any device.
    (kept,) = ctx.saved_tensors
    return torch.where(kept >= 0, grad_weights, 0.0), None, None, None, None


_apply_capacity.register_autograd(_cap_backward, setup_context=_cap_setup)


@torch.library.custom_op("moe_kernels::update_expert_bias", mutates_args=("bias",))
def _update_expert_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> None:
    _check_bias(bias, tokens_per_expert, rate)
    update_expert_bias_reference(bias, tokens_per_expert, rate)


@_update_expert_bias.register_fake
def _(bias, tokens_per_expert, rate):
    _check_bias(bias, tokens_per_expert, rate)
    return None


# ---------------------------------------------------------------------------------------------------
# CUDA implementations: the kernels for fp32/bf16/fp16 inputs, the references for fp64 (these are
# small reductions, so fp64 on a GPU stays correct without a dedicated kernel)


def _kernels(op: str, t: Tensor, num_experts: int, *, dtype: torch.dtype | None = None,
             counts_in_shared_memory: bool = False):
    """The extension, or None where the reference runs instead: an fp64 `dtype` (default t's), E = 0, no
    kernels for t's GPU, or (for the ops that count per expert in shared memory) E past the kernel's limit."""
    if (dtype or t.dtype) not in CUDA_FLOAT_DTYPES or num_experts == 0:
        return None
    C = _ext.kernels(op, t)
    if C is not None and counts_in_shared_memory and num_experts > C.balance_max_experts:
        return None
    return C


def _as_int32_indices(indices: Tensor, num_experts: int) -> Tensor:
    """int32 indices for the kernels; an int64 value outside [-1, E) becomes -1 (dropped) instead of
    wrapping into a valid expert."""
    if indices.dtype == torch.int32:
        return indices
    return torch.where((indices >= -1) & (indices < num_experts), indices, -1).to(torch.int32)


@_ext.cuda_impl(_aux_loss)
def _aux_loss_cuda(scores, tokens_per_expert, k, coeff):
    _check_aux(scores, tokens_per_expert, k)
    T, E = scores.shape
    C = _kernels("aux_loss", scores, E)
    if C is None:
        return aux_loss_reference(scores, tokens_per_expert, k, coeff)
    loss = torch.empty((), dtype=torch.float32, device=scores.device)
    chunks = C.balance_chunks(T, max(T, 1))
    partial_sums = torch.empty((chunks, E), dtype=torch.float32, device=scores.device)
    where = _ext.launch_args(scores)
    C.balance_loss_fwd(
        scores=_ext.ptr(scores), indices=0, counts=_ext.ptr(tokens_per_expert),
        counts_int64=tokens_per_expert.dtype == torch.int64, partial_sums=_ext.ptr(partial_sums), partial_counts=0,
        seq_counts=0, loss=loss.data_ptr(), counter=_ext.counter(scores, where["device"], where["stream"]),
        num_tokens=T, num_experts=E, k=k, seq_len=max(T, 1), scale=_aux_scale(coeff, E, k, T),
        dtype=_ext.dtype_code(scores.dtype), **where,
    )
    return loss


@_ext.cuda_impl(_seq_aux_loss)
def _seq_aux_loss_cuda(scores, indices, coeff, seq_len):
    _check_seq(scores, indices, seq_len)
    rows, E = scores.shape
    C = _kernels("seq_aux_loss", scores, E, counts_in_shared_memory=True)
    if C is None or _ext.checks_enabled():
        _check_indices_values(indices, E, "seq_aux_loss")
    if C is None:
        return seq_aux_loss_reference(scores, indices, coeff, seq_len)
    B, k = rows // seq_len, indices.shape[1]
    idx = _as_int32_indices(indices, E)
    loss = torch.empty((), dtype=torch.float32, device=scores.device)
    seq_counts = torch.empty((B, E), dtype=torch.int32, device=scores.device)
    chunks = C.balance_chunks(rows, seq_len)
    partial_sums = torch.empty((chunks, E), dtype=torch.float32, device=scores.device)
    partial_counts = torch.empty((chunks, E), dtype=torch.int32, device=scores.device)
    where = _ext.launch_args(scores)
    C.balance_loss_fwd(
        scores=_ext.ptr(scores), indices=_ext.ptr(idx), counts=0, counts_int64=False,
        partial_sums=_ext.ptr(partial_sums), partial_counts=_ext.ptr(partial_counts),
        seq_counts=_ext.ptr(seq_counts), loss=loss.data_ptr(),
        counter=_ext.counter(scores, where["device"], where["stream"]), num_tokens=rows, num_experts=E, k=k,
        seq_len=seq_len, scale=_aux_scale(coeff, E, k, seq_len) / max(B, 1),
        dtype=_ext.dtype_code(scores.dtype), **where,
    )
    return loss, seq_counts


@_ext.cuda_impl(_balance_loss_bwd)
def _balance_loss_bwd_cuda(grad, counts, num_tokens, seq_len, scale, dtype):
    _check_balance_bwd(grad, counts, num_tokens, seq_len, dtype)
    E = counts.shape[1]
    C = _kernels("aux loss backward", grad, E, dtype=dtype)
    if C is None or grad.dtype != torch.float32:
        return balance_loss_bwd_reference(grad, counts, num_tokens, seq_len, scale, dtype)
    out = torch.empty((num_tokens, E), dtype=dtype, device=grad.device)
    grad = grad.contiguous()  # kept alive until the launch
    counts = counts.contiguous()
    C.balance_loss_bwd(
        grad=grad.data_ptr(), counts=_ext.ptr(counts), counts_int64=counts.dtype == torch.int64,
        grad_scores=_ext.ptr(out), num_tokens=num_tokens, num_experts=E, seq_len=seq_len, scale=float(scale),
        dtype=_ext.dtype_code(dtype), **_ext.launch_args(grad),
    )
    return out


@_ext.cuda_impl(_z_loss)
def _z_loss_cuda(logits, coeff):
    check_tensor("z_loss", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    T, E = logits.shape
    C = _kernels("z_loss", logits, E)
    if C is None:
        return z_loss_reference(logits, coeff)
    loss = torch.empty((), dtype=torch.float32, device=logits.device)
    lse = torch.empty((T,), dtype=torch.float32, device=logits.device)
    partials = torch.empty((C.z_loss_chunks(T),), dtype=torch.float32, device=logits.device)
    C.z_loss_fwd(
        logits=_ext.ptr(logits), lse=_ext.ptr(lse), partials=_ext.ptr(partials), loss=loss.data_ptr(),
        num_tokens=T, num_experts=E, coeff=float(coeff), dtype=_ext.dtype_code(logits.dtype),
        **_ext.launch_args(logits),
    )
    return loss, lse


@_ext.cuda_impl(_z_loss_bwd)
def _z_loss_bwd_cuda(grad, logits, lse, coeff):
    _check_z_bwd(grad, logits, lse)
    T, E = logits.shape
    C = _kernels("z_loss backward", logits, E)
    if C is None or grad.dtype != torch.float32 or lse.dtype != torch.float32:
        return z_loss_bwd_reference(grad, logits, lse, coeff)
    out = torch.empty_like(logits)
    grad, lse = grad.contiguous(), lse.contiguous()  # kept alive until the launch
    C.z_loss_bwd(
        grad=grad.data_ptr(), logits=_ext.ptr(logits), lse=_ext.ptr(lse), grad_logits=_ext.ptr(out),
        num_tokens=T, num_experts=E, coeff=float(coeff), dtype=_ext.dtype_code(logits.dtype),
        **_ext.launch_args(logits),
    )
    return out


@_ext.cuda_impl(_apply_capacity)
def _apply_capacity_cuda(weights, indices, num_experts, capacity_factor, policy):
    _check_capacity(weights, indices, num_experts, capacity_factor, policy)
    C = _kernels("apply_capacity", weights, num_experts, counts_in_shared_memory=True)
    if C is None or _ext.checks_enabled():
        _check_indices_values(indices, num_experts, "apply_capacity")
    if C is None:
        return apply_capacity_reference(weights, indices, num_experts, capacity_factor, policy)
    T, k = indices.shape
    n = T * k
    if n > _INT32_MAX:
        raise ValueError(f"apply_capacity: {n} (token, slot) pairs do not fit the int32 kernel; split the batch")
    cap = min(capacity(T, k, num_experts, capacity_factor), n)
    weights_out = torch.empty_like(weights)
    indices_out = torch.empty_like(indices)
    workspace = torch.empty(C.capacity_workspace_bytes(n, num_experts), dtype=torch.uint8, device=weights.device)
    C.apply_capacity(
        weights=_ext.ptr(weights), indices=_ext.ptr(indices), weights_out=_ext.ptr(weights_out),
        indices_out=_ext.ptr(indices_out), workspace=_ext.ptr(workspace), num_slots=n, num_experts=num_experts,
        capacity=cap, by_probs=policy == "probs", dtype=_ext.dtype_code(weights.dtype),
        **_ext.launch_args(weights),
    )
    return weights_out, indices_out


@_ext.cuda_impl(_update_expert_bias)
def _update_expert_bias_cuda(bias, tokens_per_expert, rate):
    _check_bias(bias, tokens_per_expert, rate)
    E = bias.shape[0]
    C = _kernels("update_expert_bias", bias, E) if tokens_per_expert.dtype in _COUNT_DTYPES else None
    if C is None or E == 0:
        update_expert_bias_reference(bias, tokens_per_expert, rate)
        return
    C.update_expert_bias(
        bias=bias.data_ptr(), counts=tokens_per_expert.data_ptr(),
        counts_int64=tokens_per_expert.dtype == torch.int64, num_experts=E, rate=float(rate),
        **_ext.launch_args(bias),
    )


# ---------------------------------------------------------------------------------------------------
# Public API


def aux_loss(scores, tokens_per_expert, k: int, coeff: float):
    """coeff * E / (k * T^2) * sum_e (sum_t scores[t, e]) * c_e (Megatron-Core's normalisation):
    uniform scores with even counts give exactly `coeff`. Differentiable w.r.t. scores."""
    L = _ext.eager(scores)
    if L is not None and scores.dtype in _EAGER_DTYPES:
        _check_aux(scores, tokens_per_expert, k)
        if scores.shape[1] > 0:
            T, E = scores.shape
            return _BalanceEager.apply(scores, tokens_per_expert.contiguous(), None, k, max(T, 1),
                                       _aux_scale(float(coeff), E, k, T), L)
    return torch.ops.moe_kernels.aux_loss(scores, tokens_per_expert, k, float(coeff))


def seq_aux_loss(scores, indices, coeff: float, *, seq_len: int):
    """Mean over the B = rows / seq_len sequences of aux_loss computed on each sequence alone, with
    k = indices.shape[1] (DeepSeek-V2/V3 sequence-wise balance loss)."""
    L = _ext.eager(scores)
    if L is not None and scores.dtype in _EAGER_DTYPES and isinstance(indices, Tensor) and indices.dtype == torch.int32:
        _check_seq(scores, indices, seq_len)
        rows, E = scores.shape
        if 0 < E <= L.C.balance_max_experts:
            k = indices.shape[1]
            scale = _aux_scale(float(coeff), E, k, seq_len) / max(rows // seq_len, 1)
            return _BalanceEager.apply(scores, None, indices.contiguous(), k, seq_len, scale, L)
    return torch.ops.moe_kernels.seq_aux_loss(scores, indices, float(coeff), seq_len)[0]


def z_loss(logits, coeff: float):
    """coeff * mean_t logsumexp(logits[t])^2."""
    L = _ext.eager(logits)
    if L is not None and logits.dtype in _EAGER_DTYPES and logits.dim() == 2 and logits.shape[1] > 0:
        check_tensor("z_loss", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
        return _ZEager.apply(logits, float(coeff), L)
    return torch.ops.moe_kernels.z_loss(logits, float(coeff))[0]


# ---------------------------------------------------------------------------------------------------
# Eager paths: the kernels called directly (the registered ops' results exactly; moe_kernels.nn.fused states
# the convention). Their backward stays differentiable under create_graph, as the registered ops' does.

_EAGER_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
class _BalanceEager(torch.autograd.Function):
    """aux_loss (counts given, one sequence of T rows) or seq_aux_loss (indices given, sequences of S rows)."""

    @staticmethod
    def forward(ctx, scores, counts, indices, k, S, scale, L):
        T, E = scores.shape
        dev = scores.device
        dt = _EAGER_DTYPES[scores.dtype]
        loss = torch.empty((), dtype=torch.float32, device=dev)
        chunks = _ext.size_of(L.C, "balance_chunks", T, S)
        partial_sums = torch.empty((chunks, E), dtype=torch.float32, device=dev)
        counter = _ext.counter(scores, L.device, L.stream)
        if indices is None:  # aux_loss
            L.C.balance_loss_fwd(_ext.ptr(scores), 0, _ext.ptr(counts), counts.dtype == torch.int64,
                                 _ext.ptr(partial_sums), 0, 0, loss.data_ptr(), counter, T, E, k, S, scale, dt,
                                 L.device, L.stream)
            saved = counts.view(1, -1)
        else:
            saved = torch.empty((T // S, E), dtype=torch.int32, device=dev)
            partial_counts = torch.empty((chunks, E), dtype=torch.int32, device=dev)
            L.C.balance_loss_fwd(_ext.ptr(scores), _ext.ptr(indices), 0, False, _ext.ptr(partial_sums),
                                 _ext.ptr(partial_counts), _ext.ptr(saved), loss.data_ptr(), counter, T, E, k, S,
                                 scale, dt, L.device, L.stream)
        ctx.save_for_backward(saved)
        ctx.T, ctx.S, ctx.scale, ctx.dtype, ctx.L = T, S, scale, scores.dtype, L
        return loss

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        if torch.is_grad_enabled() or grad.dtype != torch.float32:  # create_graph: the differentiable composition
            g = _balance_backward(grad, counts, ctx.T, ctx.S, ctx.scale, ctx.dtype)
        else:
            L = ctx.L
            T, S = _grad_rows(counts, ctx.T, ctx.S)
            g = torch.empty((T, counts.shape[1]), dtype=ctx.dtype, device=grad.device)
            grad = grad.contiguous()
            L.C.balance_loss_bwd(grad.data_ptr(), _ext.ptr(counts), counts.dtype == torch.int64, _ext.ptr(g), T,
                                 counts.shape[1], S, ctx.scale, _EAGER_DTYPES[ctx.dtype], L.device, L.stream)
            g = g.expand(ctx.T, counts.shape[1])
        return g, None, None, None, None, None, None


class _ZEager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, coeff, L):
        T, E = logits.shape
        dev = logits.device
        loss = torch.empty((), dtype=torch.float32, device=dev)
        lse = torch.empty((T,), dtype=torch.float32, device=dev)
        partials = torch.empty((_ext.size_of(L.C, "z_loss_chunks", T),), dtype=torch.float32, device=dev)
        L.C.z_loss_fwd(_ext.ptr(logits), _ext.ptr(lse), _ext.ptr(partials), loss.data_ptr(), T, E, coeff,
                       _EAGER_DTYPES[logits.dtype], L.device, L.stream)
        ctx.save_for_backward(logits, lse)
        ctx.coeff, ctx.L = coeff, L
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, lse = ctx.saved_tensors
        if grad.dtype != torch.float32:
            return torch.ops.moe_kernels.z_loss_bwd(grad, logits, lse, ctx.coeff), None, None
        if torch.is_grad_enabled():  # create_graph: as the registered op's backward
            x = logits.to(_acc_dtype(logits))
            g = grad * ctx.coeff * 2.0 / max(x.shape[0], 1) * torch.logsumexp(x, -1, keepdim=True) * torch.softmax(x, -1)
            return g.to(logits.dtype), None, None
        L = ctx.L
        T, E = logits.shape
        out = torch.empty_like(logits)
        grad = grad.float().contiguous()
        L.C.z_loss_bwd(grad.data_ptr(), _ext.ptr(logits), _ext.ptr(lse), _ext.ptr(out), T, E, ctx.coeff,
                       _EAGER_DTYPES[logits.dtype], L.device, L.stream)
        return out, None, None


def apply_capacity(weights, indices, num_experts: int, capacity_factor: float, policy: str = "probs"):
    """Keep at most C = ceil(T * k / E * capacity_factor) (token, slot) pairs per expert: the C largest
    weights ("probs", ties to the lower token) or the C lowest tokens ("position"). Dropped pairs get
    index -1 and weight 0; weights are not renormalised."""
    if isinstance(indices, Tensor) and indices.dtype == torch.int64:
        if _ext.runs_references(indices) or _ext.checks_enabled():
            _check_indices_values(indices, num_experts, "apply_capacity")
        indices = _as_int32_indices(indices, num_experts)
    return torch.ops.moe_kernels.apply_capacity(weights, indices, num_experts, float(capacity_factor), policy)


def update_expert_bias(bias, tokens_per_expert, rate: float) -> None:
    """In place: bias += rate * sign(mean(c) - c) (aux-loss-free balancing)."""
    torch.ops.moe_kernels.update_expert_bias(bias, tokens_per_expert, float(rate))
