"""router_fused: an MoE layer's router in one kernel each way (csrc/router/router.cu, FusedParams).

The forward picks the top-k experts and their weights, counts the picks per expert, and computes every
configured balancing loss (Megatron-Core's aux loss, DeepSeek's sequence-wise aux loss, the z-loss) in one
launch; the backward folds the losses' gradients into the top-k backward, one launch. It computes what
this composition computes (router_fused_reference):

    weights, indices = router_topk(logits, k, ...)
    counts = tokens_per_expert(indices, E)
    scores, aux_indices = router_aux_scores(logits, k, score=score)      # when a balancing loss is on
    loss = aux_loss(scores, tokens_per_expert(aux_indices, E), k, aux_coeff)
         + seq_aux_loss(scores, aux_indices, seq_coeff, seq_len=seq_len)
         + z_loss(logits, z_coeff)                                        # the terms whose coefficient > 0

with fp32 sums in a fixed order (chunks of 64 rows inside each sequence, then the chunks in order), so the
result is deterministic and the same on every GPU, within fp32 rounding of the composition. The op also
returns the aux picks per expert ([E], aux loss on, else [0]) and per sequence ([B, E], sequence loss on,
else [0, E]): what the backward reads. Limits of the kernel: E <= 1024 (the router module takes the
composition past it), k <= 32, num_groups <= 32; fp32, bf16 or fp16 logits (fp64 on the CPU reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.ops._checks import FLOAT_DTYPES, check_cuda_dtype, check_int, check_tensor
from moe_kernels.ops.permute import tokens_per_expert_reference
from moe_kernels.ops.router import (
    _SCORE_CODES,
    _acc,
    _check_topk,
    router_aux_scores_bwd_reference,
    router_aux_scores_reference,
    router_topk_bwd_reference,
    router_topk_reference,
)
from moe_kernels.ops.router_losses import _seq_counts

OP = "router_fused"
_FP32_TINY = torch.finfo(torch.float32).tiny
FUSED_MAX_EXPERTS = 1024  # csrc/router/router.h kFusedMaxExperts (the extension's router_fused_max_experts)


def loss_scales(T: int, E: int, k: int, aux_coeff: float, seq_coeff: float, seq_len: int) -> tuple[float, float]:
    """(aux_scale, seq_scale) as the kernels take them: coeff * E / (k * T^2) and coeff * E / (k * S^2) / B,
    T and B counted as at least 1 (no rows: the sums are 0 and a loss stays marked on by a non-zero scale)."""
    aux = aux_coeff * E / (k * max(T, 1) ** 2) if aux_coeff > 0 else 0.0
    seq = seq_coeff * E / (k * seq_len * seq_len) / max(T // seq_len, 1) if seq_coeff > 0 else 0.0
    for name, coeff, scale in (("aux_coeff", aux_coeff, aux), ("seq_coeff", seq_coeff, seq)):
        if coeff > 0 and scale < _FP32_TINY:  # the kernels read a zero scale as "loss off"
            raise ValueError(f"{OP}: `{name}`={coeff} gives a loss scale of {scale:.3g}, below fp32's range")
    return aux, seq


def _check(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk, group_score_topk, aux_coeff,
           seq_coeff, seq_len, z_coeff) -> None:
    _check_topk(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias)
    for name, v in (("aux_coeff", aux_coeff), ("seq_coeff", seq_coeff), ("z_coeff", z_coeff)):
        if not v >= 0:
            raise ValueError(f"{OP}: `{name}` must be >= 0, got {v}")
    if seq_coeff > 0:
        check_int(OP, "seq_len", seq_len, minimum=1)
        if logits.shape[0] % seq_len:
            raise ValueError(f"{OP}: {logits.shape[0]} rows of `logits` are not whole sequences of `seq_len`={seq_len}")


def _check_bwd(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, aux_coeff, seq_coeff,
               seq_len) -> None:
    op = f"{OP}_bwd"
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    T, E = logits.shape
    check_tensor(op, "indices", indices, ndim=2, dtypes=(torch.int32,), device=logits.device)
    check_tensor(op, "grad_weights", grad_weights, ndim=2, dtypes=FLOAT_DTYPES, device=logits.device)
    check_tensor(op, "grad_loss", grad_loss, ndim=0, dtypes=(torch.float32, torch.float64), device=logits.device)
    if tuple(indices.shape) != (T, k) or tuple(grad_weights.shape) != (T, k):
        raise ValueError(f"{op}: `indices` and `grad_weights` must be [{T}, {k}], got {tuple(indices.shape)} and "
                         f"{tuple(grad_weights.shape)}")
    check_tensor(op, "aux_counts", aux_counts, ndim=1, dtypes=(torch.int32,), device=logits.device)
    check_tensor(op, "seq_counts", seq_counts, ndim=2, dtypes=(torch.int32,), device=logits.device)
    if aux_counts.shape[0] not in (0, E) or (aux_coeff > 0 and aux_counts.shape[0] != E):
        raise ValueError(f"{op}: `aux_counts` must be [{E}] with aux_coeff > 0 (else it may be empty), got "
                         f"{tuple(aux_counts.shape)}")
    if seq_coeff > 0:
        check_int(op, "seq_len", seq_len, minimum=1)
        if T % seq_len:
            raise ValueError(f"{op}: {T} rows of `logits` are not whole sequences of `seq_len`={seq_len}")
        if tuple(seq_counts.shape) != (T // seq_len, E):
            raise ValueError(f"{op}: `seq_counts` must be [{T // seq_len}, {E}], got {tuple(seq_counts.shape)}")


# ---------------------------------------------------------------------------------------------------
# References


def router_fused_reference(
    logits: Tensor, expert_bias: Tensor | None, k: int, score: str, pre_softmax: bool, num_groups: int,
    group_topk: int, group_score_topk: int, scaling_factor: float, normalize: bool, aux_coeff: float,
    seq_coeff: float, seq_len: int, z_coeff: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    T, E = logits.shape
    w, idx = router_topk_reference(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk,
                                   scaling_factor, expert_bias, normalize)
    counts = tokens_per_expert_reference(idx, E)
    x = _acc(logits)
    aux_scale, seq_scale = loss_scales(T, E, k, aux_coeff, seq_coeff, seq_len)
    aux_counts = torch.zeros((0,), dtype=torch.int32, device=logits.device)
    seq_counts = torch.zeros((0, E), dtype=torch.int32, device=logits.device)
    loss = None
    if aux_coeff > 0 or seq_coeff > 0:
        scores, aux_idx = router_aux_scores_reference(logits, k, score)
        if aux_coeff > 0:
            aux_counts = tokens_per_expert_reference(aux_idx, E)
            loss = (scores.sum(0) * aux_counts.to(x.dtype)).sum() * aux_scale
        if seq_coeff > 0:
            B = T // seq_len
            seq_counts = _seq_counts(aux_idx, B, seq_len, E)
            term = (scores.view(B, seq_len, E).sum(1) * seq_counts.to(x.dtype)).sum() * seq_scale
            loss = term if loss is None else loss + term
    if z_coeff > 0:
        lse = torch.logsumexp(x, dim=-1)
        term = z_coeff * (lse.square().sum() / T) if T else x.new_zeros(())
        loss = term if loss is None else loss + term
    if loss is None:
        loss = x.new_zeros(())
    return w, idx, counts, aux_counts, seq_counts, loss


def router_fused_bwd_reference(
    grad_weights: Tensor, grad_loss: Tensor, logits: Tensor, indices: Tensor, aux_counts: Tensor,
    seq_counts: Tensor, k: int, score: str, pre_softmax: bool, normalize: bool, scaling_factor: float,
    aux_coeff: float, seq_coeff: float, seq_len: int, z_coeff: float,
) -> Tensor:
    T, E = logits.shape
    x = _acc(logits)
    grad = router_topk_bwd_reference(grad_weights, logits, indices, score, pre_softmax, normalize, scaling_factor)
    aux_scale, seq_scale = loss_scales(T, E, k, aux_coeff, seq_coeff, seq_len)
    gl = grad_loss.to(x.dtype)
    if aux_coeff > 0 or seq_coeff > 0:
        G = torch.zeros_like(x)
        if aux_coeff > 0:
            G = G + gl * aux_scale * aux_counts.to(x.dtype)[None, :]
        if seq_coeff > 0:
            rows = torch.arange(T, device=x.device) // seq_len
            G = G + gl * seq_scale * seq_counts.to(x.dtype)[rows]
        grad = grad + router_aux_scores_bwd_reference(G, logits, score)
    if z_coeff > 0 and T:
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        grad = grad + gl * z_coeff * 2.0 / T * lse * torch.softmax(x, dim=-1)
    return grad


# ---------------------------------------------------------------------------------------------------
# Registered ops


@torch.library.custom_op("moe_kernels::router_fused", mutates_args=())
def _router_fused(
    logits: Tensor, expert_bias: Tensor | None, k: int, score: str, pre_softmax: bool, num_groups: int,
    group_topk: int, group_score_topk: int, scaling_factor: float, normalize: bool, aux_coeff: float,
    seq_coeff: float, seq_len: int, z_coeff: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk, group_score_topk, aux_coeff,
           seq_coeff, seq_len, z_coeff)
    return router_fused_reference(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk,
                                  group_score_topk, scaling_factor, normalize, aux_coeff, seq_coeff, seq_len, z_coeff)


@torch.library.custom_op("moe_kernels::router_fused_bwd", mutates_args=())
def _router_fused_bwd(
    grad_weights: Tensor, grad_loss: Tensor, logits: Tensor, indices: Tensor, aux_counts: Tensor,
    seq_counts: Tensor, k: int, score: str, pre_softmax: bool, normalize: bool, scaling_factor: float,
    aux_coeff: float, seq_coeff: float, seq_len: int, z_coeff: float,
) -> Tensor:
    _check_bwd(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, aux_coeff, seq_coeff, seq_len)
    return router_fused_bwd_reference(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, score,
                                      pre_softmax, normalize, scaling_factor, aux_coeff, seq_coeff, seq_len, z_coeff)


def _out_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@_router_fused.register_fake
def _(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk, group_score_topk, scaling_factor,
      normalize, aux_coeff, seq_coeff, seq_len, z_coeff):
    _check(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk, group_score_topk, aux_coeff,
           seq_coeff, seq_len, z_coeff)
    T, E = logits.shape
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty((T, k), dtype=_out_dtype(logits)), logits.new_empty((T, k), **i32),
            logits.new_empty((E,), **i32), logits.new_empty((E if aux_coeff > 0 else 0,), **i32),
            logits.new_empty((T // seq_len if seq_coeff > 0 else 0, E), **i32),
            logits.new_empty((), dtype=_out_dtype(logits)))


@_router_fused_bwd.register_fake
def _(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, score, pre_softmax, normalize,
      scaling_factor, aux_coeff, seq_coeff, seq_len, z_coeff):
    _check_bwd(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, aux_coeff, seq_coeff, seq_len)
    return logits.new_empty(logits.shape, dtype=_out_dtype(logits))


def _setup(ctx, inputs, output):
    (logits, _, k, score, pre_softmax, _, _, _, scaling_factor, normalize, aux_coeff, seq_coeff, seq_len,
     z_coeff) = inputs
    _, indices, counts, aux_counts, seq_counts, _ = output
    ctx.mark_non_differentiable(indices, counts, aux_counts, seq_counts)
    ctx.save_for_backward(logits, indices, aux_counts, seq_counts)
    ctx.args = (k, score, pre_softmax, normalize, scaling_factor, aux_coeff, seq_coeff, seq_len, z_coeff)


def _backward(ctx, grad_weights, _gi, _gc, _ga, _gs, grad_loss):
    logits, indices, aux_counts, seq_counts = ctx.saved_tensors
    acc = _out_dtype(logits)
    if grad_weights is None:
        grad_weights = logits.new_zeros(indices.shape, dtype=acc)
    if grad_loss is None:
        grad_loss = logits.new_zeros((), dtype=acc)
    g = torch.ops.moe_kernels.router_fused_bwd(grad_weights.contiguous(), grad_loss.contiguous(), logits, indices,
                                               aux_counts, seq_counts, *ctx.args)
    return (g.to(logits.dtype),) + (None,) * 13


_router_fused.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------------
# CUDA: the kernels (also what the MoE layer's fused router region calls, moe_kernels.nn.fused)


def kernel_fits(C, E: int, k: int, num_groups: int) -> bool:
    return E <= C.router_fused_max_experts and k <= C.router_max_k and num_groups <= C.router_max_groups


_needs: dict[tuple, int] = {}


def launch_fwd(C, device: int, stream: int, logits: Tensor, expert_bias: Tensor | None, k: int, score: int,
               pre_softmax: bool, num_groups: int, group_topk: int, group_score_topk: int, scaling_factor: float,
               normalize: bool, aux_coeff: float, seq_coeff: float, seq_len: int, z_coeff: float):
    """Allocates the outputs and launches the forward; score is the kernels' code. No argument checks."""
    T, E = logits.shape
    dev = logits.device
    f32, i32 = torch.float32, torch.int32
    weights = torch.empty((T, k), dtype=f32, device=dev)
    indices = torch.empty((T, k), dtype=i32, device=dev)
    counts = torch.empty((E,), dtype=i32, device=dev)
    aux_counts = torch.empty((E if aux_coeff > 0 else 0,), dtype=i32, device=dev)
    seq_counts = torch.empty((T // seq_len if seq_coeff > 0 else 0, E), dtype=i32, device=dev)
    loss = torch.empty((), dtype=f32, device=dev)
    aux_scale, seq_scale = loss_scales(T, E, k, aux_coeff, seq_coeff, seq_len)
    key = (device, T, E, aux_coeff > 0 or seq_coeff > 0, seq_len if seq_coeff > 0 else 0, z_coeff > 0)
    nbytes = _needs.get(key, 0)
    counter = _ext.counter(logits, device, stream)
    p_bias = 0 if expert_bias is None else expert_bias.data_ptr()
    while True:
        ws, p_ws = _ext.workspace(nbytes, logits)
        need = C.router_fused_fwd(
            _ext.ptr(logits), p_bias, _ext.ptr(weights), _ext.ptr(indices), counts.data_ptr(), _ext.ptr(aux_counts),
            _ext.ptr(seq_counts), loss.data_ptr(), p_ws, nbytes, counter, T, E, k, score, pre_softmax, num_groups,
            group_topk, group_score_topk, normalize, scaling_factor, aux_scale, seq_len, seq_scale, z_coeff,
            _ext.dtype_code(logits.dtype), device, stream)
        if not need:
            return weights, indices, counts, aux_counts, seq_counts, loss
        _needs[key] = nbytes = max(need, nbytes)


def launch_bwd(C, device: int, stream: int, grad_weights: Tensor, grad_loss: Tensor | None, logits: Tensor,
               indices: Tensor, aux_counts: Tensor, seq_counts: Tensor, k: int, score: int, pre_softmax: bool,
               normalize: bool, scaling_factor: float, aux_coeff: float, seq_coeff: float, seq_len: int,
               z_coeff: float) -> Tensor:
    """grad_weights fp32 contiguous, grad_loss a device scalar or None. No argument checks."""
    T, E = logits.shape
    grad = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    aux_scale, seq_scale = loss_scales(T, E, k, aux_coeff, seq_coeff, seq_len)
    C.router_fused_bwd(_ext.ptr(grad_weights), 0 if grad_loss is None else grad_loss.data_ptr(), _ext.ptr(logits),
                       _ext.ptr(indices), _ext.ptr(aux_counts), _ext.ptr(seq_counts), _ext.ptr(grad), T, E, k, score,
                       pre_softmax, normalize, scaling_factor, aux_scale, seq_len, seq_scale, z_coeff,
                       _ext.dtype_code(logits.dtype), device, stream)
    return grad


@_ext.cuda_impl(_router_fused)
def _router_fused_cuda(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk, group_score_topk,
                       scaling_factor, normalize, aux_coeff, seq_coeff, seq_len, z_coeff):
    _check(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk, group_score_topk, aux_coeff,
           seq_coeff, seq_len, z_coeff)
    check_cuda_dtype(OP, "logits", logits)
    C = _ext.kernels(OP, logits)
    if C is not None and not kernel_fits(C, logits.shape[1], k, num_groups):
        raise ValueError(f"{OP}: the CUDA kernel takes at most {C.router_fused_max_experts} experts (`logits` "
                         f"columns), `k` <= {C.router_max_k} and `num_groups` <= {C.router_max_groups}; got "
                         f"{logits.shape[1]}, {k}, {num_groups}")
    if C is None:
        return router_fused_reference(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk,
                                      group_score_topk, scaling_factor, normalize, aux_coeff, seq_coeff, seq_len,
                                      z_coeff)
    la = _ext.launch_args(logits)
    bias = None if expert_bias is None else expert_bias.float().contiguous()
    return launch_fwd(C, la["device"], la["stream"], logits, bias, k, _SCORE_CODES[score], pre_softmax, num_groups,
                      group_topk, group_score_topk, float(scaling_factor), normalize, aux_coeff, seq_coeff, seq_len,
                      z_coeff)


@_ext.cuda_impl(_router_fused_bwd)
def _router_fused_bwd_cuda(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, score, pre_softmax,
                           normalize, scaling_factor, aux_coeff, seq_coeff, seq_len, z_coeff):
    _check_bwd(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, aux_coeff, seq_coeff, seq_len)
    check_cuda_dtype(f"{OP} backward", "logits", logits)
    C = _ext.kernels(OP, logits)
    if C is None or _ext.checks_enabled():
        bad = (indices < 0) | (indices >= logits.shape[1])
        if bool(bad.any()):
            raise ValueError(f"{OP}_bwd: `indices` holds {indices[bad][0].item()}, outside [0, {logits.shape[1]})")
    if C is None:
        return router_fused_bwd_reference(grad_weights, grad_loss, logits, indices, aux_counts, seq_counts, k, score,
                                          pre_softmax, normalize, scaling_factor, aux_coeff, seq_coeff, seq_len,
                                          z_coeff)
    la = _ext.launch_args(logits)
    gw = grad_weights.float().contiguous()
    gl = grad_loss.float().contiguous()
    return launch_bwd(C, la["device"], la["stream"], gw, gl, logits, indices, aux_counts, seq_counts, k,
                      _SCORE_CODES[score], pre_softmax, normalize, float(scaling_factor), aux_coeff, seq_coeff,
                      seq_len, z_coeff)


def router_fused(
    logits: Tensor, k: int, *, score: str = "softmax", pre_softmax: bool = False, num_groups: int = 1,
    group_topk: int = 1, group_score_topk: int = 1, scaling_factor: float = 1.0, expert_bias: Tensor | None = None,
    normalize: bool | None = None, aux_coeff: float = 0.0, seq_coeff: float = 0.0, seq_len: int = 1,
    z_coeff: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights [T, k] fp32, indices [T, k] int32, counts [E] int32, aux_counts, seq_counts, loss []): the
    module docstring's composition in one kernel each way. Options as router_topk's, resolved (num_groups 1 =
    no group limit; `normalize` None: router_topk's default); gradients flow from weights and loss to logits."""
    if normalize is None:
        normalize = k > 1 and score != "softmax"
    return torch.ops.moe_kernels.router_fused(logits, expert_bias, k, score, pre_softmax, num_groups, group_topk,
                                              group_score_topk, float(scaling_factor), bool(normalize),
                                              float(aux_coeff), float(seq_coeff), int(seq_len), float(z_coeff))
