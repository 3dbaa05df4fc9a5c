"""Router: fused top-k routing and its load-balancing losses (specs/ops.md, "Router").

Shapes: T tokens, E experts, k experts per token, G expert groups. Math is fp32 (fp64 for fp64
logits). Ranking is by selection score, descending, ties to the lower expert index; a NaN selection
score ranks as -inf. Each op has a schema in the `moe_kernels` namespace, a CPU reference in plain
PyTorch, a CUDA implementation, a fake implementation and autograd.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_kernels import _ext
from moe_kernels import onnx as _onnx
from moe_kernels.ops._checks import FLOAT_DTYPES, check_cuda_dtype, check_int, check_shape, check_tensor

SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
GROUP_EPS = 1e-20  # added to the sum before normalising sigmoid/sqrtsoftplus weights


# ---------------------------------------------------------------------------------------------------
# Validation


def _check_topk(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias) -> None:
    op = "router_topk"
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    E = logits.shape[1]
    if score not in SCORES:
        raise ValueError(f"{op}: `score` must be one of {SCORES}, got {score!r}")
    check_int(op, "k", k, minimum=1, maximum=E)
    if pre_softmax and score != "softmax":
        raise ValueError(f"{op}: `pre_softmax` applies to score='softmax' only, got score={score!r}")
    check_int(op, "num_groups", num_groups, minimum=1, maximum=E)
    if E % num_groups:
        raise ValueError(f"{op}: `num_groups`={num_groups} must divide the {E} experts")
    check_int(op, "group_topk", group_topk, minimum=1, maximum=num_groups)
    check_int(op, "group_score_topk", group_score_topk, minimum=1, maximum=E // num_groups)
    if expert_bias is not None:
        if score == "softmax" and not pre_softmax:
            raise ValueError(f"{op}: `expert_bias` with score='softmax' needs `pre_softmax=True` (the bias is added to "
                             "the probabilities; selection by raw logits takes no bias)")
        check_tensor(op, "expert_bias", expert_bias, ndim=1, dtypes=(torch.float32, torch.float64), device=logits.device)
        check_shape(op, "expert_bias", expert_bias, (E,), "one per expert")


def _check_score(op: str, score: str) -> None:
    if score not in SCORES:
        raise ValueError(f"{op}: `score` must be one of {SCORES}, got {score!r}")


def _check_topk_bwd(grad_weights, logits, indices, score, pre_softmax) -> None:
    """The backward helper op reads grad_weights[t, j] and logits[t, indices[t, j]]: every shape is tied
    to logits [T, E] and indices [T, k] here, so no kernel sizes a read from a mismatched tensor."""
    op = "router_topk_bwd"
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "indices", indices, ndim=2, dtypes=(torch.int32,), device=logits.device)
    check_tensor(op, "grad_weights", grad_weights, ndim=2, dtypes=FLOAT_DTYPES, device=logits.device)
    _check_score(op, score)
    if pre_softmax and score != "softmax":
        raise ValueError(f"{op}: `pre_softmax` applies to score='softmax' only, got score={score!r}")
    T, E = logits.shape
    k = indices.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"{op}: `indices` must have k in [1, {E}] columns (one per chosen expert), got shape "
                         f"{tuple(indices.shape)}")
    check_shape(op, "indices", indices, (T, k), "one row of chosen experts per row of logits")
    check_shape(op, "grad_weights", grad_weights, (T, k), "same as indices: [T, k]")


def _check_topk_bwd_indices_values(indices: Tensor, num_experts: int) -> None:
    """Raises ValueError for a chosen expert outside [0, E). Syncs when `indices` is on a GPU."""
    bad = (indices < 0) | (indices >= num_experts)
    if bool(bad.any()):
        raise ValueError(
            f"router_topk_bwd: `indices` holds {indices[bad][0].item()}, outside [0, {num_experts}) (experts of logits)"
        )


def _check_aux_bwd(grad_scores, logits, score) -> None:
    op = "router_aux_scores_bwd"
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "grad_scores", grad_scores, ndim=2, dtypes=FLOAT_DTYPES, device=logits.device)
    _check_score(op, score)
    if logits.shape[1] < 1:
        raise ValueError(f"{op}: `logits` must have at least one expert, got shape {tuple(logits.shape)}")
    check_shape(op, "grad_scores", grad_scores, logits.shape, "same as logits: [T, E]")


# ---------------------------------------------------------------------------------------------------
# References


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _rank_key(sel: Tensor) -> Tensor:
    return torch.where(torch.isnan(sel), -math.inf, sel)


def _topk_stable(sel: Tensor, k: int) -> Tensor:
    """Indices of the k largest along the last dim, descending; ties to the lower index."""
    return torch.sort(_rank_key(sel), dim=-1, descending=True, stable=True).indices[..., :k]


def _activation(logits: Tensor, score: str) -> Tensor:
    if score == "sigmoid":
        return torch.sigmoid(logits)
    if score == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))  # softplus(x) = x for x > 20 (torch's threshold)
    raise ValueError(score)


def router_selection_scores(logits: Tensor, score: str, pre_softmax: bool, expert_bias: Tensor | None) -> Tensor:
    """[T, E] scores that top-k ranks (before any group limit)."""
    x = _acc(logits)
    if score == "softmax" and not pre_softmax:
        return x
    sel = torch.softmax(x, dim=-1) if score == "softmax" else _activation(x, score)
    return sel + expert_bias.to(sel.dtype) if expert_bias is not None else sel


def router_group_scores(sel: Tensor, num_groups: int, group_score_topk: int) -> Tensor:
    """[T, G]: each group's sum of its `group_score_topk` best selection scores, largest first."""
    T, E = sel.shape
    top = torch.sort(_rank_key(sel).view(T, num_groups, E // num_groups), dim=-1, descending=True, stable=True).values
    group_score = top[..., 0]
    for i in range(1, group_score_topk):  # sequential sum, largest first: what the kernel does
        group_score = group_score + top[..., i]
    return group_score


def router_selection_reference(
    logits: Tensor, k: int, score: str, pre_softmax: bool, num_groups: int, group_topk: int,
    group_score_topk: int, expert_bias: Tensor | None,
) -> Tensor:
    """[T, k] int64 chosen experts."""
    sel = router_selection_scores(logits, score, pre_softmax, expert_bias)
    T, E = sel.shape
    if num_groups > 1:
        keep = _topk_stable(router_group_scores(sel, num_groups, group_score_topk), group_topk)  # [T, g]
        mask = torch.zeros((T, num_groups), dtype=torch.bool, device=sel.device).scatter(1, keep, True)
        sel = torch.where(mask.repeat_interleave(E // num_groups, dim=1), sel, -math.inf)
    return _topk_stable(sel, k)


def router_weights_reference(
    logits: Tensor, indices: Tensor, score: str, pre_softmax: bool, normalize: bool, scaling_factor: float
) -> Tensor:
    """Weights of the chosen experts; differentiable w.r.t. logits (the backward reference uses this)."""
    x = _acc(logits)
    idx = indices.long()
    if score == "softmax":
        # with pre_softmax and normalize: the chosen probabilities over their sum, i.e. the softmax over the chosen
        # logits (computed so: no underflowing quotient)
        over_all = pre_softmax and not normalize
        w = torch.softmax(x, dim=-1).gather(1, idx) if over_all else torch.softmax(x.gather(1, idx), dim=-1)
    else:
        w = _activation(x, score).gather(1, idx)
        if normalize:
            w = w / (w.sum(dim=-1, keepdim=True) + GROUP_EPS)
    return w * scaling_factor


def router_topk_reference(
    logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor, expert_bias, normalize
) -> tuple[Tensor, Tensor]:
    idx = router_selection_reference(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias)
    w = router_weights_reference(logits, idx, score, pre_softmax, normalize, scaling_factor)
    return w, idx.to(torch.int32)


_SQRTSOFTPLUS_TAIL = -40.0  # below it e^x < 5e-18: sqrt(softplus(x)) = sqrt(e^x) to fp64 rounding


def _activation_grad(x: Tensor, s: Tensor, score: str) -> Tensor:
    """ds/dx for s = activation(x). sqrt-softplus: sigmoid(x) / (2 s), and sqrt(e^x) / 2 below -40 (the same
    to fp64 rounding there), since the quotient is 0 / 0 where softplus underflows (fp32: about -104; -inf)."""
    if score == "sigmoid":
        return s * (1 - s)
    tail = 0.5 * torch.exp(0.5 * x)
    return torch.where(x < _SQRTSOFTPLUS_TAIL, tail, torch.where(x > 20, 1.0, torch.sigmoid(x)) / (2 * s))


def router_topk_bwd_reference(grad_weights, logits, indices, score, pre_softmax, normalize, scaling_factor) -> Tensor:
    """d loss / d logits given d loss / d weights, for the experts chosen in the forward."""
    x = _acc(logits)
    idx = indices.long()
    g = grad_weights.to(x.dtype) * scaling_factor  # [T, k]
    if score == "softmax" and pre_softmax and not normalize:
        p = torch.softmax(x, dim=-1)  # every logit feeds the softmax over E
        dot = (g * p.gather(1, idx)).sum(-1, keepdim=True)
        return p * (torch.zeros_like(x).scatter(1, idx, g) - dot)
    x_sel = x.gather(1, idx)
    if score == "softmax":
        w = torch.softmax(x_sel, dim=-1)
        d_sel = w * (g - (g * w).sum(-1, keepdim=True))
    else:
        s = _activation(x_sel, score)
        ds = g
        if normalize:
            denom = s.sum(-1, keepdim=True) + GROUP_EPS
            ds = (g - (g * (s / denom)).sum(-1, keepdim=True)) / denom
        d_sel = ds * _activation_grad(x_sel, s, score)
    return torch.zeros_like(x).scatter(1, idx, d_sel)


def aux_scores_values(logits: Tensor, score: str) -> Tensor:
    """Scores over all experts, no bias, no groups: softmax, or s / (sum s + 1e-20)."""
    x = _acc(logits)
    if score == "softmax":
        return torch.softmax(x, dim=-1)
    s = _activation(x, score)
    return s / (s.sum(dim=-1, keepdim=True) + GROUP_EPS)


def router_aux_scores_reference(logits: Tensor, k: int, score: str) -> tuple[Tensor, Tensor]:
    scores = aux_scores_values(logits, score)
    return scores, _topk_stable(scores, k).to(torch.int32)


def router_aux_scores_bwd_reference(grad_scores: Tensor, logits: Tensor, score: str) -> Tensor:
    x = _acc(logits)
    g = grad_scores.to(x.dtype)
    if score == "softmax":
        p = torch.softmax(x, dim=-1)
        return p * (g - (g * p).sum(-1, keepdim=True))
    s = _activation(x, score)
    denom = s.sum(-1, keepdim=True) + GROUP_EPS
    ds = (g - (g * (s / denom)).sum(-1, keepdim=True)) / denom
    return ds * _activation_grad(x, s, score)


# ---------------------------------------------------------------------------------------------------
# Registered ops: router_topk and router_aux_scores (CUDA kernels), with backward helper ops


@torch.library.custom_op("moe_kernels::router_topk", mutates_args=())
def _router_topk(
    logits: Tensor, k: int, score: str, pre_softmax: bool, num_groups: int, group_topk: int,
    group_score_topk: int, scaling_factor: float, expert_bias: Tensor | None, normalize: bool,
) -> tuple[Tensor, Tensor]:
    _check_topk(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias)
    return router_topk_reference(
        logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor, expert_bias, normalize
    )


@torch.library.custom_op("moe_kernels::router_topk_bwd", mutates_args=())
def _router_topk_bwd(
    grad_weights: Tensor, logits: Tensor, indices: Tensor, score: str, pre_softmax: bool, normalize: bool,
    scaling_factor: float,
) -> Tensor:
    _check_topk_bwd(grad_weights, logits, indices, score, pre_softmax)
    _check_topk_bwd_indices_values(indices, logits.shape[1])
    return router_topk_bwd_reference(grad_weights, logits, indices, score, pre_softmax, normalize, scaling_factor)


@torch.library.custom_op("moe_kernels::router_aux_scores", mutates_args=())
def _router_aux_scores(logits: Tensor, k: int, score: str) -> tuple[Tensor, Tensor]:
    check_tensor("router_aux_scores", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_int("router_aux_scores", "k", k, minimum=1, maximum=logits.shape[1])
    _check_score("router_aux_scores", score)
    return router_aux_scores_reference(logits, k, score)


@torch.library.custom_op("moe_kernels::router_aux_scores_bwd", mutates_args=())
def _router_aux_scores_bwd(grad_scores: Tensor, logits: Tensor, score: str) -> Tensor:
    _check_aux_bwd(grad_scores, logits, score)
    return router_aux_scores_bwd_reference(grad_scores, logits, score)


def _out_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@_router_topk.register_fake
def _(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor, expert_bias, normalize):
    _check_topk(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias)
    T = logits.shape[0]
    return logits.new_empty((T, k), dtype=_out_dtype(logits)), logits.new_empty((T, k), dtype=torch.int32)


@_router_topk_bwd.register_fake
def _(grad_weights, logits, indices, score, pre_softmax, normalize, scaling_factor):
    _check_topk_bwd(grad_weights, logits, indices, score, pre_softmax)
    return logits.new_empty(logits.shape, dtype=_out_dtype(logits))


@_router_aux_scores.register_fake
def _(logits, k, score):
    T, E = logits.shape
    return logits.new_empty((T, E), dtype=_out_dtype(logits)), logits.new_empty((T, k), dtype=torch.int32)


@_router_aux_scores_bwd.register_fake
def _(grad_scores, logits, score):
    _check_aux_bwd(grad_scores, logits, score)
    return logits.new_empty(logits.shape, dtype=_out_dtype(logits))


def _topk_setup_context(ctx, inputs, output):
    logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor, expert_bias, normalize = inputs
    _, indices = output
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(logits, indices)
    ctx.args = (score, pre_softmax, normalize, scaling_factor)
    ctx.logits_dtype = logits.dtype


def _topk_backward(ctx, grad_weights, _grad_indices):
    logits, indices = ctx.saved_tensors
    g = torch.ops.moe_kernels.router_topk_bwd(grad_weights.contiguous(), logits, indices, *ctx.args)
    return g.to(ctx.logits_dtype), None, None, None, None, None, None, None, None, None


_router_topk.register_autograd(_topk_backward, setup_context=_topk_setup_context)


def _aux_setup_context(ctx, inputs, output):
    logits, _, score = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits)
    ctx.score = score


def _aux_backward(ctx, grad_scores, _grad_indices):
    (logits,) = ctx.saved_tensors
    g = torch.ops.moe_kernels.router_aux_scores_bwd(grad_scores.contiguous(), logits, ctx.score)
    return g.to(logits.dtype), None, None


_router_aux_scores.register_autograd(_aux_backward, setup_context=_aux_setup_context)


# ---------------------------------------------------------------------------------------------------
# CUDA implementations

_SCORE_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def _cuda_prologue(op: str, logits: Tensor, k: int, num_groups: int = 1):
    check_cuda_dtype(op, "logits", logits)
    C = _ext.kernels(op, logits)
    if C is not None:
        if num_groups > C.router_max_groups:
            raise ValueError(f"{op}: the CUDA kernel takes `num_groups` <= {C.router_max_groups}, got {num_groups}")
        E = logits.shape[1]
        if E > C.router_max_experts:
            raise ValueError(f"{op}: the CUDA kernel takes at most {C.router_max_experts} experts (`logits` columns), got {E}")
        if k > C.router_max_k:
            raise ValueError(f"{op}: the CUDA kernel takes `k` <= {C.router_max_k}, got {k}")
    return C


@_ext.cuda_impl(_router_topk)
def _router_topk_cuda(
    logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor, expert_bias, normalize
):
    _check_topk(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias)
    C = _cuda_prologue("router_topk", logits, k, num_groups)
    if C is None:
        return router_topk_reference(
            logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor, expert_bias, normalize
        )
    T, E = logits.shape
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    bias = None if expert_bias is None else expert_bias.float().contiguous()
    C.router_topk_fwd(
        logits=_ext.ptr(logits), bias=_ext.ptr(bias), weights=_ext.ptr(weights), indices=_ext.ptr(indices),
        num_tokens=T, num_experts=E, k=k, score=_SCORE_CODES[score], pre_softmax=pre_softmax,
        num_groups=num_groups, group_topk=group_topk, group_score_topk=group_score_topk,
        normalize=normalize, scaling_factor=float(scaling_factor), dtype=_ext.dtype_code(logits.dtype),
        **_ext.launch_args(logits),
    )
    return weights, indices


@_ext.cuda_impl(_router_topk_bwd)
def _router_topk_bwd_cuda(grad_weights, logits, indices, score, pre_softmax, normalize, scaling_factor):
    _check_topk_bwd(grad_weights, logits, indices, score, pre_softmax)
    C = _cuda_prologue("router_topk backward", logits, indices.shape[1])
    if C is None or _ext.checks_enabled():  # the kernel skips an out-of-range slot; the reference cannot
        _check_topk_bwd_indices_values(indices, logits.shape[1])
    if C is None:
        return router_topk_bwd_reference(grad_weights, logits, indices, score, pre_softmax, normalize, scaling_factor)
    T, E = logits.shape
    grad_logits = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    grad_weights = grad_weights.float().contiguous()  # kept alive until the launch
    C.router_topk_bwd(
        grad_weights=_ext.ptr(grad_weights), logits=_ext.ptr(logits), indices=_ext.ptr(indices),
        grad_logits=_ext.ptr(grad_logits), num_tokens=T, num_experts=E, k=indices.shape[1],
        score=_SCORE_CODES[score], pre_softmax=pre_softmax, normalize=normalize,
        scaling_factor=float(scaling_factor), dtype=_ext.dtype_code(logits.dtype), **_ext.launch_args(logits),
    )
    return grad_logits


@_ext.cuda_impl(_router_aux_scores)
def _router_aux_scores_cuda(logits, k, score):
    check_tensor("router_aux_scores", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_int("router_aux_scores", "k", k, minimum=1, maximum=logits.shape[1])
    _check_score("router_aux_scores", score)
    C = _cuda_prologue("router_aux_scores", logits, k)
    if C is None:
        return router_aux_scores_reference(logits, k, score)
    T, E = logits.shape
    scores = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    C.router_aux_scores_fwd(
        logits=_ext.ptr(logits), scores=_ext.ptr(scores), indices=_ext.ptr(indices), num_tokens=T, num_experts=E,
        k=k, score=_SCORE_CODES[score], dtype=_ext.dtype_code(logits.dtype), **_ext.launch_args(logits),
    )
    return scores, indices


@_ext.cuda_impl(_router_aux_scores_bwd)
def _router_aux_scores_bwd_cuda(grad_scores, logits, score):
    _check_aux_bwd(grad_scores, logits, score)
    C = _cuda_prologue("router_aux_scores backward", logits, 1)
    if C is None:
        return router_aux_scores_bwd_reference(grad_scores, logits, score)
    T, E = logits.shape
    grad_logits = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    grad_scores = grad_scores.float().contiguous()  # kept alive until the launch
    C.router_aux_scores_bwd(
        grad_scores=_ext.ptr(grad_scores), logits=_ext.ptr(logits),
        grad_logits=_ext.ptr(grad_logits), num_tokens=T, num_experts=E, score=_SCORE_CODES[score],
        dtype=_ext.dtype_code(logits.dtype), **_ext.launch_args(logits),
    )
    return grad_logits


# ---------------------------------------------------------------------------------------------------
# Public API


def router_topk(
    logits: Tensor,
    k: int,
    *,
    score: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: Tensor | None = None,
    normalize: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick k experts per token and their weights in one pass over the logits.

    Args:
        logits: [T, E] router logits (fp32, bf16, fp16; fp64 on the CPU).
        k: experts per token.
        score: "softmax" (selection by raw logits, weights = softmax over the k chosen; or with
            `pre_softmax` selection by p + expert_bias, p the softmax over all E, and weights p, or with
            `normalize` p over the sum of the k chosen p, computed as the softmax over the k chosen logits:
            ERNIE-4.5's routing), "sigmoid" or "sqrtsoftplus" (s = activation(logits); selection by
            s + expert_bias; weights s, divided by their sum + 1e-20 when `normalize`).
        num_groups, group_topk: group-limited routing (DeepSeek-V3): only experts in the `group_topk`
            best of `num_groups` contiguous groups are eligible; a group's score is the sum of its
            `group_score_topk` (default max(1, k // group_topk), at most the group's size) best selection
            scores. When k exceeds
            the experts of the kept groups, the remaining slots go to experts of the dropped groups,
            lowest index first (they rank as -inf, the tie rule below), each weighted by its own score;
            with k = E every expert is chosen, as in transformers' DeepSeek-V3 router.
        scaling_factor: multiplies the weights last.
        expert_bias: [E] fp32, selection only (aux-loss-free balancing); no gradient. With softmax it needs
            `pre_softmax` (it is added to the probabilities).
        normalize: default True when k > 1 for sigmoid and sqrtsoftplus, False for softmax (where it applies
            with `pre_softmax` only: the weights over the k chosen logits already sum to 1).

    Returns:
        weights [T, k] fp32 and indices [T, k] int32, ordered by selection score descending, ties to
        the lower expert index (a NaN score ranks as -inf). Gradients flow from weights to logits.

    Non-finite logits follow IEEE fp32 arithmetic through the formulas above, with one ranking rule:
    a NaN selection score (or group score) ranks as -inf, so NaN and -inf tie with each other and go
    to the lower expert (group) index. A NaN or -inf expert is therefore chosen only when fewer than
    k eligible experts score above -inf; the remaining slots then go to the lowest-index experts among
    those ranked -inf. Per score function:

    - softmax: the selection score is the logit. +inf ranks first (several +inf: lower index first);
      -inf and NaN rank last. The weights are the softmax over the k chosen logits: a chosen NaN or
      +inf, or k chosen logits all -inf, makes all k weights NaN (so a row with a +inf logit always has
      k NaN weights); otherwise a chosen -inf gets weight exactly 0.
    - softmax with `pre_softmax`: a NaN or +inf logit anywhere in the row, or a row of only -inf, makes
      the softmax over E NaN everywhere: every expert ranks -inf, the indices are 0, 1, ..., k-1 and all
      k weights are NaN. Otherwise a -inf logit has probability and weight exactly 0, tied with any
      probability that underflows to 0 (with `expert_bias`: selection score 0 + expert_bias[e]). With
      `normalize` the weights are the softmax over the k chosen logits, with the first bullet's rules.
    - sigmoid: s(NaN) = NaN, s(+inf) = 1, s(-inf) = 0. A -inf logit is not masked: it competes with
      selection score 0 + expert_bias[e] (like a finite logit whose fp32 sigmoid underflows to 0), with
      s = 0. A +inf logit competes with 1 + expert_bias[e] (like a logit above about 17), with s = 1.
      NaN ranks last whatever its bias.
    - sqrtsoftplus: s(NaN) = NaN, s(+inf) = +inf, s(-inf) = 0. +inf ranks first whatever a finite bias;
      -inf competes with 0 + expert_bias[e], with s = 0; NaN ranks last.
    - Weights of sigmoid and sqrtsoftplus: s at each chosen expert, so a chosen NaN gives NaN in its
      own slot, and a chosen +inf (sqrtsoftplus) gives +inf (times scaling_factor). With `normalize`,
      a chosen NaN makes all k weights NaN; with a chosen +inf and no NaN the sum is +inf, so each +inf
      slot gets NaN (inf / inf) and every other slot 0. k chosen scores of 0 (all -inf logits) give
      weights 0, thanks to the + 1e-20.
    - Gradients under sqrtsoftplus: ds/dx = sigmoid(x) / (2 s) would be 0 / 0 where s = 0, at -inf and
      wherever softplus underflows (fp32: logits at or below about -104). Below -40 the backward takes
      sqrt(e^x) / 2 instead (the same value to fp64 rounding there), so a chosen -inf or very negative
      expert gets a gradient of about 0 (exactly 0 at -inf), not NaN; likewise router_aux_scores, which
      differentiates every expert (so aux_loss stays finite with masked experts).
    - Group-limited routing: a group's score is the sum, largest first, of its `group_score_topk`
      best selection scores, NaN counted as -inf. The group ranks as -inf when that sum takes a -inf
      (the group has fewer than `group_score_topk` experts scoring above -inf, e.g. because of NaN
      logits), even beside a +inf (inf + -inf = NaN), and as +inf when it takes a +inf and no -inf.
      Group ties go to the lower group index. Experts of the dropped groups get selection score -inf
      and so tie with the NaN and -inf experts of the kept groups: when the kept groups hold fewer
      than k experts scoring above -inf, the remaining slots go to the lowest-index ones among all of
      these, possibly in a dropped group, weighted from their own logits as usual.

    The CUDA kernels implement the same rules; tests/ops/test_router_gpu.py compares them with the
    reference on these inputs (indices exactly, weights NaN-aware).
    """
    check_tensor("router_topk", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES, contiguous=False)  # before .shape
    G, g, gst, scale, norm = resolve_topk_options(k, num_groups, group_topk, group_score_topk, scaling_factor, normalize,
                                                  logits.shape[-1], score=score)
    if _onnx.exporting():
        return _onnx.router_topk_traceable(logits, k, score, pre_softmax, G, g, gst, scale, expert_bias, norm)
    L = _ext.eager(logits)
    if L is not None and _eager_fits(L.C, logits, k, G):
        _check_topk(logits, k, score, pre_softmax, G, g, gst, expert_bias)
        bias = None if expert_bias is None else expert_bias.float().contiguous()
        return _TopkEager.apply(logits, bias, k, _SCORE_CODES[score], pre_softmax, G, g, gst, scale, norm, L)
    return torch.ops.moe_kernels.router_topk(logits, k, score, pre_softmax, G, g, gst, scale, expert_bias, norm)


_EAGER_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _eager_fits(C, logits: Tensor, k: int, num_groups: int) -> bool:
    """The kernel takes these (else the registered op raises its ValueError or runs the reference)."""
    return (type(logits) is Tensor and logits.dtype in _EAGER_DTYPES and logits.dim() == 2
            and logits.shape[1] <= C.router_max_experts and type(k) is int and k <= C.router_max_k
            and num_groups <= C.router_max_groups)


class _TopkEager(torch.autograd.Function):
    """router_topk called eagerly: the kernels each way, positional arguments, the launch resolved once
    (the registered op's results exactly; moe_kernels.nn.fused states the convention)."""

    @staticmethod
    def forward(ctx, logits, bias, k, score, pre_softmax, G, g, gst, scale, norm, L):
        T, E = logits.shape
        weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
        indices = torch.empty((T, k), dtype=torch.int32, device=logits.device)
        dt = _EAGER_DTYPES[logits.dtype]
        L.C.router_topk_fwd(_ext.ptr(logits), _ext.ptr(bias), _ext.ptr(weights), _ext.ptr(indices), T, E, k, score,
                            pre_softmax, G, g, gst, norm, scale, dt, L.device, L.stream)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, indices)
        ctx.args, ctx.L = (score, pre_softmax, norm, scale, dt), L
        return weights, indices

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices):
        if torch.is_grad_enabled():  # create_graph: the backward kernel has no derivative of its own
            raise RuntimeError("router_topk: no second derivative (the backward kernel is not differentiable)")
        if grad_weights is None:
            return (None,) * 11
        logits, indices = ctx.saved_tensors
        score, pre_softmax, norm, scale, dt = ctx.args
        L = ctx.L
        T, E = logits.shape
        grad = torch.empty((T, E), dtype=torch.float32, device=logits.device)
        gw = grad_weights.float().contiguous()
        L.C.router_topk_bwd(_ext.ptr(gw), _ext.ptr(logits), _ext.ptr(indices), _ext.ptr(grad), T, E, indices.shape[1],
                            score, pre_softmax, norm, scale, dt, L.device, L.stream)
        return (grad.to(logits.dtype),) + (None,) * 10


def _positive_int(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= 1


def resolve_topk_options(
    k: int, num_groups: int | None, group_topk: int | None, group_score_topk: int | None,
    scaling_factor: float | None, normalize: bool | None, num_experts: int | None = None, *, score: str,
) -> tuple[int, int, int, float, bool]:
    """The public keyword defaults as the op's explicit arguments: (G, g, group_score_topk, scale, normalize).
    The default group_score_topk, max(1, k // group_topk), is capped at the group's size when `num_experts`
    is given (k past the kept groups' experts); `normalize` defaults to k > 1 for sigmoid and sqrtsoftplus,
    False for softmax."""
    if (num_groups is None) != (group_topk is None):
        raise ValueError("router_topk: `num_groups` and `group_topk` go together")
    if num_groups is not None:  # group_score_topk only counts with groups
        for name, v in (("num_groups", num_groups), ("group_topk", group_topk), ("group_score_topk", group_score_topk)):
            if v is not None and (type(v) is not int or v < 1) and not _positive_int(v):
                raise ValueError(f"router_topk: `{name}` must be a positive int, got {v!r}")
    G = 1 if num_groups is None else num_groups
    g = 1 if group_topk is None else group_topk
    gst = 1 if num_groups is None else (group_score_topk if group_score_topk is not None else max(1, k // g))
    if num_groups is not None and group_score_topk is None and num_experts and num_experts % G == 0:
        gst = min(gst, num_experts // G)
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"router_topk: `normalize` must be True, False or None, got {normalize!r}")
    if scaling_factor is not None and (isinstance(scaling_factor, bool) or not isinstance(scaling_factor, numbers.Real)
                                       or not math.isfinite(scaling_factor)):
        raise ValueError(f"router_topk: `scaling_factor` must be a finite number, got {scaling_factor!r}")
    norm = (k > 1 and score != "softmax") if normalize is None else normalize
    scale = 1.0 if scaling_factor is None else float(scaling_factor)
    return G, g, gst, scale, norm


def router_aux_scores(logits: Tensor, k: int, *, score: str = "softmax") -> tuple[Tensor, Tensor]:
    """Scores over all experts for load-balancing losses (no bias, no groups): softmax over E, or
    s / (sum_E s + 1e-20) for sigmoid/sqrtsoftplus; indices = their top-k. Returns ([T, E] fp32, [T, k] int32).
    Non-finite logits and gradients follow router_topk's rules (a -inf sqrtsoftplus logit: gradient 0)."""
    return torch.ops.moe_kernels.router_aux_scores(logits, k, score)
