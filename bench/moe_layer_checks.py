"""Ours against a peer before timing: the routing (every token either routed alike or a near-tie of the
router logits), then the output and the gradients on the agreeing tokens, ours' and the peer's both
against the layer computed in fp64. The policy: bench_moe_layer's docstring; the error model behind each
bound: below (no bound here is a measurement; the per-element one is statistical, as stated)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from moe_kernels.nn import MoELayer, torch_native
from moe_kernels.testing import FP32_EPS, U_BF16

from .moe_layer_peers import Impl, ours_impl

# Error model. Each implementation computes the layer in bf16 with fp32 accumulation; its error against the
# exact (fp64) layer is the sum of its roundings to bf16 (unit roundoff u = 2^-8: a rounding moves a value by
# at most u of itself, u/sqrt(3) in RMS), the fp32 accumulation adding ~2^-24 of the magnitudes, 2^-16 of
# that, on any CPU or GPU. Counting the roundings on the way to a compared tensor: the forward's x @ w13, the
# activation, @ w2, the weighted combine and the output (and in the Hugging Face blocks the router weight,
# its logits, the routing weights and the k-way sum in bf16); the backward the same again and the gradient's
# own output: n <= 16, each reaching the compared tensor with a gain <= 2 (SwiGLU's derivative, the routing
# weights' normalisation). Independent roundings add in RMS: relative L2 error <= sqrt(16) x 2 x u / sqrt(3)
# = 4.6u. Per element, against the slice's largest magnitude: 16 roundings of gain <= 2 reach 32u only if
# all take their worst case with one sign at that magnitude; 16u (3.5x the RMS model) is a statistical bound,
# and only the few elements near the largest magnitude can approach it. Each compared slice is an expert's
# weight gradient or a whole tensor.
REL_L2 = 8 * U_BF16  # any implementation's ||a - exact|| / ||exact|| per slice: 1.7x the model's RMS
MAX_REL = 16 * U_BF16  # any element's |a - exact| / max|exact| per slice
# Ours additionally: the flash-attention rule (moe_kernels.testing's policy for low precision against fp64)
# against the peer's error, in the L2 norm (a norm averages the elements' rounding noise; the max of one
# draw would not be stable): ||ours - exact|| <= 2 ||peer - exact|| + 2^-8 ||exact||.
FLASH_FACTOR, FLASH_FLOOR = 2.0, U_BF16
# Router logits: fp32 ones lie within 64 eps_fp32 x sum_h |x_h W_eh| of the exact ones (moe_kernels.testing's
# fp32 rounding); the bf16 ones of the Qwen3-MoE and Mixtral blocks (weight rounded to bf16, bf16 output)
# within 2^-9 (the weight's rounding) + 2^-9 (the output's) of that sum more.
ROUTER_FP32 = 64 * FP32_EPS
ROUTER_BF16 = ROUTER_FP32 + 2 * 2.0**-9
AUX_RTOL = 1e-3
AUX_PEERS = ("torch_native", "liger")  # peers computing the aux loss (torch_native.aux_losses); HF blocks do not
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


# ---------------------------------------------------------------------------------------------------
# The exact layer


def routing_weights(logits: Tensor, indices: Tensor, cfg) -> Tensor:
    """The routing weights [T, k] of the given selection, in the logits' precision (torch_native.route's
    formulas, the selection given rather than made)."""
    if cfg.score == "softmax":
        over_all = cfg.pre_softmax and not cfg.normalize
        w = logits.softmax(-1).gather(1, indices) if over_all else logits.gather(1, indices).softmax(-1)
    else:
        s = logits.sigmoid() if cfg.score == "sigmoid" else F.softplus(logits).sqrt()
        w = s.gather(1, indices)
        if cfg.normalize if cfg.normalize is not None else cfg.k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.scaling_factor if cfg.scaling_factor is not None else w


def _weighted_expert64(x: Tensor, w13: Tensor, w2: Tensor, weight: Tensor) -> Tensor:
    """One expert's SwiGLU MLP in fp64 times each row's routing weight (checkpointed by the caller: only
    the inputs are kept, not the fp64 [rows, H] products)."""
    h = x @ w13.double().T
    f = h.shape[1] // 2
    return (F.silu(h[:, :f]) * h[:, f:]) @ w2.double().T * weight[:, None]


def reference64(layer: MoELayer, x: Tensor, dout: Tensor, indices: Tensor,
                experts: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The layer in fp64 on the same weights and inputs, with the expert selection `indices` [T, k] given:
    (out [T, H], the gradients _grads names, for dout). One expert at a time, its weights upcast inside a
    checkpoint (no fp64 copy of all the experts is ever held); fp64 leaves only for the checked experts."""
    cfg = layer.config
    if cfg.recipe is not None or cfg.router.capacity_factor is not None:
        raise ValueError("reference64: no low-precision recipe or capacity (the bench runs neither)")
    T, H = x.shape[-2], x.shape[-1]
    x64 = x.detach().reshape(T, H).double().requires_grad_()
    wr = layer.router.weight.detach().double().requires_grad_()
    indices = indices.long()
    weights = routing_weights(x64 @ wr.T, indices, cfg.router)
    w13, w2 = layer.experts.w13.detach(), layer.experts.w2.detach()
    w13_c = w13[experts].double().requires_grad_()
    w2_c = w2[experts].double().requires_grad_()
    checked = {int(e): i for i, e in enumerate(experts.tolist())}
    out = x64.new_zeros(T, H)
    for e in range(cfg.num_experts):
        tok, slot = (indices == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        a, b = (w13_c[checked[e]], w2_c[checked[e]]) if e in checked else (w13[e], w2[e])
        out = out.index_add(0, tok, checkpoint(_weighted_expert64, x64[tok], a, b, weights[tok, slot],
                                                use_reentrant=False))
    named = [("dx", x64), ("d router weight", wr), ("d w13", w13_c), ("d w2", w2_c)]
    if layer.shared_experts is not None:
        shared = copy.deepcopy(layer.shared_experts).double()
        out = out + shared(x64)
        named += [(f"d shared {n}", p) for n, p in shared.named_parameters()]
    grads = torch.autograd.grad(out, [t for _, t in named], dout.reshape(T, H).double())
    return out.detach(), {name: g for (name, _), g in zip(named, grads)}


# ---------------------------------------------------------------------------------------------------
# Routing: near-ties only


def _sorted_selection(indices: Tensor) -> Tensor:
    return indices.long().sort(-1).values


def reachable(logits64: Tensor, radius: Tensor, selection: Tensor, cfg, bias: Tensor | None) -> Tensor:
    """[T] bool: the sorted selection [T, k] is what the router picks for some logits within `radius`
    [T, E] of logits64 (each logit moved by at most its radius). Tried: the selected experts' logits up by
    their radius and all others down (what favours the selection most under top-k of monotone scores); with
    groups also leaving the other experts of the selected groups where they are (their group scores)."""
    T, E = logits64.shape
    chosen = torch.zeros(T, E, dtype=torch.bool, device=logits64.device).scatter_(1, selection, True)
    tries = [torch.where(chosen, radius, -radius)]
    if cfg.num_groups is not None and cfg.num_groups > 1:
        held = chosen.view(T, cfg.num_groups, -1).any(-1, keepdim=True).expand(-1, -1, E // cfg.num_groups)
        tries.append(torch.where(chosen, radius, torch.where(held.reshape(T, E), 0.0, -radius)))
    ok = torch.zeros(T, dtype=torch.bool, device=logits64.device)
    b64 = None if bias is None else bias.double()
    for shift in tries:
        ok |= (_sorted_selection(torch_native.route(logits64 + shift, cfg, b64)[1]) == selection).all(-1)
    return ok


def _check_routing(what: str, layer: MoELayer, x2: Tensor, ours: Tensor, peer: Tensor, peer_bf16: bool) -> None:
    """Every token that ours or the peer routes otherwise than the exact (fp64) logits do is a near-tie:
    its selection is reachable within that router's rounding of the logits (ROUTER_FP32 / ROUTER_BF16)."""
    cfg, w = layer.config.router, layer.router.weight.detach()
    with torch.no_grad():
        logits64 = x2.double() @ w.double().T
        magnitude = x2.double().abs() @ w.double().abs().T  # sum_h |x_h W_eh| [T, E]
        exact = _sorted_selection(torch_native.route(logits64, cfg, layer.router.expert_bias)[1])
        peer_rel = ROUTER_BF16 if peer_bf16 else ROUTER_FP32
        for name, sel, rel in (("ours", ours, ROUTER_FP32), ("the peer", peer, peer_rel)):
            off = ~(sel == exact).all(-1)
            if bool(off.any()):
                off &= ~reachable(logits64, rel * magnitude, sel, cfg, layer.router.expert_bias)
            if bool(off.any()):
                t = int(torch.nonzero(off)[0])
                raise AssertionError(
                    f"{what}: {name} routes {int(off.sum())} of {x2.shape[0]} tokens to experts no rounding of "
                    f"its router logits (relative {rel:.2g}) explains; token {t}: {sel[t].tolist()}, exact "
                    f"{exact[t].tolist()}")


# ---------------------------------------------------------------------------------------------------
# Outputs and gradients


def _compare(what: str, ours: Tensor, peer: Tensor, ref: Tensor, *, per_expert: bool = False,
             peer_name: str = "peer") -> None:
    """Ours and the peer against the fp64 `ref` (module constants): each within REL_L2 (relative L2) and
    MAX_REL (any element, of max|ref|), and ours within the flash-attention rule of the peer's error. Per
    slice: each expert's gradient on its own where per_expert (the leading dim), else the whole tensor."""
    assert ours.shape == peer.shape == ref.shape, f"{what}: shapes {ours.shape}, {peer.shape}, {ref.shape}"
    if ref.numel() == 0:
        return
    o, p, r = (t.detach().reshape(ref.shape if per_expert else (1, -1)) for t in (ours, peer, ref))
    for i in range(r.shape[0]):
        ri = r[i].double()
        where = f"{what} (expert slice {i})" if per_expert else what
        n_ref, max_ref = float(ri.norm()), float(ri.abs().max())
        errs = {}
        for name, a in (("ours", o[i]), (peer_name, p[i])):
            d = a.double() - ri
            err, worst = float(d.norm()), float(d.abs().max())
            errs[name] = err
            if not (err <= REL_L2 * n_ref and worst <= MAX_REL * max_ref):
                raise AssertionError(
                    f"{where}: {name}: relative L2 error {err / max(n_ref, 1e-300):.3g} (bound {REL_L2:g}), "
                    f"worst element {worst / max(max_ref, 1e-300):.3g} of max|ref| (bound {MAX_REL:g}); "
                    f"|ref|: L2 {n_ref:.3g}, max {max_ref:.3g}")
        bound = FLASH_FACTOR * errs[peer_name] + FLASH_FLOOR * n_ref
        if not errs["ours"] <= bound:
            raise AssertionError(
                f"{where}: ours' L2 error {errs['ours']:.3g} > {FLASH_FACTOR:g} x {peer_name}'s "
                f"{errs[peer_name]:.3g} + {FLASH_FLOOR:g} x ||ref|| {n_ref:.3g}")


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
        ours_idx = _sorted_selection(routed.indices)
        peer_idx = _sorted_selection(peer.route(x2))
        agree = (ours_idx == peer_idx).all(-1)  # [T]
        frac = float(agree.float().mean())
    what = f"{case} vs {peer.name}"
    _check_routing(what, layer, x2, ours_idx, peer_idx, not peer.fp32_router)
    if not bool(agree.any()):
        raise AssertionError(f"{what}: no token routed alike")
    masked = dout * agree.view(1, T, 1).to(dout.dtype)
    experts = checked_experts(routed.tokens_per_expert)
    out64, g64 = reference64(layer, x, masked, routed.indices, experts)
    with torch.no_grad():
        out_ours, aux_ours = ours.forward(x)
        out_peer, aux_peer = peer.forward(x)
    _compare(f"{what} output on the {int(agree.sum())} agreeing tokens", out_ours[0][agree], out_peer[0][agree],
             out64[agree], peer_name=peer.name)
    if peer.name in AUX_PEERS:
        torch.testing.assert_close(aux_peer, aux_ours, rtol=AUX_RTOL, atol=1e-7,
                                   msg=lambda m: f"{what} aux loss: {m}")
    del out_ours, out_peer, out64
    g_ours = _grads(ours, x, masked, experts, layer)
    g_peer = _grads(peer, x, masked, experts, layer)
    for name, g in g_ours.items():
        _compare(f"{what} {name}", g, g_peer[name], g64[name].reshape(g.shape),
                 per_expert=name in ("d w13", "d w2"), peer_name=peer.name)
    return frac
