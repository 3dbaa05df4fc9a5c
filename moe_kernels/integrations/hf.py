"""Hugging Face transformers drop-in: run a loaded model's MoE blocks on moe_kernels' ops.

    model = AutoModelForCausalLM.from_pretrained(...)
    moe_kernels.patch_hf(model)      # in place; returns the model
    moe_kernels.unpatch_hf(model)    # back to transformers' own code

Written against the transformers 5.x layout, where every supported sparse MoE block holds

- a router module `gate` with `weight` [E, H] that returns `(router_logits, top_k_weights, top_k_index)`;
  transformers records `router_logits` from that module's output with a forward hook (`OutputRecorder`,
  installed by class) for `output_router_logits` and its load-balancing loss;
- an experts module (decorated with `use_experts_implementation`) with `gate_up_proj` [E, 2F, H] (gate rows
  [0, F), then up rows [F, 2F)), `down_proj` [E, H, F] and `act_fn`, called as
  `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`.

Both weights already have grouped_mm's [E, N, K] layout (out x in, like nn.Linear): they are passed to it as
they are, read from the module at every call, so nothing is copied and nothing but the model holds them.

Patching changes two forwards per block, chosen at call time (nothing is bound to an instance, so a
patched model survives deepcopy, pickling, `nn.DataParallel` replication and wrappers installed later, such
as accelerate's offloading hooks; transformers' classes themselves are never modified):

- the router's: the router instance's class becomes a subclass of transformers' router class, defined here
  (`MoeKernels<RouterClass>`, importable, so pickles load in a fresh process), whose forward computes the
  same logits from the router's own weight (F.linear, as transformers computes them), then `router_topk`
  with the family's routing, returning the same triple, so the recording hook, the router logits and the
  model's own aux loss are unchanged;
- the experts': the block's config selects the "moe_kernels" experts implementation in transformers' own
  experts interface (the previous choice is remembered for `unpatch_hf`), which runs `permute` ->
  `grouped_mm(gate_up_proj)` -> the gate activation (our fused `swiglu` where the experts compute
  transformers' default SiLU gate, else the module's own) -> `grouped_mm(down_proj)` -> `unpermute` (routing
  weights applied there, the Hugging Face order). `model.set_experts_implementation("eager")` (or
  any other) after `patch_hf` therefore switches the experts away from our ops, as it would without it.

`unpatch_hf` restores the router classes and the experts implementation; a forward captured while patched
(a wrapper installed after `patch_hf`) still runs and falls back to transformers' code.

The block's own forward still runs: its return type, reshapes, Mixtral's jitter, Qwen2-MoE's gated shared
expert and DeepSeek-V3's shared experts are transformers' code. Gradients reach the original parameters
(router weight through router_topk's backward, expert weights through grouped_mm's).

Routing per family (transformers 5.x code -> router_topk; verified in tests/integrations/test_hf.py):

- Mixtral: softmax over all E, top-k, renormalise == score="softmax", pre_softmax=False (softmax over the k
  selected logits; selection by logits == selection by probabilities). Weights stay fp32.
- Qwen2-MoE, Qwen3-MoE, OLMoE: softmax over all E (fp32), top-k, renormalised only with `norm_topk_prob`:
  norm_topk_prob=False == pre_softmax=True; True == pre_softmax=False. transformers then casts the weights to
  the logits' dtype; so do we (a [T, k] cast) so bf16 models round the same way.
- DeepSeek-V3: fp32 logits (the router upcasts input and weight), sigmoid, selection by sigmoid +
  e_score_correction_bias, n_group/topk_group group limit where a group's score is the sum of its top 2
  selection scores (group_score_topk=2), weights normalised (+1e-20) only with norm_topk_prob, times
  routed_scaling_factor.
- Qwen3-VL-MoE (and Qwen3.5-MoE, Qwen3-Omni's text model by their code): Qwen's routing, always renormalised.
- MiniMax-M2: sigmoid, selection by sigmoid + the block's e_score_correction_bias (the block passes it to the
  router), no group limit, weights renormalised over the k, fp32.
- DeepSeek-V2: fp32 logits, softmax over all E, top-k ("greedy") or top-k within the topk_group groups of largest
  maximum score ("group_limited_greedy" == group_score_topk=1), not renormalised, times routed_scaling_factor.
  Refused where top_k exceeds the kept groups' experts (transformers then picks dropped experts at score 0).
- DeepSeek-V4: logits in the model's dtype, sqrt-softplus (or sigmoid) scores, selection by score +
  e_score_correction_bias, weights over their sum + 1e-20, times routed_scaling_factor, in the logits' dtype
  (router_topk's scores in fp32: in bf16 near-ties may be picked the other way). Its hash-routed layers
  (`DeepseekV4HashRouter`: experts by token id) keep transformers' router; their experts run ours. The experts'
  clamped SwiGLU is their own `_apply_gate`.
- Mistral 4: softmax over all E in the model's dtype, the topk_group groups of largest top-2 sum kept, top-k by
  probability, weights over their sum (+1e-20) with norm_topk_prob, times routed_scaling_factor == softmax,
  pre_softmax, group_score_topk=2, normalize (router_topk's probabilities in fp32: in bf16 near-ties may be
  picked the other way). Mistral Large 4: the same on fp32 logits, always renormalised. Refused where top_k
  exceeds the kept groups' experts (transformers then picks dropped experts at score 0).
- Gemma 4 (`Gemma4TextDecoderLayer` is the block, its `router` and `experts` children): the router's own norm,
  scales and projection, the fp32 softmax over all E it returns, top-k by probability renormalised over the k
  (router_topk's softmax over the k chosen logits), times each chosen expert's learned per_expert_scale.
- ERNIE-4.5 (and ERNIE-4.5-VL's text and vision experts, by their code): fp32 logits, selection by the softmax
  over all E + moe_statics' e_score_correction_bias == score="softmax", pre_softmax=True, expert_bias; the chosen
  probabilities over their sum == normalize=True (the softmax over the k chosen logits); cast to the input dtype.
- Every other family whose router class has one of these routers' code (`_matched_family`: the same `forward`
  source text and the same objects behind its global names, in the installed transformers) routes as that
  family: GLM-4.5, Dots1, Kimi-Linear, DeepSeek-V3.2 (DeepSeek-V3's), Qwen3-Next, FlexOlmo (Qwen2-MoE's),
  MiniMax (Mixtral's), Qwen3.5-MoE (Qwen3-VL-MoE's), ERNIE-4.5-VL (ERNIE-4.5's), ...; `matched_routers()` lists
  them.

- GPT-OSS (`GptOssMLP`, its router is `router`): biased logits, top-k by logit, softmax over the k, cast to the
  logits' dtype. Its experts add a bias to both projections and use a clamped SwiGLU variant on interleaved
  gate/up columns, stored transposed ([E, H, 2F], [E, F, H]): they run permute -> the biased [E, K, N] grouped
  GEMM (`_GroupedMmKN`: grouped_mm's dgrad product forward, its forward and wgrad products backward, so no
  transposed copy of the weights; the bias gradient a wgrad product with a column of ones, deterministic) ->
  the experts' own `_apply_gate` -> the same for down_proj -> unpermute. No precision recipe (refused at patch
  time); with peft adapters, or while torch.onnx exports, the experts run transformers' forward.
- Llama 4 (`Llama4TextMoe`): transformers runs every expert on every token (the inputs of the experts not chosen
  zeroed by their score, sigmoid(-inf) = 0), E / k times the routed experts' FLOPs (16x for Scout, 128x for
  Maverick). Its block forward is replaced (`_llama4_block_forward`): transformers' router as it is, each token's
  copy scaled by its score before the experts, permute, the [E, K, N] grouped GEMMs around SiLU gate * up,
  unpermute, the block's own shared expert. No precision recipe (refused at patch time); with peft adapters, or
  while torch.onnx exports, transformers' block forward.

Not supported (left alone, listed in one warning): any other block that looks like an MoE block (a child named
`experts`, or a class name ending in MoE/Moe/MoeBlock/MoeLayer), and supported classes whose structure differs
from the above (biases, transposed or quantised expert weights outside GPT-OSS's layout, a replaced router,
transformers 4.x per-expert ModuleLists).

The experts implementation alone (transformers' own router): `model.set_experts_implementation("moe_kernels")`,
or `from_pretrained(..., experts_implementation="moe_kernels")`: "moe_kernels" is registered in
transformers' experts interface as soon as both moe_kernels and transformers.integrations.moe are imported,
in either order (a post-import hook when moe_kernels comes first). It covers the experts' GEMMs only and
runs at the model's precision; `patch_hf` also replaces the routers (router_topk) and takes a recipe.

transformers is imported lazily: importing moe_kernels never imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import inspect
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_kernels import onnx as _onnx
from moe_kernels.nn import fused
from moe_kernels.nn.lora import grouped_mm_lora, lora_terms
from moe_kernels.ops.activation import swiglu
from moe_kernels.ops.grouped_mm import autocast_input, grouped_mm
from moe_kernels.ops.permute import permute, unpermute
from moe_kernels.ops.router import router_topk

EXPERTS_IMPLEMENTATION = "moe_kernels"  # the name in transformers' ExpertsInterface
_PATCH_ATTR = "_moe_kernels_patch"  # router: its previous `_old_forward` (accelerate); experts: previous implementation
_RECIPE_ATTR = "_moe_kernels_recipe"  # on patched experts modules given a precision recipe
DISPATCHER_ATTR = "_moe_kernels_dispatcher"  # on experts sharded by moe_kernels.parallel.apply_expert_parallel
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---------------------------------------------------------------------------------------------------
# Replacement forwards (bound to module instances)


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
    if any(_is_dtensor(t) for t in (self.gate_up_proj, self.down_proj, hidden_states)):
        raise NotImplementedError(f"moe_kernels experts: {type(self).__name__} {_SHARDED}")
    if _is_biased_layout(self):
        return _biased_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if (
        getattr(self, "has_bias", False)
        or getattr(self, "is_transposed", False)
        or not getattr(self, "is_concatenated", True)
        or not getattr(self, "has_gate", True)
        or getattr(self, "has_post_expert_norm", False)
    ):
        raise NotImplementedError(
            f"moe_kernels experts: {type(self).__name__} has biases, transposed/interleaved weights, no gate "
            "or a post-expert norm; bias-free [E, 2F, H] gate_up_proj + [E, H, F] down_proj experts run here, and "
            "GPT-OSS's layout (biases, [E, H, 2F] interleaved gate/up and [E, F, H] weights, all three)"
        )
    E = self.num_experts
    w13 = _grouped_weight(self.gate_up_proj)  # [E, 2F, H]: N = 2F, K = H
    w2 = _grouped_weight(self.down_proj)  # [E, H, F]: N = H, K = F
    x = hidden_states.to(w13.dtype).contiguous()  # a no-op unless autocast handed us another dtype
    idx = top_k_index.to(torch.int32)
    if getattr(self, "_is_expert_parallel", False):
        idx = torch.where(idx < E, idx, -1)  # EP sentinels (>= E, weight 0) become dropped slots
    recipe = self.__dict__.get(_RECIPE_ATTR)  # patch_hf(model, recipe=...): low-precision expert GEMMs
    mm = grouped_mm if recipe is None else recipe.grouped_mm
    lora13, lora2 = lora_terms(self, "gate_up_proj"), lora_terms(self, "down_proj")  # peft adapters, fused
    align = 1 if recipe is None else recipe.align
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:  # moe_kernels.parallel.apply_expert_parallel: this rank holds E / P experts
        if lora13 or lora2:
            raise NotImplementedError("moe_kernels experts: LoRA adapters on expert-parallel experts are not supported "
                                      "(the adapters hold every expert, the weights this rank's)")
        d = dispatcher.dispatch(x, top_k_weights.float(), idx.contiguous(), align=align)
        h = grouped_mm_lora(d.x, w13, d.group_sizes, lora13, mm=mm)
        act = _gated(self, h)
        y = grouped_mm_lora(act.contiguous(), w2, d.group_sizes, lora2, mm=mm)
        return dispatcher.combine(y, d.handle).to(hidden_states.dtype)
    if recipe is None and not lora13 and not lora2 and _is_default_silu_gate(self):
        launch = fused.launch_for(x)
        if launch is not None and _moe_region_fits(launch, x, w13, w2, E):
            # The whole routed-experts computation as MoELayer's fused region: one extension call each way
            # (permute, grouped_mm, swiglu, grouped_mm, unpermute with the routing weights, the Hugging Face order).
            out = fused.run("moe", launch, x, idx.contiguous(), top_k_weights.float().contiguous(), w13, w2, E, 1)
            return out.to(hidden_states.dtype)
    if getattr(recipe, "fused_permute", False) and not lora13:  # FP8: permute fused with the quantization
        h, row_map, group_sizes = recipe.permute_grouped_mm(x, idx.contiguous(), E, recipe.align, w13)
    else:
        x_perm, row_map, group_sizes = permute(x, idx.contiguous(), E, align=align)
        h = grouped_mm_lora(x_perm, w13, group_sizes, lora13, mm=mm)  # [R, 2F]
    act = _gated(self, h)  # act_fn(gate) * up
    y = grouped_mm_lora(act.contiguous(), w2, group_sizes, lora2, mm=mm)  # [R, H]
    out = unpermute(y, row_map, top_k_weights.float().contiguous())
    return out.to(hidden_states.dtype)


def _is_biased_layout(experts: nn.Module) -> bool:
    """GPT-OSS's experts layout: biases, weights stored [E, K, N], gate/up interleaved, gated, no post norm."""
    return (getattr(experts, "has_bias", False) and getattr(experts, "is_transposed", False)
            and not getattr(experts, "is_concatenated", True) and getattr(experts, "has_gate", True)
            and not getattr(experts, "has_post_expert_norm", False))


class _GroupedMmKN(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] (+ bias[e]) with the weights stored [E, K, N] (GPT-OSS's and Llama 4's
    layout), from the grouped GEMM's three products, so no transposed copy of the weights is made: the forward is
    its dgrad product (dout @ w[e] for w [E, N', K']), the input gradient its forward product and the weight
    gradient its wgrad product with the operands swapped (x_e^T @ g_e). The bias gradient is the same wgrad
    product with a column of ones (each group's rows summed in a fixed order, deterministic). Rows past the groups
    get bias[E-1] (nothing reads them)."""

    @staticmethod
    def forward(ctx, x, w, bias, group_sizes):
        ops = torch.ops.moe_kernels
        E, R = w.shape[0], x.shape[0]
        out = ops.grouped_mm_dgrad(x, w, group_sizes)
        if bias is not None:
            ends = torch.cumsum(group_sizes, 0)
            rows = torch.searchsorted(ends, torch.arange(R, device=x.device, dtype=ends.dtype), right=True)
            out.add_(bias.index_select(0, rows.clamp_(max=E - 1)))
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
        db = ops.grouped_mm_wgrad(g.new_ones((g.shape[0], 1)), g, group_sizes)[:, 0] if need_b else None
        return dx, dw, db, None


def _biased_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                            top_k_weights: Tensor) -> Tensor:
    """GPT-OSS's experts on our ops: permute, the biased [E, K, N] grouped GEMMs around the experts' own gate
    (clamped, interleaved), unpermute with the routing weights. Adapters or a precision recipe: transformers'
    own forward."""
    lora = lora_terms(self, "gate_up_proj") or lora_terms(self, "down_proj")
    if lora or self.__dict__.get(_RECIPE_ATTR) is not None or _onnx.exporting():  # (ONNX: transformers' ops export)
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    if self.__dict__.get(DISPATCHER_ATTR) is not None:  # (apply_expert_parallel refuses these experts)
        raise NotImplementedError("moe_kernels experts: expert parallelism does not run GPT-OSS's biased experts")
    E = self.num_experts
    w13, w2 = autocast_input(self.gate_up_proj), autocast_input(self.down_proj)  # [E, H, 2F], [E, F, H]
    b13, b2 = self.gate_up_proj_bias.to(w13.dtype), self.down_proj_bias.to(w2.dtype)
    x = hidden_states.to(w13.dtype).contiguous()
    idx = top_k_index.to(torch.int32)
    if getattr(self, "_is_expert_parallel", False):
        idx = torch.where(idx < E, idx, -1)
    x_perm, row_map, group_sizes = permute(x, idx.contiguous(), E, align=1)
    h = _GroupedMmKN.apply(x_perm, w13.contiguous(), b13, group_sizes)  # [R, 2F]
    act = self._apply_gate(h)  # the family's own gate: GPT-OSS's clamped one on interleaved columns
    y = _GroupedMmKN.apply(act.contiguous(), w2.contiguous(), b2, group_sizes)  # [R, H]
    return unpermute(y, row_map, top_k_weights.float().contiguous()).to(hidden_states.dtype)


def _llama4_block_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """Llama 4's MoE block (Llama4TextMoe) on the chosen experts only. transformers runs every expert on every
    token, the experts not chosen on inputs zeroed by their score (sigmoid(-inf) = 0): E / k times the routed
    experts' FLOPs. Here transformers' router runs as it is (its scores and recorded logits), the same top-k picks
    its experts (the same call on the same logits), each token's copy is scaled by its score before the experts
    as transformers scales it, then permute, the experts module called on the routed rows (its hooks run:
    accelerate's offloading, FSDP2's unsharding; `_llama4_experts_forward`), and unpermute sums each token's
    copies; the shared expert is the block's own. Adapters on the experts (peft wraps them) or an ONNX export:
    transformers' forward."""
    if self.experts is not _experts_of(self) or _onnx.exporting():
        return _base_class(self).forward(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
    T, E, k = hidden_states.shape[0], self.num_experts, self.router.top_k
    idx = torch.topk(router_logits, k, dim=1).indices  # the router's own picks
    scores = router_scores.gather(1, idx)  # [T, k], the router's dtype, as transformers multiplies
    x = (hidden_states[:, None, :] * scores[:, :, None]).reshape(T * k, self.hidden_dim)  # copy j of token t: t k + j
    x_perm, row_map, group_sizes = permute(x.contiguous(), idx.reshape(-1, 1).to(torch.int32), E, align=1)
    y = self.experts(x_perm, group_sizes)  # [R, H]
    routed = unpermute(y, row_map.view(T, k))  # each token's k copies summed (fp32, rounded once)
    out = self.shared_expert(hidden_states)
    out.add_(routed.to(out.dtype))
    return out, router_logits


def _llama4_experts_forward(self: nn.Module, hidden_states: Tensor, group_sizes: Tensor | None = None) -> Tensor:
    """Llama4TextExperts given the routed rows [R, H] grouped by expert and the group sizes (the patched block's
    call): the [E, K, N] grouped GEMMs on the weights as stored around gate * up (our fused swiglu for SiLU).
    Called as transformers calls it, without group sizes: transformers' dense forward."""
    if group_sizes is None:
        return _base_class(self).forward(self, hidden_states)
    w13, w2 = autocast_input(self.gate_up_proj), autocast_input(self.down_proj)  # [E, H, 2F], [E, F, H]
    h = _GroupedMmKN.apply(hidden_states.to(w13.dtype).contiguous(), w13.contiguous(), None, group_sizes)
    if _is_silu(self.act_fn):
        act = swiglu(h)
    else:
        gate, up = h.chunk(2, dim=-1)  # gate columns, then up
        act = up * self.act_fn(gate)
    return _GroupedMmKN.apply(act.contiguous(), w2.contiguous(), None, group_sizes)


def _moe_region_fits(launch, x: Tensor, w13: Tensor, w2: Tensor, E: int) -> bool:
    """MoELayer's fused "moe" region takes these experts: plain contiguous tensors of one dtype it runs, no
    autocast (the registered ops apply it), the expert count within the kernels' limits, and our grouped GEMM
    for this GPU and dtype (moe_kernels.nn.fused.experts_fit)."""
    plain = (Tensor, nn.Parameter)
    return (x.dtype in (torch.float32, torch.float16, torch.bfloat16) and w13.dtype == x.dtype == w2.dtype
            and type(w13) in plain and type(w2) in plain and w13.is_contiguous() and w2.is_contiguous()
            and not torch.is_autocast_enabled(x.device.type)
            and E <= min(launch.C.permute_max_experts, launch.C.grouped_mm_max_groups) and fused.experts_fit(x))


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
    """torch's SiLU or transformers' (ACT2FN["silu"])."""
    silu = getattr(sys.modules.get("transformers.activations"), "SiLUActivation", None)
    return type(act) is nn.SiLU or (silu is not None and type(act) is silu)


def _mixtral_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # [T, E], as transformers computes (and records) them
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights, indices.long()  # int64, as transformers' routers return (eager experts need it)


def _qwen_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen2-MoE, Qwen3-MoE and OLMoE routers (the same transformers code)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=not self.norm_topk_prob)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def _deepseek_v3_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    # transformers routes in fp32: it upcasts the input and the weight (a transient copy of the [E, H] weight for
    # a bf16 model, as in its own forward).
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    grouped = self.num_group > 1
    weights, indices = router_topk(
        router_logits,
        self.top_k,
        score="sigmoid",
        num_groups=self.num_group if grouped else None,
        group_topk=self.topk_group if grouped else None,
        # transformers: group score = sum of the group's top-2 (bias-corrected) scores, whatever k and topk_group
        group_score_topk=min(2, self.num_experts // self.num_group) if grouped else None,
        scaling_factor=float(self.routed_scaling_factor),
        expert_bias=self.e_score_correction_bias.float(),  # a buffer, fp32 in transformers; selection only
        normalize=bool(self.norm_topk_prob),
    )
    return router_logits, weights, indices.long()  # int64, as transformers' routers return (eager experts need it)


def _qwen_normalized_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3-VL-MoE, Qwen3.5-MoE and Qwen3-Omni's text routers: Qwen's routing, always renormalised."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def _minimax_m2_router_forward(
    self: nn.Module, hidden_states: Tensor, e_score_correction_bias: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """MiniMax-M2: sigmoid, selection by sigmoid + the block's e_score_correction_bias (passed in by the block),
    no group limit, weights normalised over the k (transformers divides by their sum; router_topk adds 1e-20 to
    it, which changes nothing unless all k sigmoids are below 1e-13) and fp32."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid",
                                   expert_bias=e_score_correction_bias.float(), normalize=True)
    return router_logits, weights, indices.long()


def _deepseek_v2_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V2: fp32 logits, softmax over all E, top-k ("greedy") or top-k within the topk_group groups of
    largest maximum score ("group_limited_greedy": group_score_topk=1), never renormalised, times
    routed_scaling_factor."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    grouped = self.topk_method == "group_limited_greedy" and self.num_group > 1
    weights, indices = router_topk(
        router_logits,
        self.top_k,
        score="softmax",
        pre_softmax=True,
        num_groups=self.num_group if grouped else None,
        group_topk=self.topk_group if grouped else None,
        group_score_topk=1 if grouped else None,
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights, indices.long()


def _gpt_oss_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GPT-OSS: biased logits, top-k by logit, softmax over the k (transformers takes it in the logits' dtype,
    router_topk in fp32 rounded to it: in bf16 the two differ by at most one rounding)."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def _ernie_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ERNIE-4.5: fp32 logits (autocast off), selection by the softmax over all E plus moe_statics'
    e_score_correction_bias, weights the chosen probabilities over their sum (router_topk takes the softmax over the
    k chosen logits, the same quotient; transformers clamps the sum at moe_norm_min, 1e-12 by default, which only
    differs where the k chosen probabilities sum below it), in the input's dtype."""
    device_type = hidden_states.device.type
    off = contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)
    with off:
        router_logits = F.linear(hidden_states.float(), self.weight.float())
    # moe_statics called as transformers calls it (its hooks run: offloading, sharding): zeros + its [1, E] bias
    bias = self.moe_statics(router_logits.new_zeros(router_logits.shape[-1])).float()
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=True, expert_bias=bias,
                                   normalize=True)
    return router_logits, weights.to(hidden_states.dtype), indices.long()


def _deepseek_v4_score(gate: nn.Module) -> str | None:
    """router_topk's name for the router's scoring function (transformers' ACT2FN instance), or None."""
    acts = sys.modules.get("transformers.activations")
    sqrt_softplus = getattr(acts, "SqrtSoftplusActivation", None)
    if sqrt_softplus is not None and type(gate.score_fn) is sqrt_softplus:
        return "sqrtsoftplus"
    return "sigmoid" if type(gate.score_fn) is nn.Sigmoid else None


def _deepseek_v4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V4's learned router: logits in the model's dtype, s = sqrt(softplus) (or sigmoid), selection by
    s + e_score_correction_bias, weights s over their sum + 1e-20, times routed_scaling_factor, in the logits'
    dtype. transformers takes s in the logits' dtype, router_topk in fp32 from the same logits: in bf16 the
    weights differ by a rounding, and two experts whose bf16 scores tie (or swap) may be picked the other way.
    (Its hash-routed layers keep transformers' router: `experts_only_routers`.)"""
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    weights, indices = router_topk(logits, self.top_k, score=_deepseek_v4_score(self),
                                   expert_bias=self.e_score_correction_bias.float(), normalize=True,
                                   scaling_factor=float(self.routed_scaling_factor))
    return logits, weights.to(logits.dtype), indices.long()


def _mistral4_groups(gate: nn.Module) -> dict:
    """router_topk's group options for Mistral 4's routers: a group scored by its top-2 probabilities."""
    if gate.num_group <= 1:
        return {}
    return dict(num_groups=gate.num_group, group_topk=gate.topk_group, group_score_topk=2)


def _mistral4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mistral 4: logits in the model's dtype, softmax over all E, the topk_group groups of largest top-2 sum
    kept, top-k by probability, weights the probabilities (over their sum + 1e-20 with norm_topk_prob: router_topk
    takes the softmax over the k chosen logits, the same quotient) times routed_scaling_factor, in the logits'
    dtype. transformers takes the softmax in the logits' dtype, router_topk in fp32 from the same logits: in bf16
    two experts whose bf16 probabilities tie or swap may be picked the other way."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=True,
                                   **_mistral4_groups(self), scaling_factor=float(self.routed_scaling_factor),
                                   normalize=bool(self.norm_topk_prob))
    return router_logits, weights.to(router_logits.dtype), indices.long()


def _mistral_large4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mistral Large 4: Mistral 4's routing on fp32 logits, always renormalised; fp32 weights."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=True,
                                   **_mistral4_groups(self), scaling_factor=float(self.routed_scaling_factor),
                                   normalize=True)
    return router_logits, weights, indices.long()


def _gemma4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gemma 4: the router's own norm, scales and projection (transformers' code), the fp32 softmax over all E
    that it returns (recorded as the router logits), top-k by probability, weights the chosen probabilities over
    their sum == router_topk's softmax over the k chosen logits (selection by logit == by probability), times
    the learned per_expert_scale of each chosen expert (fp32)."""
    hidden_states = self.norm(hidden_states)
    hidden_states = hidden_states * self.scale * self.scalar_root_size
    expert_scores = self.proj(hidden_states)  # [T, E], the model's dtype
    router_probabilities = F.softmax(expert_scores, dim=-1, dtype=torch.float32)
    weights, indices = router_topk(expert_scores, self.config.top_k_experts, score="softmax")
    indices = indices.long()
    return router_probabilities, weights * self.per_expert_scale[indices], indices


# Per-family checks of the router's settings (gate, block, E) -> why it cannot run on router_topk, or None.


def _mistral4_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    G, g = gate.num_group, gate.topk_group
    if G > 1:
        if E % G or not 1 <= g <= G or E // G < 2:
            return f"n_group={G}, topk_group={g} do not fit {E} experts (groups of at least 2)"
        if gate.top_k > g * (E // G):
            # transformers then also picks experts of dropped groups, at score 0; router_topk ranks them -inf
            return f"top_k={gate.top_k} exceeds the {g * (E // G)} experts of the topk_group={g} kept groups"
    return None


def _deepseek_v4_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    if _deepseek_v4_score(gate) is None:
        return f"its router scores with {type(gate.score_fn).__name__} (router_topk runs sqrt-softplus and sigmoid)"
    if type(gate).__name__ in ("DeepseekV4HashRouter",):  # transformers' router stays (hash routing)
        return None
    bias = getattr(gate, "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return "its router has no [E] e_score_correction_bias"
    return None


def _deepseek_v3_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    bias = getattr(gate, "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return "its router has no [E] e_score_correction_bias"
    if gate.num_group > 1 and (E % gate.num_group or not 1 <= gate.topk_group <= gate.num_group):
        return f"n_group={gate.num_group}, topk_group={gate.topk_group} do not fit {E} experts"
    return None


def _minimax_m2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    bias = getattr(block, "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return "the block has no [E] e_score_correction_bias"
    return None


def _ernie_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    bias = getattr(getattr(gate, "moe_statics", None), "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or bias.numel() != E or bias.dim() > 2 or bias.shape[-1] != E:
        return "its router's moe_statics has no [1, E] e_score_correction_bias (one group of experts)"
    return None


def _llama4_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    """Llama4TextMoe: a bias-free nn.Linear router, experts [E, H, 2F] (gate then up columns) and [E, F, H]."""
    experts = _experts_of(block)
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(w13, Tensor) and isinstance(w2, Tensor) and w13.dim() == 3 and w2.dim() == 3):
        return "its experts lack [E, H, 2F] gate_up_proj / [E, F, H] down_proj tensors"
    if w13.dtype not in _WEIGHT_DTYPES or w2.dtype != w13.dtype:
        return f"its expert weights are {w13.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    H, F2 = w13.shape[1], w13.shape[2]
    if gate.bias is not None or tuple(gate.weight.shape) != (E, H) or w13.shape[0] != E or F2 % 2 \
            or tuple(w2.shape) != (E, F2 // 2, H) or getattr(block, "hidden_dim", None) != H:
        return (f"unexpected shapes: router {tuple(gate.weight.shape)} (bias {gate.bias is not None}), gate_up_proj "
                f"{tuple(w13.shape)}, down_proj {tuple(w2.shape)} for {E} experts")
    if not isinstance(getattr(block, "shared_expert", None), nn.Module):
        return "it has no shared_expert"
    return None


def _deepseek_v2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    method = getattr(gate, "topk_method", None)
    if method not in ("greedy", "group_limited_greedy"):
        return f"its router's topk_method={method!r} (router_topk runs 'greedy' and 'group_limited_greedy')"
    G, g = gate.num_group, gate.topk_group
    if method == "group_limited_greedy" and G > 1:
        if E % G or not 1 <= g <= G:
            return f"n_group={G}, topk_group={g} do not fit {E} experts"
        if gate.top_k > g * (E // G):
            # transformers then also picks experts of dropped groups, at score 0 (a zeroed mask); router_topk
            # would give them their softmax scores
            return f"top_k={gate.top_k} exceeds the {g * (E // G)} experts of the topk_group={g} kept groups"
    return None


# ---------------------------------------------------------------------------------------------------
# Supported families


@dataclass(frozen=True)
class _Family:
    name: str
    module: str  # transformers module defining the classes
    block: str
    gate: str
    experts: str
    router_forward: Callable
    problem: Callable | None = None  # (gate, block, E) -> why the router's settings do not run, or None
    reference: bool = True  # its router's code is a routing reference other families are matched against
    biased_experts: bool = False  # GPT-OSS's experts: biases, transposed weights, interleaved gate/up
    block_forward: Callable | None = None  # the block's forward replaced (its router stays transformers')
    experts_forward: Callable | None = None  # with block_forward: the experts' forward the block calls
    experts_only_routers: tuple[str, ...] = ()  # router classes that stay transformers' (our experts behind them)


_TM = "transformers.models."
FAMILIES = (
    _Family("Mixtral", _TM + "mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter",
            "MixtralExperts", _mixtral_router_forward),
    _Family("Qwen2-MoE", _TM + "qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter",
            "Qwen2MoeExperts", _qwen_router_forward),
    _Family("Qwen3-MoE", _TM + "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter",
            "Qwen3MoeExperts", _qwen_router_forward, reference=False),
    _Family("OLMoE", _TM + "olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts",
            _qwen_router_forward, reference=False),
    _Family("DeepSeek-V3", _TM + "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter",
            "DeepseekV3Experts", _deepseek_v3_router_forward, _deepseek_v3_problem),
    _Family("Qwen3-VL-MoE", _TM + "qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock",
            "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextExperts", _qwen_normalized_router_forward),
    _Family("MiniMax-M2", _TM + "minimax_m2.modeling_minimax_m2", "MiniMaxM2SparseMoeBlock", "MiniMaxM2TopKRouter",
            "MiniMaxM2Experts", _minimax_m2_router_forward, _minimax_m2_problem),
    _Family("DeepSeek-V2", _TM + "deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe", "DeepseekV2TopkRouter",
            "DeepseekV2Experts", _deepseek_v2_router_forward, _deepseek_v2_problem),
    _Family("GPT-OSS", _TM + "gpt_oss.modeling_gpt_oss", "GptOssMLP", "GptOssTopKRouter", "GptOssExperts",
            _gpt_oss_router_forward, biased_experts=True),
    _Family("ERNIE-4.5", _TM + "ernie4_5_moe.modeling_ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock",
            "Ernie4_5_MoeTopKRouter", "Ernie4_5_MoeExperts", _ernie_router_forward, _ernie_problem),
    _Family("DeepSeek-V4", _TM + "deepseek_v4.modeling_deepseek_v4", "DeepseekV4SparseMoeBlock",
            "DeepseekV4TopKRouter", "DeepseekV4Experts", _deepseek_v4_router_forward, _deepseek_v4_problem,
            experts_only_routers=("DeepseekV4HashRouter",)),
    _Family("Mistral 4", _TM + "mistral4.modeling_mistral4", "Mistral4MoE", "Mistral4TopkRouter", "Mistral4Experts",
            _mistral4_router_forward, _mistral4_problem),
    _Family("Mistral Large 4", _TM + "mistral_large4.modeling_mistral_large4", "MistralLarge4TextMoE",
            "MistralLarge4TextTopkRouter", "MistralLarge4TextExperts", _mistral_large4_router_forward,
            _mistral4_problem),
    _Family("Gemma 4", _TM + "gemma4.modeling_gemma4", "Gemma4TextDecoderLayer", "Gemma4TextRouter",
            "Gemma4TextExperts", _gemma4_router_forward, reference=False),
    _Family("Llama 4", _TM + "llama4.modeling_llama4", "Llama4TextMoe", "Llama4Router", "Llama4TextExperts", None,
            _llama4_problem, reference=False, block_forward=_llama4_block_forward,
            experts_forward=_llama4_experts_forward),
)

SUPPORTED = tuple(f.name for f in FAMILIES)

_MOE_NAME = re.compile(r"(MoE|Moe|MoeBlock|MoEBlock|MoeLayer|MoELayer)$")


def _family_classes(fam: _Family):
    """(block, gate, experts) classes, or None when transformers has not loaded that family's module (then
    no model in this process can hold one of its blocks)."""
    mod = sys.modules.get(fam.module)
    if mod is None:
        return None
    classes = tuple(getattr(mod, name, None) for name in (fam.block, fam.gate, fam.experts))
    return None if any(c is None for c in classes) else classes


# Families matched by their router's code. transformers generates most MoE models from a few (its modular
# files), so many routers are a reference family's router under another name (GLM-4.5's, Dots1's, Kimi-Linear's
# are DeepSeek-V3's; Qwen3-Next's and FlexOlmo's are Qwen2-MoE's; MiniMax's is Mixtral's). A router class routes
# exactly as a reference family does when its `forward` has the reference's source text, character for
# character, and every global name that source reads (F, torch, nn, helpers) is the same object in both modules:
# then the same code runs on the same attributes. Checked in the installed transformers, class by class, so a
# router that transformers changes stops matching (and is left alone, named in the warning) instead of being
# routed by code that no longer agrees with it.
_MATCHED: dict[type, _Family | None] = {}


def _forward_of(cls: type):
    fn = getattr(cls, "forward", None)
    return fn if isinstance(fn, types.FunctionType) else None


def _same_code(fn, ref) -> bool:
    try:
        if inspect.getsource(fn) != inspect.getsource(ref):
            return False
    except (OSError, TypeError):
        return False
    missing = object()
    return all(fn.__globals__.get(n, missing) is ref.__globals__.get(n, missing) for n in _names(fn.__code__)
               if n in fn.__globals__ or n in ref.__globals__)


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _matched_family(cls: type) -> _Family | None:
    """The family a transformers router class routes as, by its code (above), or None. Cached per class."""
    if cls in _MATCHED:
        return _MATCHED[cls]
    found = None
    fn = _forward_of(cls)
    if fn is not None and cls.__module__.startswith(_TM):
        for ref in FAMILIES:
            if not ref.reference:
                continue
            try:
                ref_cls = getattr(importlib.import_module(ref.module), ref.gate)
            except (ImportError, AttributeError):
                continue
            ref_fn = _forward_of(ref_cls)
            if ref_fn is not None and _same_code(fn, ref_fn):
                short = cls.__module__[len(_TM):].split(".")[0]
                found = _Family(f"{short} ({ref.name} routing)", cls.__module__, None, cls.__name__, None,
                                ref.router_forward, ref.problem, reference=False,
                                biased_experts=ref.biased_experts)
                break
    _MATCHED[cls] = found
    return found


def matched_routers() -> dict[str, str]:
    """{router class (module.Class): the family whose routing it runs} for every router class of the installed
    transformers that patch_hf runs: the named families' and those matched by their code. Imports every
    transformers model module (seconds); for documentation and tests."""
    out = {}
    for fam in FAMILIES:
        try:
            if isinstance(getattr(importlib.import_module(fam.module), fam.gate, None), type):
                out[f"{fam.module}.{fam.gate}"] = fam.name
        except ImportError:  # a transformers without that model
            continue
    for name, text in _modeling_files():
        if "def forward" not in text or ("Router" not in text and "Gate" not in text):
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # a model whose optional dependencies are missing
            continue
        for attr, cls in vars(mod).items():
            if isinstance(cls, type) and cls.__module__ == name and issubclass(cls, nn.Module):
                key = f"{name}.{attr}"
                if key not in out and (fam := _matched_family(cls)) is not None:
                    out[key] = fam.name
    return out


def _transformers_class(name: str) -> type | None:
    """A class of transformers' model modules by name: loaded modules first, then the source files (one read
    each) to find the module to import. For unpickling in a fresh process."""
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith(_TM) and isinstance(cls := getattr(mod, name, None), type) and cls.__name__ == name:
            return cls
    for mod_name, text in _modeling_files():
        if f"class {name}(" in text:
            cls = getattr(importlib.import_module(mod_name), name, None)
            if isinstance(cls, type):
                return cls
    return None


def _modeling_files() -> Iterator[tuple[str, str]]:
    """(module name, source text) of every transformers model module, by its file (nothing imported but
    transformers.models itself); none without transformers."""
    try:
        import transformers.models
    except ImportError:
        return
    for path in sorted(Path(transformers.models.__file__).parent.glob("*/modeling_*.py")):
        yield f"{_TM}{path.parent.name}.{path.stem}", path.read_text(encoding="utf-8", errors="replace")


_SHARDED = (
    "holds sharded (DTensor) weights: transformers' tensor or expert parallelism was applied "
    "(from_pretrained(..., tp_plan= or distributed_config=)). moe_kernels' ops take whole local tensors and do "
    "not run transformers' sharded experts; load the model without transformers' parallelism to patch it"
)


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _router_of(block: nn.Module):
    """The block's router module: `gate` in most families, `router` in GPT-OSS and Llama 4."""
    gate = block._modules.get("gate")
    return gate if isinstance(gate, nn.Module) else block._modules.get("router")


def _parallel_problem(block: nn.Module) -> str | None:
    """Why a block of a supported class was parallelised in a way patch_hf cannot run, or None."""
    gate, experts = _router_of(block), _experts_of(block)
    if any(_is_dtensor(p) for m in (gate, experts) if isinstance(m, nn.Module) for p in m.parameters()):
        return _SHARDED
    if getattr(experts, "_is_expert_parallel", False):
        return ("holds one rank's experts (transformers' expert parallelism was applied); patch_hf runs whole "
                "models: load the model without transformers' parallelism to patch it")
    return None


def _experts_of(block: nn.Module):
    """The block's experts module, inside any adapter wrappers (peft's ParamWrapper keeps it as base_layer)."""
    experts = getattr(block, "experts", None)
    while isinstance(getattr(experts, "base_layer", None), nn.Module):
        experts = experts.base_layer
    return experts


def _gate_weight(gate: nn.Module):
    """The router's [E, H] weight: its own, or its `proj` Linear's (Gemma 4)."""
    w = getattr(gate, "weight", None)
    return w if isinstance(w, Tensor) else getattr(getattr(gate, "proj", None), "weight", None)


def _gate_top_k(gate: nn.Module) -> int:
    """The router's k: `top_k`, or its config's `top_k_experts` (Gemma 4)."""
    k = getattr(gate, "top_k", None)
    return k if isinstance(k, int) else getattr(getattr(gate, "config", None), "top_k_experts", 0)


def _experts_only(fam: _Family, gate: nn.Module) -> bool:
    """The block's router is one the family leaves on transformers' code (its experts still run ours)."""
    cls = type(gate)
    return cls.__name__ in fam.experts_only_routers and cls.__module__ == fam.module


def _structure_problem(fam: _Family, block: nn.Module, gate_cls: type, experts_cls: type) -> str | None:
    """Why this block of a supported class cannot run on our ops, or None."""
    gate, experts = _router_of(block), _experts_of(block)
    if _base_class(gate) is not gate_cls and not _experts_only(fam, gate):
        return f"its router is a {type(gate).__name__}, not transformers' {gate_cls.__name__}"
    if not isinstance(experts, experts_cls):
        return f"its experts module is a {type(experts).__name__}, not transformers' {experts_cls.__name__}"
    if fam.block_forward is not None:  # the family checks its block whole
        E = getattr(experts, "num_experts", None)
        if not isinstance(E, int) or E < 1 or getattr(block, "num_experts", E) != E:
            return "its experts module has no valid num_experts"
        if not 1 <= getattr(gate, "top_k", 0) <= E:
            return "its router has no valid top_k"
        return fam.problem(gate, block, E)
    if not hasattr(type(experts).forward, "__wrapped__") or not hasattr(experts, "config"):
        return "its experts do not dispatch through transformers' experts interface"
    biased = fam.biased_experts  # GPT-OSS: biases, [E, H, 2F] interleaved gate/up and [E, F, H] weights
    for flag, expected in (("has_bias", biased), ("is_transposed", biased), ("is_concatenated", not biased),
                           ("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(experts, flag, expected) != expected:
            return f"its experts have {flag}={not expected}"
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    wg = _gate_weight(gate)
    if not all(isinstance(t, Tensor) for t in (w13, w2, wg)):
        return "it lacks gate_up_proj/down_proj/router weight tensors (transformers 4.x layout?)"
    if w13.dtype not in _WEIGHT_DTYPES or w2.dtype != w13.dtype:
        return f"its expert weights are {w13.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    E = getattr(experts, "num_experts", None)
    if w13.dim() != 3 or w2.dim() != 3 or wg.dim() != 2:
        return "its weights are not [E, 2F, H] / [E, H, F] / [E, H] (or transposed, with biases)"
    if biased:  # stored [E, K, N]
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        b13, b2 = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
        if not (isinstance(b13, Tensor) and isinstance(b2, Tensor) and tuple(b13.shape) == tuple(w13.shape[:2])
                and tuple(b2.shape) == tuple(w2.shape[:2]) and b13.dtype == b2.dtype == w13.dtype):
            return "its expert biases are not [E, 2F] / [E, H] in the weights' dtype"
    H, F2 = w13.shape[2], w13.shape[1]
    if (w13.shape[0], w2.shape[0], wg.shape[0]) != (E, E, E) or F2 % 2 or tuple(w2.shape[1:]) != (H, F2 // 2) \
            or wg.shape[1] != H:
        return (f"unexpected weight shapes gate_up_proj {tuple(w13.shape)}, down_proj {tuple(w2.shape)}, "
                f"router {tuple(wg.shape)} for {E} experts")
    if not 1 <= _gate_top_k(gate) <= E:
        return "its router has no valid top_k"
    return fam.problem(gate, block, E) if fam.problem is not None else None


def _looks_like_moe(module: nn.Module) -> bool:
    experts = getattr(module, "_modules", {}).get("experts")
    return experts is not None or bool(_MOE_NAME.search(type(module).__name__))


def _scan(model: nn.Module) -> Iterator[tuple[str, nn.Module, _Family | None, str | None]]:
    """(path, block, family or None, problem or None) for every MoE-like block, outermost first; a block's
    own submodules are not visited."""
    from moe_kernels.nn.moe import MoELayer  # already ours

    families = [(fam, classes) for fam in FAMILIES if (classes := _family_classes(fam)) is not None]
    generic = (f"not a supported family (supported with transformers 5.x: {', '.join(SUPPORTED)}, and the families "
               "whose router is the same code as one of theirs)")
    version = getattr(sys.modules.get("transformers"), "__version__", "5")
    if not version.split(".")[0].isdigit() or int(version.split(".")[0]) < 5:
        generic += f"; this is transformers {version}, whose MoE blocks have another layout"

    def visit(module: nn.Module, path: str):
        if isinstance(module, MoELayer):
            return
        for fam, (block_cls, gate_cls, experts_cls) in families:
            if isinstance(module, block_cls) and _router_of(module) is not None:
                yield path, module, fam, _structure_problem(fam, module, gate_cls, experts_cls)
                return
        gate, experts = _router_of(module), _experts_of(module)
        if isinstance(gate, nn.Module) and isinstance(experts, nn.Module):
            fam = _matched_family(_base_class(gate))  # a router with a named family's code
            if fam is not None:
                yield path, module, fam, _structure_problem(fam, module, _base_class(gate), type(experts))
                return
        if _looks_like_moe(module):
            if "experts" not in module._modules:  # named like an MoE block, without experts of its own: what it
                # holds may be (ERNIE-4.5-VL's Ernie4_5_VLMoeMoeBlock: a text and a vision MoE block)
                inner = [item for name, child in module.named_children()
                         for item in visit(child, f"{path}.{name}" if path else name)]
                if any(fam is not None for _, _, fam, _ in inner):
                    yield from inner
                    return
            yield path, module, None, generic
            return
        for name, child in module.named_children():
            yield from visit(child, f"{path}.{name}" if path else name)

    yield from visit(model, "")


# ---------------------------------------------------------------------------------------------------
# Installing and removing forwards


_PATCHED_CLASSES: dict[type, type] = {}  # transformers' router (or block) class -> our subclass


def _patched_class(cls: type, new_forward: Callable) -> type:
    """`MoeKernels<cls>`: transformers' router (or, for Llama 4, block) class with `new_forward` as its forward,
    defined in this module (pickle finds it by name; `__getattr__` below defines it in a fresh process). An
    instance whose class was restored by `unpatch_hf` but that is called through a forward captured while
    patched (a later wrapper) runs transformers' forward."""
    sub = _PATCHED_CLASSES.get(cls)
    if sub is None:

        def forward(self, *args, **kwargs):
            if not isinstance(self, sub):  # restored by unpatch_hf (a subclass made later, FSDP's, stays ours)
                return cls.forward(self, *args, **kwargs)
            return new_forward(self, *args, **kwargs)

        name = f"MoeKernels{cls.__name__}"
        sub = type(name, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                  "_moe_kernels_base": cls})
        _PATCHED_CLASSES[cls] = globals()[name] = sub
    return sub


def __getattr__(name: str):
    """Unpickling a patched model in a fresh process: define the router (or block) subclass it names."""
    if name.startswith("MoeKernels"):
        base = name[len("MoeKernels"):]
        for fam in FAMILIES:
            if fam.block_forward is None and base == fam.gate:
                return _patched_class(getattr(importlib.import_module(fam.module), fam.gate), fam.router_forward)
            if fam.block_forward is not None and base in (fam.block, fam.experts):
                forward = fam.block_forward if base == fam.block else fam.experts_forward
                return _patched_class(getattr(importlib.import_module(fam.module), base), forward)
        cls = _transformers_class(base)
        if cls is not None and (fam := _matched_family(cls)) is not None:
            return _patched_class(cls, fam.router_forward)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _base_class(module: nn.Module) -> type:
    return getattr(type(module), "_moe_kernels_base", type(module))


def _swap_class(module: nn.Module, new_forward: Callable) -> None:
    """module's class becomes its patched subclass (once)."""
    if _PATCH_ATTR in module.__dict__:
        return
    sub = _patched_class(type(module), new_forward)
    saved = None
    # accelerate (device_map / offloading) wraps `forward` in an instance attribute that calls
    # `_old_forward`, bound when the hook was added: point it at our forward, keep the hook.
    if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__:
        saved = module.__dict__["_old_forward"]
        module._old_forward = types.MethodType(sub.forward, module)
    module.__dict__[_PATCH_ATTR] = saved
    module.__class__ = sub


def _install(block: nn.Module, fam: _Family, recipe) -> None:
    if fam.block_forward is not None:  # the block's forward and its experts' (the router stays transformers')
        _swap_class(block, fam.block_forward)
        _swap_class(_experts_of(block), fam.experts_forward)
        return
    gate, experts = _router_of(block), _experts_of(block)
    if not _experts_only(fam, gate):
        _swap_class(gate, fam.router_forward)
    if _PATCH_ATTR not in experts.__dict__:
        experts.__dict__[_PATCH_ATTR] = experts.config._experts_implementation
        experts.config._experts_implementation_internal = EXPERTS_IMPLEMENTATION  # this config only
    experts.__dict__[_RECIPE_ATTR] = recipe


def _uninstall(module: nn.Module) -> bool:
    if DISPATCHER_ATTR in module.__dict__:
        raise ValueError("unpatch_hf: the experts are expert-parallel (each rank holds E / P of them); only "
                         "moe_kernels' experts forward runs them")
    module.__dict__.pop(_RECIPE_ATTR, None)
    if _PATCH_ATTR not in module.__dict__:
        return False
    saved = module.__dict__.pop(_PATCH_ATTR)
    if type(module) in _PATCHED_CLASSES.values():  # a router (or a block)
        module.__class__ = _base_class(module)
        if saved is not None:
            module._old_forward = saved
    elif module.config._experts_implementation == EXPERTS_IMPLEMENTATION:  # experts: unless changed since
        module.config._experts_implementation_internal = saved
    return True


def register_experts_implementation() -> bool:
    """Register `moe_kernels_experts_forward` as "moe_kernels" in transformers' ExpertsInterface (the experts
    only; transformers' router stays). Returns False when this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moe_kernels_experts_forward)
    return True


def _patched_blocks(model: nn.Module) -> list[str]:
    """Paths of the blocks whose own forward patch_hf replaced (Llama 4's)."""
    subs = tuple(_PATCHED_CLASSES.values())
    blocks = tuple(classes[0] for f in FAMILIES if f.block_forward is not None and (classes := _family_classes(f)))
    return [name or "<root>" for name, m in model.named_modules()
            if blocks and isinstance(m, blocks) and isinstance(m, subs)]


def is_patched(module: nn.Module) -> bool:
    """Whether any submodule of `module` runs a moe_kernels forward installed by `patch_hf`."""
    return any(type(m) in _PATCHED_CLASSES.values() or (
        _PATCH_ATTR in m.__dict__ and m.config._experts_implementation == EXPERTS_IMPLEMENTATION)
        for m in module.modules())


def patch_hf(model: nn.Module, *, recipe=None) -> nn.Module:
    """Run every supported MoE block of a transformers model on moe_kernels' ops, in place; returns `model`.

    Supported (transformers 5.x): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, Qwen3-VL-MoE, MiniMax-M2,
    DeepSeek-V2, DeepSeek-V4, GPT-OSS, ERNIE-4.5, Mistral 4, Mistral Large 4, Gemma 4, Llama 4 (its block's
    forward: see the module docstring), and
    every family whose router has one of their routers' code (`_matched_family`: GLM-4.5, Qwen3-Next,
    Qwen3.5-MoE, Kimi-Linear, ...; `matched_routers()` lists them). Each block keeps its
    parameters, its router module and its own forward; only the router's and the experts' forwards change
    (see the module docstring). Other MoE-like blocks are left alone and listed in one warning. Patching a
    patched model changes nothing but the recipe; `unpatch_hf` undoes it.

    recipe: a moe_kernels.quant recipe (Fp8BlockwiseRecipe(), Nvfp4Recipe()) for the routed experts' GEMMs
    (their weights stay as they are; quantization happens in each GEMM), or None for the model's precision.
    Only patch_hf applies a recipe: the experts implementation registered as "moe_kernels" (for
    `experts_implementation=`) runs at the model's precision.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_hf: expected a torch.nn.Module, got {type(model).__name__}")
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe

    if recipe is not None and not isinstance(recipe, (Fp8BlockwiseRecipe, Nvfp4Recipe)):
        raise TypeError(f"patch_hf: `recipe` must be an Fp8BlockwiseRecipe() or Nvfp4Recipe() instance or None, got "
                        f"{recipe!r}")
    register_experts_implementation()
    found = list(_scan(model))
    for path, block, fam, _ in found:  # refused before anything is patched: such a model would fail later
        if fam is not None and (problem := _parallel_problem(block)) is not None:
            raise ValueError(f"patch_hf: the MoE block at {path or '<root>'} {problem}")
    if recipe is not None:  # every block must fit the recipe before any is patched
        for path, block, fam, problem in found:
            if fam is not None and problem is None:
                experts = _experts_of(block)
                where = f"patch_hf: the MoE block at {path or '<root>'} does not fit the recipe"
                if fam.biased_experts or fam.block_forward is not None:
                    raise ValueError(f"{where}: {fam.name}'s experts (stored [E, K, N]) run at the model's precision "
                                     "only")
                F_, H = experts.down_proj.shape[-1], experts.gate_up_proj.shape[-1]
                try:
                    recipe.check_shapes(H, F_)
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
                if experts.gate_up_proj.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"{where}: its expert weights are {experts.gate_up_proj.dtype}; the recipes "
                                     "quantize fp32, bf16 or fp16")
    patched, skipped = 0, {}
    for path, block, fam, problem in found:
        if fam is not None and problem is None:
            _install(block, fam, recipe)
            patched += 1
        else:
            skipped.setdefault((type(block).__name__, problem), []).append(path or "<root>")
    if skipped:
        lines = []
        for (cls, problem), paths in skipped.items():
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")
            lines.append(f"  {cls} at {shown}: {problem}")
        warnings.warn(
            f"moe_kernels.patch_hf: left {sum(map(len, skipped.values()))} MoE block(s) on transformers' code "
            f"(unsupported):\n" + "\n".join(lines),
            UserWarning,
            stacklevel=2,
        )
    elif not patched:
        warnings.warn(f"moe_kernels.patch_hf: found no MoE blocks in {type(model).__name__}", UserWarning, stacklevel=2)
    from moe_kernels.integrations.peft import fuse_lora

    fuse_lora(model)  # peft LoRA on the patched experts: grouped low-rank GEMMs instead of W + BA
    return model


def unpatch_hf(model: nn.Module) -> nn.Module:
    """Undo `patch_hf`: every patched router and experts module runs transformers' forward again. Returns `model`."""
    for module in model.modules():
        _uninstall(module)
    return model


# "moe_kernels" is a valid experts implementation as soon as both moe_kernels and transformers' experts
# interface are imported, in either order (from_pretrained(..., experts_implementation="moe_kernels") and
# models unpickled in a fresh process name it). Importing transformers here would add seconds to every
# `import moe_kernels`, so when it is not loaded yet a post-import hook registers it right after
# transformers.integrations.moe has executed.
_INTERFACE_MODULE = "transformers.integrations.moe"


def _register_after_import() -> None:
    try:
        register_experts_implementation()
    except Exception as exc:  # never break transformers' import
        warnings.warn(f"moe_kernels: could not register the 'moe_kernels' experts implementation: {exc!r}",
                      UserWarning, stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then registers our experts implementation. Everything else is the real loader's."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _remove_import_hook()
        _register_after_import()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds transformers.integrations.moe through the other finders and wraps its loader."""

    def find_spec(self, name, path, target=None):
        if name != _INTERFACE_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _remove_import_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ImportHook)]


def _install_import_hook() -> None:
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


if _INTERFACE_MODULE in sys.modules:
    register_experts_implementation()
else:
    _install_import_hook()
