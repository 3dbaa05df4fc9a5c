"""The experts' forwards on moe_kernels' ops: transformers' experts interface (`moe_kernels_experts_forward`), experts
stored [E, K, N] (GPT-OSS's, Aria's) and Llama 4's block.

- GPT-OSS (`GptOssMLP`, its router is `router`): biased logits, top-k by logit, softmax over the k, cast to the
  logits' dtype. Its experts add a bias to both projections and use a clamped SwiGLU variant on interleaved
  gate/up columns, stored transposed ([E, H, 2F], [E, F, H]): they run permute -> the biased [E, K, N] grouped
  GEMM (`_GroupedMmKN`: grouped_mm's dgrad product forward, its forward and wgrad products backward, so no
  transposed copy of the weights; the bias gradient a wgrad product with a column of ones, deterministic) ->
  the experts' own `_apply_gate` -> the same for down_proj -> unpermute; expert-parallel, the dispatcher's
  dispatch and combine in place of permute and unpermute. peft LoRA terms as rank-r [E, K, N] products (`_kn_mm`).
  A precision recipe: its [E, K, N] GEMMs (`recipe.grouped_mm_kn`; FP8 zero-pads GPT-OSS's H = F = 2880 to 2944
  along each contraction), each bias added into the GEMM's output in place (`_GroupBias`, its gradient the
  same deterministic group sums); while torch.onnx exports, the experts run transformers' forward (on one rank
  only).
- Aria (`AriaTextMoELayer`, its router is `router`): bias-free experts stored [E, H, 2F] (gate then up columns)
  and [E, F, H], SiLU: the same [E, K, N] path, with our fused swiglu; a precision recipe's GEMMs on the stored
  layout (`recipe.grouped_mm_kn`), the rows padded to its alignment.
- Llama 4 (`Llama4TextMoe`): transformers runs every expert on every token (the inputs of the experts not chosen
  zeroed by their score, sigmoid(-inf) = 0), E / k times the routed experts' FLOPs (16x for Scout, 128x for
  Maverick). Its block forward is replaced (`_llama4_block_forward`): transformers' router as it is, each token's
  copy scaled by its score before the experts, permute, the [E, K, N] grouped GEMMs around SiLU gate * up,
  unpermute, the block's own shared expert; expert-parallel, each token dispatched once and scaled by its score
  on the experts' rank; peft adapters on the experts through peft's wrappers (LoRA terms as rank-r products); a
  precision recipe as Aria's; while torch.onnx exports, transformers' block forward (on one rank only).
- DBRX (`DbrxFFN`, its router is `router`): transformers' router and routing, our experts (`_dbrx_experts_forward`):
  w1, v1 and w2 stored [E * F, H] each, viewed [E, F, H]: the gate and up products [E, N, K], the down product
  [E, K, N]; the experts' own activation.
- Ergo (`ErgoMoE`): experts without a gate stored [E, K, N] and an RMSNorm per expert after them
  (`_ergo_experts_forward`: the norm on the permuted rows, before the routing weights).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_kernels import onnx as _onnx
from moe_kernels.nn import fused
from moe_kernels.nn.lora import check_expert_parallel_weights, grouped_mm_lora, lora_terms
from moe_kernels.ops.activation import squared_relu, swiglu
from moe_kernels.ops.grouped_mm import autocast_input, grouped_mm
from moe_kernels.ops.permute import permute, unpermute

from .common import (
    _RECIPE_ATTR,
    _SHARDED,
    DISPATCHER_ATTR,
    _base_class,
    _experts_of,
    _is_dbrx_glu,
    _is_dtensor,
    _up_name,
)


def _grouped_weight(w: Tensor) -> Tensor:
    """grouped_mm needs contiguous [E, N, K]. transformers' parameters are contiguous, so this returns them as
    they are. A non-contiguous one (a strided view from some conversion or sharding) costs one copy of the
    whole expert weight per call (autograd routes its gradient back to the original); never kept."""
    return w if w.is_contiguous() else w.contiguous()


def moe_kernels_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers experts-interface forward on moe_kernels ops.

    hidden_states [T, H]; top_k_index [T, k] (int32 from our router, int64 from transformers' own);
    top_k_weights [T, k]. Returns [T, H] in hidden_states' dtype.
    """
    up = _up_name(self)  # gate_up_proj [E, 2F, H], or up_proj [E, F, H] for experts without a gate
    if any(_is_dtensor(t) for t in (getattr(self, up), self.down_proj, hidden_states)):
        raise NotImplementedError(f"moe_kernels experts: {type(self).__name__} {_SHARDED}")
    if _is_kn_layout(self):
        return _kn_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    norm = _post_expert_norm(self)  # applied to each expert output before its routing weight (Muse Spark's)
    if (
        getattr(self, "has_bias", False)
        or getattr(self, "is_transposed", False)
        or not getattr(self, "is_concatenated", True)
        or (getattr(self, "has_post_expert_norm", False) and norm is None)
    ):
        raise NotImplementedError(
            f"moe_kernels experts: {type(self).__name__} has biases or interleaved gate/up columns on [E, N, K] "
            "weights, or a post-expert norm without a post_expert_norm module; bias-free [E, 2F, H] gate_up_proj (or "
            "[E, F, H] up_proj without a gate) + [E, H, F] down_proj experts run here, with or without a post-expert "
            "norm, and experts stored [E, K, N] (transformers' is_transposed), gated or not, with or without biases"
        )
    E = self.num_experts
    w13 = _grouped_weight(getattr(self, up))  # [E, 2F, H]: N = 2F, K = H (up_proj [E, F, H]: N = F)
    w2 = _grouped_weight(self.down_proj)  # [E, H, F]: N = H, K = F
    x = hidden_states.to(w13.dtype).contiguous()  # a no-op unless autocast handed us another dtype
    idx = top_k_index.to(torch.int32)
    if getattr(self, "_is_expert_parallel", False):
        idx = torch.where(idx < E, idx, -1)  # EP sentinels (>= E, weight 0) become dropped slots
    recipe = self.__dict__.get(_RECIPE_ATTR)  # patch_hf(model, recipe=...): low-precision expert GEMMs
    mm = grouped_mm if recipe is None else recipe.grouped_mm
    lora13, lora2 = lora_terms(self, up), lora_terms(self, "down_proj")  # peft adapters, fused
    _check_lora_experts(self, w13.shape[0], lora13, lora2)  # (an expert-parallel rank's slices: the peft wrapper's)
    align = 1 if recipe is None else recipe.align
    # FP8: our SwiGLU or squared ReLU writes the second GEMM's E4M3 input, and backward the first GEMM's output
    # gradient, as MoELayer's recipe path does (bit for bit the composition); not with adapters or a norm, which
    # read the bf16 activation or output.
    fused_act = _fp8_fused_activation(self, recipe) if not (lora13 or lora2 or norm is not None) else None
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:  # moe_kernels.parallel.apply_expert_parallel: this rank holds E / P experts
        check_expert_parallel_weights(self)
        d = dispatcher.dispatch(x, top_k_weights.float(), idx.contiguous(), align=align)
        if fused_act is not None:
            y = _fp8_activation_gemms(recipe, fused_act, recipe.grouped_mm(
                d.x, w13, d.group_sizes, swiglu_next=fused_act == "swiglu",
                squared_relu_next=fused_act == "squared_relu"), w2, d.group_sizes)
            return dispatcher.combine(y, d.handle).to(hidden_states.dtype)
        region = _fused_region(self) if recipe is None and not lora13 and not lora2 and norm is None else None
        if region is not None:
            launch = fused.launch_for(d.x)
            if launch is not None and _moe_region_fits(launch, d.x, w13, w2, w13.shape[0], permutes=False):
                # MoELayer's `experts` region on the dispatched rows: one extension call each way, the activation
                # written again in the backward rather than kept.
                y = (fused.run("experts", launch, d.x, d.group_sizes, w13, w2, None) if region == "moe"
                     else fused.run("experts_squared_relu", launch, d.x, d.group_sizes, w13, w2))
                return dispatcher.combine(y, d.handle).to(hidden_states.dtype)
        h = grouped_mm_lora(d.x, w13, d.group_sizes, lora13, mm=mm)
        act = _activation(self, h)
        y = grouped_mm_lora(act.contiguous(), w2, d.group_sizes, lora2, mm=mm)
        if norm is not None:
            y = _normed(norm, y, d.group_sizes)
        return dispatcher.combine(y, d.handle).to(hidden_states.dtype)
    region = _fused_region(self) if recipe is None and not lora13 and not lora2 and norm is None else None
    if region is not None:
        launch = fused.launch_for(x)
        if launch is not None and _moe_region_fits(launch, x, w13, w2, E):
            # The whole routed-experts computation as MoELayer's fused region: one extension call each way
            # (permute, grouped_mm, swiglu or squared_relu, grouped_mm, unpermute with the routing weights, the
            # Hugging Face order).
            out = fused.run(region, launch, x, idx.contiguous(), top_k_weights.float().contiguous(), w13, w2, E, 1)
            return out.to(hidden_states.dtype)
    if getattr(recipe, "fused_permute", False) and not lora13:  # FP8: permute fused with the quantization
        h, row_map, group_sizes = recipe.permute_grouped_mm(
            x, idx.contiguous(), E, recipe.align, w13, swiglu_next=fused_act == "swiglu",
            squared_relu_next=fused_act == "squared_relu",
        )
    else:
        x_perm, row_map, group_sizes = permute(x, idx.contiguous(), E, align=align)
        if fused_act is not None:  # (no adapters): h's gradient comes back in E4M3 from the fused activation
            h = recipe.grouped_mm(x_perm, w13, group_sizes, swiglu_next=fused_act == "swiglu",
                                  squared_relu_next=fused_act == "squared_relu")
        else:
            h = grouped_mm_lora(x_perm, w13, group_sizes, lora13, mm=mm)  # [R, 2F]
    if fused_act is not None:
        y = _fp8_activation_gemms(recipe, fused_act, h, w2, group_sizes, unpermute_next=True)
        return recipe.unpermute(y, row_map, top_k_weights.float().contiguous()).to(hidden_states.dtype)
    act = _activation(self, h)  # act_fn(gate) * up; act_fn(up) without a gate
    y = grouped_mm_lora(act.contiguous(), w2, group_sizes, lora2, mm=mm)  # [R, H]
    if norm is not None:
        y = _normed(norm, y, group_sizes)
    out = unpermute(y, row_map, top_k_weights.float().contiguous())
    return out.to(hidden_states.dtype)


def _post_expert_norm(experts: nn.Module) -> nn.Module | None:
    """The experts' post-expert norm module (transformers' has_post_expert_norm), or None."""
    if not getattr(experts, "has_post_expert_norm", False):
        return None
    norm = getattr(experts, "post_expert_norm", None)
    return norm if isinstance(norm, nn.Module) else None


def _normed(norm: nn.Module, y: Tensor, group_sizes: Tensor) -> Tensor:
    """norm(y) over the permuted expert outputs, the rows past the groups zeroed first: they are unspecified (grouped
    GEMM's, possibly NaN), and though nothing reads their output, their terms would reach the norm's weight gradient
    (0 x NaN). Padding rows inside the groups are zeros already. No host sync."""
    valid = torch.arange(y.shape[0], device=y.device) < group_sizes.sum()
    return norm(torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)))


def _check_lora_experts(experts: nn.Module, local: int, *term_lists) -> None:
    """The LoRA terms handed to experts holding `local` experts cover those experts (moe_kernels.integrations.peft's
    wrapper slices an expert-parallel rank's): ValueError otherwise, before any kernel runs."""
    for terms in term_lists:
        for lhs, rhs, _ in terms:
            if lhs.shape[0] != local or rhs.shape[0] != local:
                raise ValueError(f"moe_kernels experts: {type(experts).__name__} holds {local} experts and a LoRA term "
                                 f"{lhs.shape[0]} (factors {tuple(lhs.shape)}, {tuple(rhs.shape)})")


def _is_kn_layout(experts: nn.Module) -> bool:
    """Experts stored [E, K, N] (transformers' is_transposed) without a post norm: GPT-OSS's (biases, gate/up columns
    interleaved, its own gate), Aria's (bias-free, gate then up columns) and Ergo's projections (no gate: up_proj
    [E, H, F], act_fn(up))."""
    return getattr(experts, "is_transposed", False) and not getattr(experts, "has_post_expert_norm", False)


class _GroupedMmKN(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] (+ bias[e]) with the weights stored [E, K, N] (GPT-OSS's, Aria's and
    Llama 4's layout), from the grouped GEMM's three products, so no transposed copy of the weights is made: the
    forward is its dgrad product (dout @ w[e] for w [E, N', K']), the input gradient its forward product and the
    weight gradient its wgrad product with the operands swapped (x_e^T @ g_e). The bias gradient is the same wgrad
    product with a column of ones (each group's rows summed in a fixed order, deterministic). Rows past the groups
    get bias[E-1] (nothing reads them)."""

    @staticmethod
    def forward(ctx, x, w, bias, group_sizes):
        out = torch.ops.moe_kernels.grouped_mm_dgrad(x, w, group_sizes)
        if bias is not None:
            _add_group_bias(out, bias, group_sizes)
        ctx.save_for_backward(x, w, group_sizes)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w, group_sizes = ctx.saved_tensors
        ops = torch.ops.moe_kernels
        g = g.contiguous()
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        dx = ops.grouped_mm(g, w, group_sizes) if need_x else None
        dw = ops.grouped_mm_wgrad(x, g, group_sizes) if need_w else None
        db = _group_bias_grad(g, group_sizes) if need_b else None
        return dx, dw, db, None


def _add_group_bias(out: Tensor, bias: Tensor, group_sizes: Tensor) -> None:
    """out[rows of e] += bias[e], in place; rows past the groups get bias[E-1] (nothing reads them). No host sync."""
    E, R = bias.shape[0], out.shape[0]
    ends = torch.cumsum(group_sizes, 0)
    rows = torch.searchsorted(ends, torch.arange(R, device=out.device, dtype=ends.dtype), right=True)
    out.add_(bias.index_select(0, rows.clamp_(max=E - 1)))


def _group_bias_grad(g: Tensor, group_sizes: Tensor) -> Tensor:
    """[E, N]: each group's rows of g summed, by the wgrad product with a column of ones (a fixed order,
    deterministic); empty groups give zeros."""
    return torch.ops.moe_kernels.grouped_mm_wgrad(g.new_ones((g.shape[0], 1)), g, group_sizes)[:, 0]


class _GroupBias(torch.autograd.Function):
    """out + bias[expert of each row], added in place into a precision recipe's GEMM output (which nothing saved)."""

    @staticmethod
    def forward(ctx, out, bias, group_sizes):
        _add_group_bias(out, bias.to(out.dtype), group_sizes)
        ctx.mark_dirty(out)
        ctx.save_for_backward(group_sizes)
        ctx.bias_dtype = bias.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        (group_sizes,) = ctx.saved_tensors
        db = _group_bias_grad(g.contiguous(), group_sizes).to(ctx.bias_dtype) if ctx.needs_input_grad[1] else None
        return g, db, None


def _kn_mm(x: Tensor, w: Tensor, bias: Tensor | None, group_sizes: Tensor, terms, recipe=None) -> Tensor:
    """x @ (w[e] + sum of s lhs[e] rhs[e]) (+ bias[e]) per group, w stored [E, K, N]: the [E, K, N] product (a
    precision recipe's, `recipe.grouped_mm_kn`, the bias then added in place into its output), and
    grouped_mm_lora's two rank-r products for each peft LoRA term (lhs [E, K, r], rhs [E, r, N], scaling s: the
    delta in the stored layout is s lhs rhs, peft's get_delta_factors), so W + s lhs rhs is never formed. In
    grouped_mm's [E, N, K] terms that delta is s rhs^T lhs^T (the factors are small: E (K + N) r elements)."""
    terms = [(rhs.transpose(1, 2), lhs.transpose(1, 2), s) for lhs, rhs, s in terms]
    if recipe is not None:
        out = grouped_mm_lora(x, w, group_sizes, terms, mm=recipe.grouped_mm_kn)
        return out if bias is None else _GroupBias.apply(out, bias, group_sizes)
    return grouped_mm_lora(x, w, group_sizes, terms, mm=lambda x, w, g: _GroupedMmKN.apply(x, w, bias, g))


def _kn_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                        top_k_weights: Tensor) -> Tensor:
    """Experts stored [E, K, N] on our ops (GPT-OSS's, Aria's, Ergo's projections): `_kn_experts`. An ONNX export:
    transformers' own forward of the experts interface (on one rank; the decorated class's, where a subclass such as
    Ergo's ErgoExperts calls it from a forward of its own)."""
    if _onnx.exporting():  # (transformers' ops export)
        if DISPATCHER_ATTR in self.__dict__:
            raise NotImplementedError("moe_kernels experts: expert-parallel experts stored [E, K, N] run on "
                                      "moe_kernels' ops only (no ONNX export)")
        if lora_terms(self, _up_name(self)) or lora_terms(self, "down_proj"):  # (the fused wrapper hands none over
            # while exporting: peft forms W + s B A then)
            raise RuntimeError("moe_kernels experts: transformers' forward would drop the fused LoRA terms")
        decorated = next(c.__dict__["forward"] for c in type(self).__mro__
                         if hasattr(c.__dict__.get("forward"), "__wrapped__"))
        return decorated.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    return _kn_experts(self, hidden_states, top_k_index, top_k_weights)


def _kn_experts(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                norm: nn.Module | None = None) -> Tensor:
    """Experts stored [E, K, N] on our ops: permute, the [E, K, N] grouped GEMMs (with the experts' biases where they
    have them, and peft's LoRA terms as rank-r products: `_kn_mm`) around the gate (GPT-OSS's own clamped one on
    interleaved columns; our fused swiglu for SiLU) or, without a gate, the activation (our squared_relu for
    transformers' relu2), then `norm` where given (a norm with a weight row per expert, Ergo's: `_expert_normed`),
    unpermute with the routing weights; expert-parallel (apply_expert_parallel), the dispatcher's dispatch and
    combine around the same GEMMs on this rank's experts. A precision recipe: its grouped_mm_kn (the biases added
    into its output), the rows padded to its alignment."""
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    up = _up_name(self)  # gate_up_proj [E, H, 2F], or up_proj [E, H, F] without a gate
    lora13, lora2 = lora_terms(self, up), lora_terms(self, "down_proj")
    E = self.num_experts
    recipe = self.__dict__.get(_RECIPE_ATTR)  # patch_hf(model, recipe=...)
    align = 1 if recipe is None else recipe.align
    w13, w2 = autocast_input(getattr(self, up)), autocast_input(self.down_proj)  # [E, H, 2F] (or F), [E, F, H]
    _check_lora_experts(self, w13.shape[0], lora13, lora2)
    b13 = b2 = None
    if getattr(self, "has_bias", False):
        b13, b2 = getattr(self, f"{up}_bias").to(w13.dtype), self.down_proj_bias.to(w2.dtype)
    x = hidden_states.to(w13.dtype).contiguous()
    idx = top_k_index.to(torch.int32)
    if getattr(self, "_is_expert_parallel", False):
        idx = torch.where(idx < E, idx, -1)
    if dispatcher is not None:  # this rank holds E / P experts (and their biases)
        check_expert_parallel_weights(self)
        d = dispatcher.dispatch(x, top_k_weights.float(), idx.contiguous(), align=align)
        rows, group_sizes = d.x, d.group_sizes
    else:
        rows, row_map, group_sizes = permute(x, idx.contiguous(), E, align=align)
    h = _kn_mm(rows, w13.contiguous(), b13, group_sizes, lora13, recipe)  # [R, 2F] (or F)
    act = _activation(self, h)  # GPT-OSS's own clamped gate on interleaved columns; SiLU: our swiglu; relu2 alone
    y = _kn_mm(act.contiguous(), w2.contiguous(), b2, group_sizes, lora2, recipe)  # [R, H]
    if norm is not None:  # each row with its expert: this rank's start first where expert-parallel
        y = _expert_normed(norm, y, group_sizes, 0 if dispatcher is None else dispatcher.first_expert)
    if dispatcher is not None:
        return dispatcher.combine(y, d.handle).to(hidden_states.dtype)
    return unpermute(y, row_map, top_k_weights.float().contiguous()).to(hidden_states.dtype)


def _ergo_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                          top_k_weights: Tensor) -> Tensor:
    """Ergo's experts (ErgoExperts: transformers repeats each token once per route, runs its projections with unit
    weights, applies each route's expert's own RMSNorm, then weighs and sums the k routes in fp32) on our ops as
    `_kn_experts` with the experts' own post_expert_norm: permute (each token once per route, grouped by expert),
    up_proj [E, H, F] and down_proj [E, F, H] as the [E, K, N] grouped GEMMs around the experts' act_fn (our
    squared_relu for its relu2), the norm on the permuted rows with each row's expert (transformers' arithmetic),
    and unpermute with the routing weights (fp32, rounded once, as transformers' fp32 sum). Expert-parallel
    (apply_expert_parallel: up_proj and down_proj hold this rank's E / P experts), the norm's [E, H] weight stays
    whole on every rank (a replicated parameter, as the router's), read at the rows of this rank's experts. While
    torch.onnx exports, transformers' forward (as unpatched). hidden_states [T, H]; returns [T, H] in its dtype."""
    if _onnx.exporting():
        return _base_class(self).forward(self, hidden_states, top_k_index, top_k_weights)
    norm = self._modules["post_expert_norm"]
    if any(_is_dtensor(t) for t in (self.up_proj, self.down_proj, norm.weight, hidden_states)):
        raise NotImplementedError(f"moe_kernels experts: {type(self).__name__} {_SHARDED}")
    return _kn_experts(self, hidden_states, top_k_index, top_k_weights, norm)


def _expert_normed(norm: nn.Module, y: Tensor, group_sizes: Tensor, first: int = 0) -> Tensor:
    """norm(y, expert) over the permuted expert outputs, each row with its group's expert (first + the group's index:
    a norm with a weight row per expert, Ergo's ErgoExpertNorm), found on the device from the group sizes (no host
    sync). The rows past the groups are zeroed first and take the last expert's row (as `_normed`'s: unspecified
    values kept out of the weight's gradient)."""
    ends = group_sizes.cumsum(0)
    rows = torch.arange(y.shape[0], device=y.device, dtype=ends.dtype)
    group = torch.searchsorted(ends, rows, right=True)  # rows past the groups: the group count
    valid = group < group_sizes.shape[0]
    y = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return norm(y, group.clamp_max(group_sizes.shape[0] - 1) + first)


def _llama4_block_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """Llama 4's MoE block (Llama4TextMoe) on the chosen experts only. transformers runs every expert on every
    token, the experts not chosen on inputs zeroed by their score (sigmoid(-inf) = 0): E / k times the routed
    experts' FLOPs. Here transformers' router runs as it is (its scores and recorded logits), the same top-k picks
    its experts (the same call on the same logits), each token's copy is scaled by its score before the experts
    as transformers scales it, then permute, the experts module called on the routed rows (its hooks run:
    accelerate's offloading, FSDP2's unsharding; `_llama4_experts_forward`), and unpermute sums each token's
    copies; the shared expert is the block's own. Expert-parallel (apply_expert_parallel): the tokens dispatched
    once with their scores, each received row scaled by its score on the experts' rank, the experts, and the
    combine's unweighted sum. peft adapters on the experts: called through peft's wrappers (fused by
    moe_kernels.integrations.peft: rank-r products; else peft's W + s B A). An ONNX export: transformers' forward
    (on one rank)."""
    dispatcher = _experts_of(self).__dict__.get(DISPATCHER_ATTR)
    if _onnx.exporting():
        if dispatcher is not None:
            raise NotImplementedError("moe_kernels: expert-parallel Llama 4 experts run on moe_kernels' ops only (no "
                                      "ONNX export)")
        return _base_class(self).forward(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
    T, E, k = hidden_states.shape[0], self.num_experts, self.router.top_k
    idx = torch.topk(router_logits, k, dim=1).indices  # the router's own picks
    scores = router_scores.gather(1, idx)  # [T, k], the router's dtype, as transformers multiplies
    recipe = _experts_of(self).__dict__.get(_RECIPE_ATTR)
    align = 1 if recipe is None else recipe.align  # rows per expert padded for the recipe's GEMMs
    if dispatcher is not None:
        d = dispatcher.dispatch(hidden_states.contiguous(), scores.float(), idx.to(torch.int32), align=align)
        # token x score in the model's dtype, as transformers scales (the fp32 row weights hold the scores exactly)
        y = self.experts((d.x * d.weights[:, None].to(d.x.dtype)).contiguous(), d.group_sizes)
        routed = dispatcher.combine(y, d.handle, weighted=False)  # each token's k rows summed
    else:
        x = (hidden_states[:, None, :] * scores[:, :, None]).reshape(T * k, self.hidden_dim)  # copy j of t: t k + j
        x_perm, row_map, group_sizes = permute(x.contiguous(), idx.reshape(-1, 1).to(torch.int32), E, align=align)
        y = self.experts(x_perm, group_sizes)  # [R, H]
        routed = unpermute(y, row_map.view(T, k))  # each token's k copies summed (fp32, rounded once)
    out = self.shared_expert(hidden_states)
    out.add_(routed.to(out.dtype))
    return out, router_logits


def _llama4_experts_forward(self: nn.Module, hidden_states: Tensor, group_sizes: Tensor | None = None) -> Tensor:
    """Llama4TextExperts given the routed rows [R, H] grouped by expert and the group sizes (the patched block's
    call): the [E, K, N] grouped GEMMs on the weights as stored (peft's LoRA terms as rank-r products: `_kn_mm`)
    around gate * up (our fused swiglu for SiLU). Called as transformers calls it, without group sizes:
    transformers' dense forward."""
    if group_sizes is None:
        return _base_class(self).forward(self, hidden_states)
    w13, w2 = autocast_input(self.gate_up_proj), autocast_input(self.down_proj)  # [E, H, 2F], [E, F, H]
    x = hidden_states.to(w13.dtype).contiguous()
    lora13, lora2 = lora_terms(self, "gate_up_proj"), lora_terms(self, "down_proj")
    _check_lora_experts(self, w13.shape[0], lora13, lora2)
    check_expert_parallel_weights(self)
    recipe = self.__dict__.get(_RECIPE_ATTR)  # patch_hf(model, recipe=...)
    h = _kn_mm(x, w13.contiguous(), None, group_sizes, lora13, recipe)
    if _is_silu(self.act_fn):
        act = swiglu(h)
    else:
        gate, up = h.chunk(2, dim=-1)  # gate columns, then up
        act = up * self.act_fn(gate)
    return _kn_mm(act.contiguous(), w2.contiguous(), None, group_sizes, lora2, recipe)


def _dbrx_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                          top_k_weights: Tensor) -> Tensor:
    """DBRX's experts (DbrxExperts; transformers loops over the experts hit, gathering each one's tokens and
    adding its weighted output back with index_add_) on our ops: permute, the gate and up products as two [E, N, K]
    grouped GEMMs on the stored weights' views (w1 and v1 [E * F, H] viewed [E, F, H]), the experts' own
    activation_fn(gate) * up (transformers' arithmetic), the down product as the [E, K, N] grouped GEMM on w2 viewed
    [E, F, H] (`_kn_mm`: no transposed copy), and unpermute with the routing weights (fp32, rounded once). The
    block's router and routing stay transformers' (DbrxRouter's jitter, softmax, top-k and p-norm). A precision
    recipe: its grouped_mm and grouped_mm_kn, the rows padded to its alignment. An ONNX export (transformers' loop
    over the experts hit does not export: its expert list is data): the ops' ONNX formulations (moe_kernels.onnx),
    the down product as grouped_mm on w2's transpose. hidden_states [B, S, H]; returns [B, S, H] in its dtype, as
    transformers does. Expert-parallel (apply_expert_parallel: w1, v1 and w2 hold this rank's E / P experts'
    rows), the dispatcher's dispatch and combine in place of permute and unpermute. The GLU module's own forward is
    not called (its weights are read), so hooks on it do not run."""
    mlp = self.mlp  # DbrxExpertGLU: w1 (gate), v1 (up), w2 (down), each [E * F, H]
    if not _is_dbrx_glu(mlp):  # wrapped after patch_hf (patch_hf itself leaves such blocks alone)
        raise NotImplementedError(f"moe_kernels experts: DBRX's experts' mlp is a {type(mlp).__name__}, not "
                                  "transformers' DbrxExpertGLU (an adapter wrapper?); unpatch_hf runs transformers' "
                                  "experts")
    if any(_is_dtensor(t) for t in (mlp.w1, mlp.v1, mlp.w2, hidden_states)):
        raise NotImplementedError(f"moe_kernels experts: {type(self).__name__} {_SHARDED}")
    F_, H = self.ffn_hidden_size, self.hidden_size
    w1, v1, w2 = (autocast_input(w).view(-1, F_, H) for w in (mlp.w1, mlp.v1, mlp.w2))  # [E (or E / P), F, H]
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, H).to(w1.dtype).contiguous()
    idx = top_k_index.to(torch.int32).contiguous()
    recipe = self.__dict__.get(_RECIPE_ATTR)  # patch_hf(model, recipe=...)
    mm = grouped_mm if recipe is None else recipe.grouped_mm
    align = 1 if recipe is None else recipe.align
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:
        if _onnx.exporting():
            raise NotImplementedError("moe_kernels: expert-parallel DBRX experts do not export to ONNX")
        d = dispatcher.dispatch(x, top_k_weights.float(), idx, align=align)
        rows, group_sizes = d.x, d.group_sizes
    else:
        rows, row_map, group_sizes = permute(x, idx, self.num_experts, align=align)
    act = mlp.activation_fn(mm(rows, w1, group_sizes)) * mm(rows, v1, group_sizes)  # [R, F]
    if _onnx.exporting():  # (grouped_mm_dgrad, the [E, K, N] product's, has no ONNX formulation)
        y = mm(act, w2.transpose(1, 2).contiguous(), group_sizes)
    else:
        y = _kn_mm(act, w2, None, group_sizes, [], recipe)  # [R, H]
    if dispatcher is not None:
        out = dispatcher.combine(y, d.handle)
    else:
        out = unpermute(y, row_map, top_k_weights.float().contiguous())
    return out.to(hidden_states.dtype).view(batch, -1, H)


def _moe_region_fits(launch, x: Tensor, w13: Tensor, w2: Tensor, E: int, permutes: bool = True) -> bool:
    """MoELayer's fused "moe" region (permutes: it permutes the tokens itself; else, expert-parallel, the `experts`
    region on the dispatched rows) takes these experts: plain contiguous tensors of one dtype it runs, no autocast
    (the registered ops apply it), the expert count within the grouped GEMM's limit (and the permute's), and our
    grouped GEMM for this GPU and dtype (moe_kernels.nn.fused.experts_fit)."""
    plain = (Tensor, nn.Parameter)
    return (x.dtype in (torch.float32, torch.float16, torch.bfloat16) and w13.dtype == x.dtype == w2.dtype
            and x.is_contiguous() and type(w13) in plain and type(w2) in plain and w13.is_contiguous()
            and w2.is_contiguous() and not torch.is_autocast_enabled(x.device.type)
            and E <= launch.C.grouped_mm_max_groups and (not permutes or E <= launch.C.permute_max_experts)
            and fused.experts_fit(x))


def _fused_region(experts: nn.Module) -> str | None:
    """The fused region (moe_kernels.nn.fused) that computes these experts' activation: "moe" for transformers'
    default SiLU gate, "moe_squared_relu" for a squared ReLU without a gate; None for any other activation."""
    if getattr(experts, "has_gate", True):
        return "moe" if _is_default_silu_gate(experts) else None
    return "moe_squared_relu" if _is_squared_relu(experts.act_fn) else None


def _fp8_fused_activation(experts: nn.Module, recipe) -> str | None:
    """Which of the FP8 recipe's fused activation GEMMs fits these experts: "swiglu" (transformers' default SiLU
    gate, the activation `_gated` runs as our swiglu), "squared_relu" (transformers' squared ReLU without a gate),
    or None (another recipe, or an activation of the family's own)."""
    if not hasattr(recipe, "swiglu_grouped_mm"):
        return None
    if getattr(experts, "has_gate", True):
        return "swiglu" if _is_default_silu_gate(experts) else None
    return "squared_relu" if _is_squared_relu(experts.act_fn) else None


def _fp8_activation_gemms(recipe, act: str, h: Tensor, w2: Tensor, group_sizes: Tensor, *,
                          unpermute_next: bool = False) -> Tensor:
    """The FP8 recipe's activation and down projection in one (its producer writes the GEMM's E4M3 input)."""
    if act == "swiglu":
        return recipe.swiglu_grouped_mm(h, None, w2, group_sizes, unpermute_next=unpermute_next)
    return recipe.squared_relu_grouped_mm(h, w2, group_sizes, unpermute_next=unpermute_next)


def _activation(experts: nn.Module, h: Tensor) -> Tensor:
    """The experts' activation on the first projection's rows: act_fn(gate) * up for gated experts (`_gated`),
    act_fn(up) for experts without a gate (transformers' has_gate=False): our fused `squared_relu` for
    transformers' squared ReLU (Nemotron-H's; bit for bit its relu then square, one pass each way), else the
    experts' own act_fn."""
    if getattr(experts, "has_gate", True):
        return _gated(experts, h)
    if _is_squared_relu(experts.act_fn):
        return squared_relu(h)
    return experts.act_fn(h)


def _is_squared_relu(act) -> bool:
    """transformers' ReLUSquaredActivation (ACT2FN["relu2"])."""
    relu2 = getattr(sys.modules.get("transformers.activations"), "ReLUSquaredActivation", None)
    return relu2 is not None and type(act) is relu2


def _gated(experts: nn.Module, h: Tensor) -> Tensor:
    """act_fn(gate) * up on [R, 2F] rows. Where the experts compute transformers' default gate with a SiLU
    activation, our `swiglu` op: one pass each way in fp32, rounded once (transformers rounds silu(gate) to the
    model's dtype before the product, so in bf16 the two differ by at most one rounding). Otherwise the experts'
    own `_apply_gate` (or act_fn(gate) * up where they have none)."""
    if _is_default_silu_gate(experts):
        return swiglu(h)
    if hasattr(experts, "_apply_gate"):
        return experts._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _is_default_silu_gate(experts: nn.Module) -> bool:
    moe = sys.modules.get("transformers.integrations.moe")
    default = getattr(moe, "_default_apply_gate", None)
    if default is None or getattr(type(experts), "_apply_gate", None) is not default:
        return False  # a gate of the family's own (GPT-OSS's clamped one, ...)
    return _is_silu(getattr(experts, "act_fn", None))


def _is_silu(act) -> bool:
    """torch's SiLU, transformers' (ACT2FN["silu"]) or the function F.silu (LFM2-MoE's experts)."""
    silu = getattr(sys.modules.get("transformers.activations"), "SiLUActivation", None)
    return type(act) is nn.SiLU or (silu is not None and type(act) is silu) or act is F.silu

