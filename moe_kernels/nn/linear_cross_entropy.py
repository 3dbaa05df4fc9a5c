"""Fused linear cross-entropy: the lm_head and the loss over chunks of tokens, never the [N, V] logits.

    loss = reduce_i ( logsumexp_v (h_i . w_v + b_v) - (h_i . w_t_i + b_t_i) )   over rows with t_i != ignore_index

Shapes: N tokens, H hidden, V vocabulary, C rows of a chunk. For qwen3-30b-a3b (V = 151,936) at N = 4096
the fp32 logits the composition F.cross_entropy(F.linear(h, w).float(), t) holds are 2.5 GB, and its backward
holds their gradient too; here one chunk's [C, V] fp32 logits exist at a time (CHUNK_BYTES below).

Gradients are computed in the forward (the Liger-Kernel approach), not recomputed in the backward: per chunk
the forward already has the fp32 logits, so it turns them into softmax - onehot in place and runs the two
gradient GEMMs right away; the backward only scales the stored gradients by the incoming one (a scalar:
reductions "mean" and "sum" only). Three GEMMs of 2NHV FLOPs each instead of four (a recomputing backward
runs the logits GEMM again), at the price of holding grad_hidden [N, H] and grad_weight [V, H] from the
forward to the backward; both are the size of tensors the step holds anyway (the hidden states and the
weight's gradient), and the lm_head is the last op of the forward and the first of the backward, so the
time they are held is short. Under torch.no_grad (eval) no gradient work is done.

Precision: the logits GEMM accumulates in fp32 and writes fp32 (bf16 inputs: torch.mm(..., out_dtype=fp32)
on CUDA; the exact fp32 upcast elsewhere), so the loss is within fp32 rounding of the fp32 composition of the
same input values, and more accurate than the unfused bf16 path, which rounds each logit to bf16. The
log-sum-exp and the target logit are fp32. softmax - onehot is rounded to the input dtype for the two
gradient GEMMs (as the unfused path's autograd does); grad_hidden is fp32-accumulated and rounded once,
grad_weight is accumulated in fp32 across the chunks and cast to the weight's dtype at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The bound on one chunk's fp32 logits [C, V]: C = CHUNK_BYTES / (4 V) rows, rounded down to a multiple of 16
# (tensor-core tiles) when that leaves at least 16. Beside them a chunk holds softmax - onehot in the input
# dtype (half as much for bf16), so about 1.5 x CHUNK_BYTES in all. V = 151,936: 432 rows, 263 MB of fp32
# logits (~390 MB a chunk); a 4096-token batch in 10 chunks, each GEMM 432 x 2048 x 151,936 (large enough to
# fill an H100/H200).
CHUNK_BYTES = 256 * 2**20

REDUCTIONS = ("mean", "sum")


def default_chunk_size(vocab_size: int) -> int:
    """Rows a chunk holds so that its fp32 logits stay within CHUNK_BYTES (module constant)."""
    rows = max(1, CHUNK_BYTES // (4 * max(vocab_size, 1)))
    return rows - rows % 16 if rows >= 16 else rows


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b accumulated in and written as fp32."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:  # cuBLAS: bf16/fp16 inputs, fp32 output (no rounding of the result to the input dtype)
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # (the upcast is exact: elsewhere no fp32-output GEMM for bf16 inputs)


def _addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, acc fp32, the product accumulated in fp32 into it."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


class _LinearCrossEntropy(torch.autograd.Function):
    """forward(hidden [N, H], weight [V, H], bias [V] or None, targets [N], ignore_index, mean, chunk, which
    gradients) -> the fp32 loss; the gradients are computed here and scaled in backward (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index: int, mean: bool, chunk: int,
                need_hidden: bool, need_weight: bool, need_bias: bool):
        N, V = hidden.shape[0], weight.shape[0]
        device = hidden.device
        valid_all = targets != ignore_index  # [N]
        count = valid_all.sum()
        # mean: 1 / count; no counted target gives 0 / 0 = NaN for the loss (F.cross_entropy's convention)
        # and zero gradients (the 1 / count of the gradients clamped, every row's factor 0).
        row_scale = 1.0 / count.clamp(min=1).float() if mean else torch.ones((), device=device)
        need_grad = need_hidden or need_weight or need_bias
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_weight else None
        grad_bias = torch.zeros(V, dtype=torch.float32, device=device) if need_bias else None
        bias32 = bias.float() if bias is not None else None
        weight_t = weight.t()  # [H, V]
        total = torch.zeros((), dtype=torch.float32, device=device)
        for start in range(0, N, chunk):
            h = hidden[start:start + chunk]  # [C, H]
            t = targets[start:start + chunk]
            valid = valid_all[start:start + chunk]
            safe_t = torch.where(valid, t, 0).unsqueeze(1)  # [C, 1] (ignored rows read column 0, then count 0)
            z = _mm_fp32(h, weight_t)  # [C, V] fp32 logits
            if bias32 is not None:
                z += bias32
            lse = torch.logsumexp(z, dim=1)  # [C]
            target_logit = z.gather(1, safe_t).squeeze(1)
            total += torch.where(valid, lse - target_logit, 0.0).sum()
            if not need_grad:
                continue
            # dloss/dz = (softmax(z) - onehot(t)) x the row's factor, in place in the fp32 logits.
            z.sub_(lse.unsqueeze(1)).exp_()
            z.scatter_add_(1, safe_t, -valid.to(z.dtype).unsqueeze(1))
            z.mul_((valid.to(z.dtype) * row_scale).unsqueeze(1))
            if need_bias:
                grad_bias += z.sum(0)
            dz = z.to(hidden.dtype)  # [C, V] in the input dtype for the GEMMs (fp32 input: z itself)
            if need_hidden:
                grad_hidden[start:start + chunk] = _mm_fp32(dz, weight)  # [C, H]
            if need_weight:
                _addmm_fp32_(grad_weight, dz.t(), h)  # [V, H]
        loss = total / count.float() if mean else total
        ctx.grads = (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias else None,
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: the gradients were computed in the forward and handed out by "
                               "the first backward; a second backward through the same graph is not supported")
        grads, ctx.grads = ctx.grads, None
        # Scaled in place: these tensors belong to this node alone (and are released with it).
        grad_hidden, grad_weight, grad_bias = (g.mul_(grad_loss.to(g.dtype)) if g is not None else None
                                               for g in grads)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None) -> Tensor:
    """F.cross_entropy(F.linear(hidden, weight, bias).float(), targets) without the [N, V] logits.

    hidden [..., H] and targets [...] (flattened to N rows), weight [V, H] (an lm_head's, or a tied
    embedding's), bias [V] or None, in one floating dtype (under autocast: cast to the autocast dtype, as
    F.linear would be). reduction "mean" (over the rows whose target is not ignore_index; NaN when there is
    none, with zero gradients, as F.cross_entropy) or "sum" (0 then). chunk_size: rows a chunk (default
    default_chunk_size(V): the fp32 logits of a chunk within CHUNK_BYTES). Returns an fp32 scalar. Targets
    must lie in [0, V) or equal ignore_index (not checked: that would read them on the host).

    The backward hands out gradients computed in the forward (module docstring), so a graph through this
    loss can be backpropagated once."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: weight must be [V, H], got {tuple(weight.shape)}")
    V, H = weight.shape
    if hidden.shape[-1:] != (H,) or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden [..., H={H}] and targets [...] must match, got hidden "
                         f"{tuple(hidden.shape)} and targets {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: targets must be int64 or int32, got {targets.dtype}")
    if bias is not None and bias.shape != (V,):
        raise ValueError(f"linear_cross_entropy: bias must be [V={V}], got {tuple(bias.shape)}")
    if chunk_size is None:
        chunk_size = default_chunk_size(V)
    elif chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the lm_head's F.linear would run in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(f"linear_cross_entropy: hidden, weight and bias must share one floating dtype, got "
                         f"{hidden.dtype}, {weight.dtype}" + (f", {bias.dtype}" if bias is not None else ""))
    hidden = hidden.reshape(-1, H)
    targets = targets.reshape(-1)
    grad = torch.is_grad_enabled()
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(
            hidden, weight, bias, targets, ignore_index, reduction == "mean", chunk_size,
            grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
