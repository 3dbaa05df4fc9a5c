"""The same MoE computation written the way a capable PyTorch user would, with no custom op: routing
with softmax/sigmoid + topk + gather, dispatch with argsort + index_select, experts with
torch._grouped_mm, combine with index_add_ (this is the torch-native composition Hugging Face's
"grouped_mm" experts implementation uses). It is the peer our kernels are measured against
(`MoEConfig(backend="torch")`), not a reference: its tie-breaking and summation order are torch's."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_kernels.nn.router import RouterConfig
from moe_kernels.ops.grouped_mm import autocast_input
from moe_kernels.ops.permute import tokens_per_expert_reference


def route(logits: Tensor, cfg: RouterConfig, expert_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """weights [T, k] fp32 and indices [T, k] int64, same semantics as router_topk."""
    T, E = logits.shape
    k = cfg.k
    softmax = cfg.score == "softmax"
    if softmax:
        scores = logits.softmax(-1) if cfg.pre_softmax else logits
    else:
        scores = logits.sigmoid() if cfg.score == "sigmoid" else F.softplus(logits).sqrt()
    sel = scores + expert_bias if expert_bias is not None else scores
    if cfg.num_groups is not None and cfg.num_groups > 1:
        G, g = cfg.num_groups, cfg.group_topk
        gst = cfg.group_score_topk or max(1, k // g)
        group_scores = sel.view(T, G, E // G).topk(gst, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(g, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    indices = sel.topk(k, dim=-1).indices
    normalize = cfg.normalize if cfg.normalize is not None else (k > 1 and not softmax)
    if softmax and (normalize or not cfg.pre_softmax):
        weights = logits.gather(1, indices).softmax(-1)  # the chosen probabilities over their sum
    else:
        weights = scores.gather(1, indices)
        if normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if cfg.scaling_factor is not None:
        weights = weights * cfg.scaling_factor
    return weights.float(), indices


def aux_losses(logits: Tensor, cfg: RouterConfig, seq_len: int | None) -> Tensor:
    """The configured balancing losses, in plain torch (same formulas as the registered ops)."""
    T, E = logits.shape
    k = cfg.k
    loss = logits.new_zeros(())
    if cfg.aux_loss_coeff > 0 or cfg.seq_aux_loss_coeff > 0:
        if cfg.score == "softmax":
            scores = logits.softmax(-1)
        else:
            s = logits.sigmoid() if cfg.score == "sigmoid" else F.softplus(logits).sqrt()
            scores = s / (s.sum(-1, keepdim=True) + 1e-20)
        top = scores.topk(k, dim=-1).indices
        if cfg.aux_loss_coeff > 0:
            counts = tokens_per_expert_reference(top, E).to(scores.dtype)
            loss = loss + cfg.aux_loss_coeff * E / (k * T * T) * (scores.sum(0) * counts).sum()
        if cfg.seq_aux_loss_coeff > 0 and seq_len:
            B = T // seq_len
            counts = torch.zeros(B, E, dtype=scores.dtype, device=scores.device)
            counts.scatter_add_(1, top.view(B, -1), torch.ones_like(top.view(B, -1), dtype=scores.dtype))
            per_seq = (scores.view(B, seq_len, E).sum(1) * counts).sum(-1)
            loss = loss + cfg.seq_aux_loss_coeff * E / (k * seq_len * seq_len) * per_seq.mean()
    if cfg.z_loss_coeff > 0:
        loss = loss + cfg.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    return loss


def _grouped(x: Tensor, w_ENK: Tensor, offsets: Tensor) -> Tensor:
    """x_e @ w[e]^T per group through torch._grouped_mm (rows grouped by `offsets`, cumulative ends)."""
    return torch._grouped_mm(x, w_ENK.transpose(-2, -1), offs=offsets)


def experts(x: Tensor, weights: Tensor, indices: Tensor, w13: Tensor, w2: Tensor, *, activation: str = "swiglu"
            ) -> Tensor:
    """SwiGLU experts (squared-ReLU ones without a gate: w13 the up rows) over argsort-dispatched tokens; output
    [T, H] in x's dtype."""
    T, H = x.shape
    E, two_f, _ = w13.shape
    k = indices.shape[1]
    # torch._grouped_mm is not on autocast's lists; cast like nn.Linear would (CUDA takes bf16 only).
    x, w13, w2 = autocast_input(x), autocast_input(w13), autocast_input(w2)
    flat = indices.flatten()
    order = flat.argsort(stable=True)  # [T*k] slots sorted by expert
    tokens = order // k
    # scatter_add counts (tokens_per_expert_reference), not bincount: bincount syncs with the host on CUDA
    # to size its output, and the layer must stay capturable in a CUDA graph.
    offsets = tokens_per_expert_reference(flat, E).cumsum(0).to(torch.int32)
    h = _grouped(x.index_select(0, tokens), w13, offsets)
    act = F.silu(h[:, : two_f // 2]) * h[:, two_f // 2 :] if activation == "swiglu" else F.relu(h).square()
    y = _grouped(act, w2, offsets)
    y = y.float() * weights.flatten()[order, None]
    return torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tokens, y).to(x.dtype)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """fp32 router logits even under autocast (as the Router module computes them)."""
    off = torch.autocast(device_type=x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else nullcontext()
    with off:
        return F.linear(x.float(), weight.float())
