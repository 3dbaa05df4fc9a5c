"""Ours against a peer before timing: the routing agreement, then the output and the gradients within
bf16 precision on the agreeing tokens. The policy and its measured slack: bench_moe_layer's docstring."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_kernels.nn import MoELayer

from .moe_layer_peers import Impl, ours_impl

BF16_RTOL = 1.6e-2  # torch.testing's bf16 rtol
ATOL_RMS = 2.0**-5  # atol as a fraction of the expected tensor's rms (bench_moe_layer's docstring)
REL_L2 = 2.0**-6  # relative L2 error bound of a compared tensor
OUTLIER_FRAC, OUTLIER_FACTOR = 1e-4, 4.0  # elements allowed beyond the elementwise tolerance, and how far
_CHUNK = 1 << 26  # elements per piece when comparing on the device
AUX_RTOL = 1e-3
MIN_AGREE_FP32, MIN_AGREE_BF16 = 0.99, 0.90  # fraction of tokens with the same top-k set
CHECK_EXPERTS = 8  # expert-weight gradients compared on this many experts (memory: deepseek-v3's are 22.5 GB)


def _grads(impl: Impl, x: Tensor, dout: Tensor, experts: Tensor, layer: MoELayer) -> dict[str, Tensor]:
    """dx, the router weight's gradient, w13's and w2's on the given experts (indices) and the shared
    experts', from out alone (no aux loss), as compact copies."""
    named = [("dx", x), ("d router weight", impl.router_weight), ("d w13", layer.experts.w13),
             ("d w2", layer.experts.w2)]
    if layer.shared_experts is not None:
        named += [(f"d shared {n}", p) for n, p in layer.shared_experts.named_parameters()]
    out, _ = impl.forward(x)
    grads = torch.autograd.grad(out, [t for _, t in named], dout, allow_unused=True)
    res = {}
    for (name, _), g in zip(named, grads):
        if g is None:
            raise AssertionError(f"{impl.name}: no gradient reaches {name}")
        res[name] = g[experts] if name in ("d w13", "d w2") else g.clone()
    return res


def _as_slices(t: Tensor) -> Tensor:
    """t viewed as [B, R, C]: C its last dim, R the one before, B the rest (for the expert-weight
    gradients [E, N, K], the expert); a vector as one row."""
    return t.reshape(1, 1, -1) if t.dim() < 2 else t.reshape(-1, t.shape[-2], t.shape[-1])


def _close(what: str, actual: Tensor, expected: Tensor) -> None:
    """Within bf16 precision (bench_moe_layer's docstring): relative L2 error <= REL_L2, and
    |a - e| <= atol + rtol*|e| (rtol = BF16_RTOL, atol = ATOL_RMS x the larger of rms(e) and the element's
    local rms) on all but OUTLIER_FRAC of the elements, none beyond OUTLIER_FACTOR x that. The local rms of
    element [b, i, j] of e viewed as [B, R, C] (_as_slices) is sqrt(ms(row i) x ms(column j) / ms(slice b)),
    the mean squares ms taken within slice b; a vector has none (atol = ATOL_RMS x rms(e)). Computed on the
    device in pieces of whole rows: no copy to the host."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = _as_slices(actual), _as_slices(expected)
    B, R, C = e.shape
    n = e.numel()
    if n == 0:
        return
    step = max(1, _CHUNK // C)
    pieces = [(b, slice(i, i + step)) for b in range(B) for i in range(0, R, step)]
    row_ms = torch.empty((B, R), dtype=torch.float32, device=e.device)
    col_sq = torch.zeros((B, C), dtype=torch.float64, device=e.device)
    for b, rows in pieces:
        sq = e[b, rows].float().square()
        row_ms[b, rows] = sq.mean(-1)
        col_sq[b] += sq.sum(0, dtype=torch.float64)
    slice_sq = col_sq.sum(-1)  # [B]
    sq_e = float(slice_sq.sum())
    col_ms = (col_sq / R).float()
    slice_ms = (slice_sq / (R * C)).float().clamp_min(torch.finfo(torch.float32).tiny)
    atol_min = max(1e-6, ATOL_RMS * math.sqrt(sq_e / n))
    sq_d, n_bad, worst = 0.0, 0, 0.0
    for b, rows in pieces:
        ai, ei = a[b, rows].float(), e[b, rows].float()
        atol = atol_min
        if expected.dim() >= 2:
            local = (row_ms[b, rows, None] * col_ms[b] / slice_ms[b]).sqrt()  # [rows, C]
            atol = (ATOL_RMS * local).clamp_min(atol_min)
        d = (ai - ei).abs()
        ratio = d / (atol + BF16_RTOL * ei.abs())
        ratio = torch.where(torch.isnan(ratio), torch.inf, ratio)  # a NaN anywhere fails
        sq_d += float(d.double().square().sum())
        n_bad += int((ratio > 1).sum())
        worst = max(worst, float(ratio.max()))
    rel = math.sqrt(sq_d / sq_e) if sq_e else (0.0 if sq_d == 0 else math.inf)
    if not (rel <= REL_L2 and n_bad <= OUTLIER_FRAC * n and worst <= OUTLIER_FACTOR):
        raise AssertionError(
            f"{what}: relative L2 error {rel:.3g} (bound {REL_L2:g}); {n_bad} of {n} elements beyond rtol "
            f"{BF16_RTOL:g}, atol >= {atol_min:.3g} (bound {OUTLIER_FRAC:g} of them); worst {worst:.3g}x that "
            f"tolerance (bound {OUTLIER_FACTOR:g}x)")


def checked_experts(counts: Tensor) -> Tensor:
    """The experts whose weight gradients are compared, by our router's counts: the CHECK_EXPERTS // 2
    busiest and the rest of CHECK_EXPERTS least loaded (empty ones, where any); all where E is no more."""
    E = counts.numel()
    order = torch.sort(counts.long().cpu(), descending=True, stable=True).indices  # ties: lower index first
    if E <= CHECK_EXPERTS:
        return order.sort().values.to(counts.device)
    hot = CHECK_EXPERTS // 2
    picked = torch.cat([order[:hot], order[E - (CHECK_EXPERTS - hot):]])
    return picked.sort().values.to(counts.device)


def check_peer(case: str, layer: MoELayer, peer: Impl, x: Tensor, dout: Tensor) -> float:
    """Raises AssertionError where the peer and ours disagree (bench_moe_layer's docstring); returns the
    fraction of tokens whose top-k expert set agrees."""
    ours = ours_impl(layer)
    T = x.shape[1]
    x2 = x.detach().reshape(-1, x.shape[-1])
    with torch.no_grad():
        routed = layer.router(x2, seq_len=T)
        ours_idx = routed.indices.long().sort(-1).values
        peer_idx = peer.route(x2).long().sort(-1).values
        agree = (ours_idx == peer_idx).all(-1)  # [T]
        frac = float(agree.float().mean())
    floor = MIN_AGREE_FP32 if peer.fp32_router else MIN_AGREE_BF16
    what = f"{case} vs {peer.name}"
    if frac < floor:
        raise AssertionError(f"{what}: routing agrees on {frac:.1%} of {T} tokens (< {floor:.0%})")
    with torch.no_grad():
        out_ours, aux_ours = ours.forward(x)
        out_peer, aux_peer = peer.forward(x)
    _close(f"{what} output on the {int(agree.sum())} agreeing tokens", out_peer[0][agree], out_ours[0][agree])
    if peer.name == "torch_native":
        torch.testing.assert_close(aux_peer, aux_ours, rtol=AUX_RTOL, atol=1e-7,
                                   msg=lambda m: f"{what} aux loss: {m}")
    del out_ours, out_peer
    masked = dout * agree.view(1, T, 1).to(dout.dtype)
    experts = checked_experts(routed.tokens_per_expert)
    g_ours = _grads(ours, x, masked, experts, layer)
    g_peer = _grads(peer, x, masked, experts, layer)
    for name, g in g_ours.items():
        _close(f"{what} {name}", g_peer[name], g)
    return frac
