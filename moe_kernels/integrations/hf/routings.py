"""The routers' forwards on `router_topk`, one per routing, and each family's check of its router's settings.

Routing per family (transformers 5.x code -> router_topk; verified in tests/integrations/test_hf.py):

- Mixtral: softmax over all E, top-k, renormalise == score="softmax", pre_softmax=False (softmax over the k
  selected logits; selection by logits == selection by probabilities). Weights stay fp32.
- Qwen2-MoE, Qwen3-MoE, OLMoE: softmax over all E (fp32), top-k, renormalised only with `norm_topk_prob`:
  norm_topk_prob=False == pre_softmax=True; True == pre_softmax=False. transformers then casts the weights to
  the logits' dtype; so do we (a [T, k] cast) so bf16 models round the same way.
- DeepSeek-V3: fp32 logits (the router upcasts input and weight), sigmoid, selection by sigmoid +
  e_score_correction_bias, n_group/topk_group group limit where a group's score is the sum of its top 2
  selection scores (group_score_topk=2), weights normalised (+1e-20) only with norm_topk_prob, times
  routed_scaling_factor. Refused where top_k exceeds the kept groups' experts but not all E (transformers fills the
  slots with dropped experts in torch.topk's tie order).
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
- Gemma 4 (`Gemma4TextDecoderLayer` is the block, its `router` and `experts` children; DiffusionGemma's layers by
  their router's code): the router's own norm,
  scales and projection, the fp32 softmax over all E it returns, top-k by probability renormalised over the k
  (router_topk's softmax over the k chosen logits), times each chosen expert's learned per_expert_scale.
- ERNIE-4.5 (and ERNIE-4.5-VL's text and vision experts, by their code): fp32 logits, selection by the softmax
  over all E + moe_statics' e_score_correction_bias == score="softmax", pre_softmax=True, expert_bias; the chosen
  probabilities over their sum == normalize=True (the softmax over the k chosen logits); cast to the input dtype.
- Granite-MoE (and Granite 4.0's hybrid, shared-expert and sliding-window models by their code), Cohere2-MoE with
  expert_selection_fn "softmax": top-k by logit, softmax over the k (Mixtral's routing; Granite's on fp32 logits),
  cast to the input's dtype. Cohere2-MoE with "sigmoid": top-k by logit, their sigmoids, over their sum with
  norm_topk_prob.
- Jamba: softmax over all E, top-k, never renormalised. HunYuan-MoE-V1: its `wg` Linear (fp32 input where `wg` is
  fp32), softmax over all E, top-k, renormalised.
- LFM2-MoE: sigmoid, selection by score + the block's expert_bias (use_expert_bias), weights over their sum + 1e-6
  (norm_topk_prob; taken outside router_topk, whose own normalisation adds 1e-20), times routed_scaling_factor. In
  bf16, experts whose rounded scores tie may be picked the other way (transformers' sigmoids are in bf16).
- AFMoE, HY-V3: fp32 logits, sigmoid, selection by score + the block's bias (AFMoE's expert_bias, HY-V3's
  e_score_correction_bias), weights over their sum + 1e-20, times route_scale / router_scaling_factor.
- Laguna: fp32 logits soft-capped (tanh(l / c) c, moe_router_logit_softcapping > 0), sigmoid, selection by score
  + e_score_correction_bias, renormalised; the block scales the experts' output.
- MiniCPM5-MoE: DeepSeek-V3's routing, autocast off. AXK2's light checkpoints (num_group None): DeepSeek-V3's
  without a group limit (AXK2's group limit scores the dropped groups' experts 0: refused). Beam: DeepSeek-V3's
  without the scaling (the block scales).
- Lara-Mini: Qwen's on fp32 logits. Flint: fp32 sigmoid, no bias, renormalised with norm_topk_prob.
- Longcat-Flash: fp32 logits over the routed and zero-computation experts, softmax over all, selection by
  probability + e_score_correction_bias, not renormalised, scaled (the block passes the zero experts' share).
- Aria: top-k by logit, softmax over the k, in the logits' dtype (its experts are stored [E, K, N]).
- Inkling2: fp32, sigmoid or sqrt-softplus, selection by score + bias, renormalised, scaled. MiniMax-M3 (and
  Step-3.7 by its code): sigmoid, selection by score + the router's bias, renormalised, fp32.
- Ergo: fp32 logits (its own Linear), sigmoid, selection by score + the router's e_score_correction_bias, weights
  over their sum + 1e-20, times routed_scaling_factor, rounded to the input's dtype. Its experts (no gate, stored
  [E, K, N]) apply an RMSNorm per expert before the routing weights.
- DBRX: its router (DbrxRouter's Linear, with its jitter in training) and routing (softmax in the logits' dtype,
  top-k, over the chosen weights' p-norm) stay transformers'; its experts run ours (`dbrx_problem` checks them).
- Every other family whose router class has one of these routers' code (`_matched_family`: the same `forward`
  source text and the same objects behind its global names, in the installed transformers) routes as that
  family: GLM-4.5, Dots1, Kimi-Linear, DeepSeek-V3.2 (DeepSeek-V3's), Qwen3-Next, FlexOlmo (Qwen2-MoE's),
  MiniMax (Mixtral's), Qwen3.5-MoE (Qwen3-VL-MoE's), ERNIE-4.5-VL (ERNIE-4.5's), ...; `matched_routers()` lists
  them.

"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_kernels.nn.lora import EXPERT_RANGE_ATTR
from moe_kernels.ops.router import router_topk

from .common import _WEIGHT_DTYPES, _experts_of, _is_dbrx_glu


def mixtral_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # [T, E], as transformers computes (and records) them
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights, indices.long()  # int64, as transformers' routers return (eager experts need it)


def qwen_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen2-MoE, Qwen3-MoE and OLMoE routers (the same transformers code)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=not self.norm_topk_prob)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def _deepseek_v3_routing(self: nn.Module, router_logits: Tensor, scaling_factor: float) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's top-k on its router's attributes: sigmoid, selection by score + e_score_correction_bias, the
    n_group / topk_group group limit (a group scored by its top-2 selection scores; none where num_group is None or
    1), weights over their sum + 1e-20 with norm_topk_prob, times scaling_factor."""
    G = self.num_group or 1  # AXK2's light checkpoints: num_group None, no group limit
    grouped = G > 1
    return router_topk(
        router_logits,
        self.top_k,
        score="sigmoid",
        num_groups=G if grouped else None,
        group_topk=self.topk_group if grouped else None,
        # transformers: group score = sum of the group's top-2 (bias-corrected) scores, whatever k and topk_group
        group_score_topk=min(2, self.num_experts // G) if grouped else None,
        scaling_factor=scaling_factor,
        expert_bias=self.e_score_correction_bias.float(),  # a buffer, fp32 in transformers; selection only
        normalize=bool(self.norm_topk_prob),
    )


def deepseek_v3_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    # transformers routes in fp32: it upcasts the input and the weight (a transient copy of the [E, H] weight for
    # a bf16 model, as in its own forward).
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = _deepseek_v3_routing(self, router_logits, float(self.routed_scaling_factor))
    return router_logits, weights, indices.long()  # int64, as transformers' routers return (eager experts need it)


def beam_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Beam: DeepSeek-V3's routing without its scaling (the block scales the experts' output)."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = _deepseek_v3_routing(self, router_logits, 1.0)
    return router_logits, weights, indices.long()


def qwen_normalized_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3-VL-MoE, Qwen3.5-MoE and Qwen3-Omni's text routers: Qwen's routing, always renormalised."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def minimax_m2_router_forward(
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


def deepseek_v2_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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


def gpt_oss_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GPT-OSS: biased logits, top-k by logit, softmax over the k (transformers takes it in the logits' dtype,
    router_topk in fp32 rounded to it: in bf16 the two differ by at most one rounding)."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def _autocast_off(t: Tensor):
    """Autocast disabled on t's device (nothing to disable on meta)."""
    device_type = t.device.type
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)


def ernie_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ERNIE-4.5: fp32 logits (autocast off), selection by the softmax over all E plus moe_statics'
    e_score_correction_bias, weights the chosen probabilities over their sum (router_topk takes the softmax over the
    k chosen logits, the same quotient; transformers clamps the sum at moe_norm_min, 1e-12 by default, which only
    differs where the k chosen probabilities sum below it), in the input's dtype."""
    with _autocast_off(hidden_states):
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


def deepseek_v4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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


def mistral4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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


def mistral_large4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mistral Large 4: Mistral 4's routing on fp32 logits, always renormalised; fp32 weights."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=True,
                                   **_mistral4_groups(self), scaling_factor=float(self.routed_scaling_factor),
                                   normalize=True)
    return router_logits, weights, indices.long()


def gemma4_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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


def granite_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Granite-MoE (and Granite 4.0's hybrid, shared and sliding-window models, by their code): logits in the
    model's dtype, then fp32; top-k by logit, softmax over the k (== Mixtral's routing), cast to the input's dtype."""
    router_logits = F.linear(hidden_states, self.weight).float()
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(hidden_states.dtype), indices.long()


def jamba_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Jamba: softmax over all E (fp32), top-k, never renormalised (== Qwen's routing without norm_topk_prob), cast
    to the input's dtype."""
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=True)
    return router_logits, weights.to(hidden_states.dtype), indices.long()


def hunyuan_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """HunYuan-MoE-V1 (Hunyuan-A13B): its `wg` Linear (fp32 in the checkpoints: the input is upcast for it), softmax
    over all E, top-k, renormalised == the softmax over the k chosen logits; cast to the logits' dtype."""
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if self.wg.weight.dtype == torch.float32:
        hidden_states = hidden_states.float()
    router_logits = self.wg(hidden_states)  # the module called, as transformers calls it (its hooks run)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def lfm2_router_forward(self: nn.Module, hidden_states: Tensor, expert_bias: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """LFM2-MoE: sigmoid scores, selection by score + the block's expert_bias (passed in by the block) where
    use_expert_bias, weights the chosen scores over their sum + 1e-6 with norm_topk_prob (the quotient taken here:
    router_topk's own adds 1e-20), times routed_scaling_factor, in the logits' dtype. transformers takes the
    sigmoids in the logits' dtype, router_topk in fp32 from the same logits: in bf16 or fp16, experts whose rounded
    scores tie (frequent: bf16 keeps 8 bits) may be picked the other way."""
    router_logits = F.linear(hidden_states, self.weight)
    bias = expert_bias.float() if self.use_expert_bias else None
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid", expert_bias=bias, normalize=False)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    weights = weights * self.routed_scaling_factor
    return router_logits, weights.to(router_logits.dtype), indices.long()


def afmoe_router_forward(self: nn.Module, hidden_states: Tensor, expert_bias: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """AFMoE (Arcee): its `gate` Linear, fp32 logits, sigmoid scores, selection by score + the block's expert_bias
    (passed in by the block), weights over their sum + 1e-20, times route_scale, fp32."""
    hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
    router_logits = self.gate(hidden_states).to(torch.float32)  # the module called (its hooks run)
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid", expert_bias=expert_bias.float(),
                                   normalize=True, scaling_factor=float(self.route_scale))
    return router_logits, weights, indices.long()


def cohere2_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cohere2-MoE: top-k by logit, then the softmax over the k (expert_selection_fn "softmax", == Mixtral's routing)
    or the k logits' sigmoids ("sigmoid"; over their sum with norm_topk_prob), cast to the input's dtype. The sigmoid
    weights are taken here, in the logits' dtype as transformers takes them, from router_topk's picks by logit (its
    own sigmoid ranks by fp32 sigmoids, which tie at 1.0 for logits past about 17)."""
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    if self.expert_selection_fn == "sigmoid":
        weights = router_logits.gather(1, indices.long()).sigmoid()
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(hidden_states.dtype), indices.long()


def hy_v3_router_forward(self: nn.Module, hidden_states: Tensor, e_score_correction_bias: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """HY-V3: fp32 logits, sigmoid scores, selection by score + the block's e_score_correction_bias (passed in by
    the block), weights over their sum + 1e-20, times router_scaling_factor, fp32."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid",
                                   expert_bias=e_score_correction_bias.float(), normalize=True,
                                   scaling_factor=float(self.router_scaling_factor))
    return router_logits, weights, indices.long()


def laguna_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Laguna: logits in the model's dtype, then fp32, soft-capped (tanh(l / c) c) where
    moe_router_logit_softcapping > 0; sigmoid scores, selection by score + e_score_correction_bias, weights over
    their sum (router_topk adds 1e-20 to it), cast to the input's dtype. The block scales the experts' output."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight).float()
    cap = self.router_logit_softcapping
    if cap > 0.0:
        router_logits = torch.tanh(router_logits / cap) * cap
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid",
                                   expert_bias=self.e_score_correction_bias.float(), normalize=True)
    return router_logits, weights.to(hidden_states.dtype), indices.long()


def minicpm5_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """MiniCPM5-MoE: DeepSeek-V3's routing with autocast off around the fp32 logits."""
    with _autocast_off(hidden_states):
        return deepseek_v3_router_forward(self, hidden_states)


def lara_mini_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Lara-Mini: Qwen's routing on fp32 logits (softmax over all E, top-k, renormalised with norm_topk_prob), cast
    to the input's dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=not self.norm_topk_prob)
    return router_logits, weights.to(hidden_states.dtype), indices.long()


def flint_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flint: fp32 logits (autocast off), sigmoid scores, no bias, top-k, over their sum with norm_topk_prob
    (router_topk adds 1e-20 to it), fp32."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    with _autocast_off(hidden_states):
        router_logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid", normalize=bool(self.norm_topk_prob))
    return router_logits, weights, indices.long()


def inkling2_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Inkling2: fp32 input, its score_fn (sigmoid or sqrt-softplus), selection by score + e_score_correction_bias,
    weights over their sum + 1e-20, times routed_scaling_factor, fp32."""
    flat = hidden_states.float().reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    weights, indices = router_topk(logits, self.top_k, score=_deepseek_v4_score(self),
                                   expert_bias=self.e_score_correction_bias.float(), normalize=True,
                                   scaling_factor=float(self.routed_scaling_factor))
    return logits, weights, indices.long()


def minimax_m3_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """MiniMax-M3 (and Step-3.7, by its code): logits at the router weight's dtype, fp32 sigmoid scores, selection
    by score + the router's e_score_correction_bias, weights over their sum (router_topk adds 1e-20 to it), fp32."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid",
                                   expert_bias=self.e_score_correction_bias.float(), normalize=True)
    return router_logits, weights, indices.long()


def aria_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Aria: top-k by logit, softmax over the k (transformers takes it in the logits' dtype, router_topk in fp32
    rounded to it: in bf16 the two differ by at most one rounding)."""
    router_logits = F.linear(hidden_states, self.weight)
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=False)
    return router_logits, weights.to(router_logits.dtype), indices.long()


def ergo_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Ergo: fp32 logits from its own `linear` (ErgoLinearWithFP32Output, called: its rounding and hooks), sigmoid
    scores, selection by score + the router's e_score_correction_bias, weights over their sum (+1e-20) times
    routed_scaling_factor, rounded to the input's dtype and returned in fp32, as transformers returns them."""
    hidden_states = hidden_states.reshape(-1, self.linear.in_features)
    router_logits = self.linear(hidden_states)
    weights, indices = router_topk(router_logits, self.top_k, score="sigmoid",
                                   expert_bias=self.e_score_correction_bias.float(), normalize=True,
                                   scaling_factor=float(self.routed_scaling_factor))
    return router_logits, weights.to(hidden_states.dtype).float(), indices.long()


def longcat_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Longcat-Flash: fp32 logits over the routed and the zero-computation experts (its classifier's weight; its
    bias, where it has one, unused, as in transformers), softmax over all, selection by probability +
    e_score_correction_bias, never renormalised, times routed_scaling_factor. The block sends the zero-computation
    picks' share of each token through as is."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.classifier.weight.float())
    weights, indices = router_topk(router_logits, self.top_k, score="softmax", pre_softmax=True,
                                   expert_bias=self.e_score_correction_bias.float(),
                                   scaling_factor=float(self.routed_scaling_factor))
    return router_logits, weights.to(router_logits.dtype), indices.long()

# Per-family checks of the router's settings (gate, block, E) -> why it cannot run on router_topk, or None.


def mistral4_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    G, g = gate.num_group, gate.topk_group
    if G > 1:
        if E % G or not 1 <= g <= G or E // G < 2:
            return f"n_group={G}, topk_group={g} do not fit {E} experts (groups of at least 2)"
        if gate.top_k > g * (E // G):
            # transformers then also picks experts of dropped groups, at score 0; router_topk ranks them -inf
            return f"top_k={gate.top_k} exceeds the {g * (E // G)} experts of the topk_group={g} kept groups"
    return None


def deepseek_v4_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    if _deepseek_v4_score(gate) is None:
        return f"its router scores with {type(gate.score_fn).__name__} (router_topk runs sqrt-softplus and sigmoid)"
    if type(gate).__name__ in ("DeepseekV4HashRouter",):  # transformers' router stays (hash routing)
        return None
    bias = getattr(gate, "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return "its router has no [E] e_score_correction_bias"
    return None


def deepseek_v3_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    bias = getattr(gate, "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return "its router has no [E] e_score_correction_bias"
    G, g = gate.num_group or 1, gate.topk_group
    if G > 1:
        if E % G or not 1 <= g <= G:
            return f"n_group={G}, topk_group={g} do not fit {E} experts"
        if g * (E // G) < gate.top_k < E:
            # transformers then fills the remaining slots with experts of dropped groups (all at -inf: which ones
            # is torch.topk's tie order) at their sigmoid weights; k = E takes every expert either way
            return f"top_k={gate.top_k} exceeds the {g * (E // G)} experts of the topk_group={g} kept groups"
    return None


def axk2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    if (gate.num_group or 1) > 1:
        # AXK2 fills the dropped groups' selection scores with 0, not -inf: where a kept expert's score + bias is
        # below 0, a dropped expert outranks it. router_topk drops the groups outright.
        return (f"its group limit (n_group={gate.num_group}) scores the dropped groups' experts 0, which outranks "
                "kept experts whose score + bias is negative (router_topk drops them); its light checkpoints "
                "(n_group None) run")
    return deepseek_v3_problem(gate, block, E)


def minimax_m2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    bias = getattr(block, "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return "the block has no [E] e_score_correction_bias"
    return None


def ernie_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    bias = getattr(getattr(gate, "moe_statics", None), "e_score_correction_bias", None)
    if not isinstance(bias, Tensor) or bias.numel() != E or bias.dim() > 2 or bias.shape[-1] != E:
        return "its router's moe_statics has no [1, E] e_score_correction_bias (one group of experts)"
    return None


def llama4_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    """Llama4TextMoe: a bias-free nn.Linear router, experts [E, H, 2F] (gate then up columns) and [E, F, H]."""
    experts = _experts_of(block)
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(w13, Tensor) and isinstance(w2, Tensor) and w13.dim() == 3 and w2.dim() == 3):
        return "its experts lack [E, H, 2F] gate_up_proj / [E, F, H] down_proj tensors"
    if w13.dtype not in _WEIGHT_DTYPES or w2.dtype != w13.dtype:
        return f"its expert weights are {w13.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    H, F2 = w13.shape[1], w13.shape[2]
    held = experts.__dict__.get(EXPERT_RANGE_ATTR, (0, E, E))[1]  # an expert-parallel rank's experts: E / P
    if gate.bias is not None or tuple(gate.weight.shape) != (E, H) or w13.shape[0] != held or F2 % 2 \
            or tuple(w2.shape) != (held, F2 // 2, H) or getattr(block, "hidden_dim", None) != H:
        return (f"unexpected shapes: router {tuple(gate.weight.shape)} (bias {gate.bias is not None}), gate_up_proj "
                f"{tuple(w13.shape)}, down_proj {tuple(w2.shape)} for {E} experts")
    if not isinstance(getattr(block, "shared_expert", None), nn.Module):
        return "it has no shared_expert"
    return None


def dbrx_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    """DbrxFFN: a bias-free Linear router [E, H] and transformers' DbrxExpertGLU holding w1, v1 and w2 [E * F, H]
    of one float dtype. A GLU module inside an adapter wrapper (peft's LoRA on those stacked [E * F, H] weights is not
    per expert) stays transformers'."""
    experts = _experts_of(block)
    mlp = getattr(experts, "mlp", None)
    if not _is_dbrx_glu(mlp):
        return (f"its experts' mlp is a {type(mlp).__name__}, not transformers' DbrxExpertGLU (adapters on DBRX's "
                "stacked expert weights are not fused)")
    F_, H = getattr(experts, "ffn_hidden_size", None), getattr(experts, "hidden_size", None)
    ws = [getattr(mlp, n, None) for n in ("w1", "v1", "w2")]
    if not all(isinstance(w, Tensor) for w in ws) or not isinstance(F_, int) or not isinstance(H, int):
        return "its experts lack w1 / v1 / w2 tensors"
    if ws[0].dtype not in _WEIGHT_DTYPES or any(w.dtype != ws[0].dtype for w in ws):
        return (f"its expert weights are {'/'.join(str(w.dtype) for w in ws)} (quantised?); grouped_mm takes "
                "fp32/bf16/fp16")
    layer = getattr(gate, "layer", None)
    held = experts.__dict__.get(EXPERT_RANGE_ATTR, (0, E, E))[1]  # an expert-parallel rank's experts: E / P
    if (any(tuple(w.shape) != (held * F_, H) for w in ws) or not isinstance(layer, nn.Linear)
            or layer.bias is not None or tuple(layer.weight.shape) != (E, H)):
        return (f"unexpected shapes: w1 / v1 / w2 {', '.join(str(tuple(w.shape)) for w in ws)} for {held} experts of "
                f"F {F_}, H {H}, router {type(layer).__name__}")
    return None


def deepseek_v2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
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


def _bias_problem(bias, E: int, where: str) -> str | None:
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (E,):
        return f"{where} has no [{E}] expert bias"
    return None


def lfm2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    if not gate.use_expert_bias:
        return None
    return _bias_problem(getattr(block, "expert_bias", None), E, "the block")


def afmoe_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _bias_problem(getattr(block, "expert_bias", None), E, "the block")


def hy_v3_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _bias_problem(getattr(block, "e_score_correction_bias", None), E, "the block")


def laguna_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _bias_problem(getattr(gate, "e_score_correction_bias", None), E, "its router")


def cohere2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    fn = getattr(gate, "expert_selection_fn", None)
    if fn not in ("softmax", "sigmoid"):
        return f"its router's expert_selection_fn={fn!r} (transformers runs 'softmax' and 'sigmoid')"
    return None


def inkling2_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    if _deepseek_v4_score(gate) is None:
        return f"its router scores with {type(gate.score_fn).__name__} (router_topk runs sqrt-softplus and sigmoid)"
    return _bias_problem(getattr(gate, "e_score_correction_bias", None), E, "its router")


def minimax_m3_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _bias_problem(getattr(gate, "e_score_correction_bias", None), E, "its router")


def ergo_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    """ErgoMoE: a bias-free [E, H] router Linear with an [E] selection bias; experts without a gate stored [E, K, N]
    (up_proj [E, H, F], down_proj [E, F, H], one float dtype) with an act_fn, and transformers' ErgoExpertNorm
    (a weight row per expert, [E, H]) after them."""
    experts = _experts_of(block)
    linear = getattr(gate, "linear", None)
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return f"its router's projection is a {type(linear).__name__}, not a bias-free Linear"
    H = linear.in_features
    if tuple(linear.weight.shape) != (E, H):
        return f"its router's weight is {tuple(linear.weight.shape)}, not [{E}, {H}]"
    if not isinstance(getattr(gate, "routed_scaling_factor", None), (int, float)):
        return "its router has no numeric routed_scaling_factor"
    bias = _bias_problem(getattr(gate, "e_score_correction_bias", None), E, "its router")
    if bias is not None:
        return bias
    norm_cls = getattr(sys.modules.get(type(block).__module__), "ErgoExpertNorm", None)
    norm = experts._modules.get("post_expert_norm")
    if norm_cls is None or type(norm) is not norm_cls:
        return f"its experts' post_expert_norm is a {type(norm).__name__}, not transformers' ErgoExpertNorm"
    if not isinstance(norm.weight, Tensor) or tuple(norm.weight.shape) != (E, H):
        return f"its experts' norm weight is {tuple(norm.weight.shape)}, not [{E}, {H}]"
    w1, w2 = getattr(experts, "up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(w1, Tensor) and isinstance(w2, Tensor)) or not callable(getattr(experts, "act_fn", None)):
        return "its experts lack up_proj / down_proj tensors or an act_fn"
    if w1.dtype not in _WEIGHT_DTYPES or w2.dtype != w1.dtype:
        return f"its expert weights are {w1.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    held = experts.__dict__.get(EXPERT_RANGE_ATTR, (0, E, E))[1]  # an expert-parallel rank's experts: E / P
    if w1.dim() != 3 or tuple(w1.shape[:2]) != (held, H) or tuple(w2.shape) != (held, w1.shape[2], H):
        return (f"unexpected shapes: up_proj {tuple(w1.shape)}, down_proj {tuple(w2.shape)} for {held} experts of "
                f"H {H}")
    return None


def longcat_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _bias_problem(getattr(gate, "e_score_correction_bias", None), E + block.zero_expert_num, "its router")
