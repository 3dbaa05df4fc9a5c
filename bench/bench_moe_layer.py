"""The full MoE layer, forward and forward+backward, at the specs/perf.md shapes.

Ours: moe_kernels.nn.MoELayer(PRESETS[model]()) with bf16 expert (and shared-expert) weights and the
router in fp32 (Router keeps its weight and logits fp32), in training mode, called on x [1, T, H] bf16
(T in {4096, 8192, 16384}, 8192 with --quick; x and dout from input set i's own seed, ctx.seed + 1000 + i,
apart from the weights' ctx.seed; x as the routing case below). Every model holds all of its routed experts
on the one GPU (EP = 1) and routes over all of them: deepseek-v3 keeps E = 256 (perf.md's EP = 8 would
leave 32 per GPU, but one layer's routing is the full 256-way routing). Only where our forward+backward
would not fit the free GPU memory is the expert count halved (never below perf.md's E/EP), and the
result's `setup` and a `note:` line say so. DeepSeek-V3's expert bias is drawn ~ N(0, 0.02^2) so it
shifts the selection.
Routing, two cases per model and T (case name <model>/T<T>/<routing>), made by the inputs alone, so that
every implementation (same weights) routes them the same way through its own router:
  uniform  x ~ randn: a random router spreads the tokens about evenly.
  zipf     x = randn + v, one shift v [H] for every token and input set of the model: the least-norm v
           with W v = b (W the fp32 router weight [E, H], solved in fp64), so it adds b_e to expert e's
           logit. Over a seeded random permutation of the experts, rank r gets b = 0.5 x ln(r^-1.2)
           standard deviations of its logit (||W[e]||, its std for x ~ randn): with Gaussian logits this
           gives top-1 shares close to Zipf's 1/r^1.2 at E = 128..256 (a few hot experts). The coldest
           eighth of the ranks (at least one expert, leaving at least k) get b = -6 standard deviations,
           past reach of the others' noise, and receive no tokens, so empty experts are included. The
           hottest expert's logit is unshifted. Measured with the fp32 router at T = 8192 (CPU): the
           busiest expert takes 52-72% of the tokens (11-17x the mean load) at E = 128 and 256, with E/8
           experts empty and half of the routed tokens on 8-17 experts; mixtral-8x7b (E = 8, k = 2) 56%
           (2.3x), one empty; uniform: 4-26%, 1.0-2.4x, none empty. x's rms grows from 1 to 1.0-1.3.
  Each result records `routing` and `routing_skew`, measured with our router on the case's first input
  set: max_expert_frac (fraction of the T tokens routed to the busiest expert), max_over_mean (its
  tokens / the mean T*k/E), empty_experts, experts_for_half (fewest experts receiving half of the T*k
  routed tokens); a `note:` line per model lists them.
Ops, each timed per model, T and routing:
  moe_layer_fwd      out, aux = layer(x)                     (autograd recording, as in training)
  moe_layer_fwd_bwd  the forward, then torch.autograd.grad of (out, aux) with grad (dout, 1) for x and
                     every parameter (ours and torch_native include their aux loss; the Hugging Face
                     blocks compute none: their model adds it outside the block).
Peers, timed in the same run, on the same inputs, with the same weights (the very same parameter tensors,
shared, so deepseek-v3's 22.5 GB of experts exist once):
  torch_native   MoELayer(backend="torch"): fp32 router with softmax/sigmoid + topk + gather, argsort
                 dispatch, torch._grouped_mm experts, fp32 index_add_ combine (moe_kernels/nn/torch_native.py).
  hf_eager       the Hugging Face block of the family (Qwen3MoeSparseMoeBlock for the qwen3 shapes,
  hf_grouped_mm  DeepseekV3MoE for deepseek-v3, MixtralSparseMoeBlock for mixtral-8x7b), built on the meta
                 device from a transformers config of the same sizes and routing, its experts'
                 `gate_up_proj` [E, 2F, H] (gate rows first) and `down_proj` [E, H, F] set to our w13 and
                 w2, DeepSeek-V3's shared expert to ours, and the experts implementation chosen through
                 the config (`experts_implementation=` -> config._experts_implementation, read by the
                 experts' forward at every call through transformers' ExpertsInterface): "eager" (the
                 per-expert loop) and "grouped_mm" (torch.nn.functional.grouped_mm / torch._grouped_mm,
                 transformers' default). Router weight: DeepSeek-V3's router computes in fp32 and gets
                 our fp32 weight (and expert bias); the Qwen3-MoE and Mixtral routers compute their logits
                 in the weight's dtype, so they get our weight rounded to bf16 (how transformers runs a
                 bf16 model) and may route a few near-tie tokens differently. The eager loop indexes
                 `gate_up_proj[e]` per hit expert, so its backward materialises and sums a full-size
                 weight gradient per expert (E x the weights' bytes): that is what "eager" costs in
                 training, and at deepseek-v3's size its slowest and most memory-hungry part.
                 gpt-oss-120b has no Hugging Face peer: its experts add biases and use a clamped SwiGLU,
                 another function.
Checked before timing, per case (each routing) and peer, on the case's first input set: the tokens
whose top-k expert set agrees with ours (near-ties may route differently; the fraction is recorded, and
must be >= 99% for an fp32 router, >= 90% for a bf16 one); on them, the output within bf16 precision;
then one forward+backward with dout zeroed on the other tokens, and dx, the router weight's gradient,
w13's and w2's on CHECK_EXPERTS experts (the busiest half and the least loaded half by our router's
counts, so empty experts are among them where there are any) and the shared experts' within the same
precision; torch_native's aux loss within rtol 1e-3.
"Within bf16 precision" (against ours): relative L2 error <= 2^-6, and |peer - ours| <= 2^-5 x s +
1.6e-2 x |ours| on all but 1e-4 of the elements, none beyond 4x that. s is the larger of rms(ours) and
the element's local rms: ours viewed as [B, R, C] (the last two dims; B = the expert for the
expert-weight gradients), sqrt(ms(its row) x ms(its column) / ms(its slice)), ms the mean square within
its slice (none for a vector). The local term matters only where the tensor is uneven (zipf: the hot experts' gradients,
and the input features along the shift, whose rounding errors are as large as they are); on uniform
inputs s is about rms(ours). The slack is for the Hugging Face blocks' bf16 router logits and routing
weights and their bf16 accumulation over the k experts (measured on the CPU at the qwen3-30b-a3b shape,
1024 tokens, both routings: relative L2 error <= 8e-3, a few elements in 1e6 up to 1.4x the elementwise
bound); the fp32-router peers stayed within 0.9x of it; a wrong expert, gate/up order or weight is far
outside. A case that fails is reported (FAILED) and not timed. A peer that raises (say, out
of memory) is left out of that case with the reason recorded (`peer_skipped`, a `note:` line).
Timing: harness.time_fn (CUDA events, L2 flushed, input sets rotated); an implementation whose one call
takes longer than TIME_BUDGET_S / (warmup + reps) (the Hugging Face eager loop at the large shapes) gets
fewer reps, at least MIN_REPS, and the result's `reps` records how many.
FLOPs (forward) = 2*T*k*3*H*F (routed experts) + 2*T*3*H*F_shared (shared experts) + 2*T*H*E (router);
forward+backward = 3x the forward. tokens/s = T / time.
Bytes, each input read once and each output written once (W = expert and shared weights in bf16 + the
router weight in fp32): fwd x T*H + W -> out T*H; fwd_bwd x + dout + W -> out + dx + the weights'
gradients W; the same for both routings (every expert's weights and gradients counted, empty ones too).
Headline, against perf.md's bars (BARS): moe_layer_fwd_bwd of qwen3-30b-a3b and deepseek-v3 with uniform
routing at T = 8192 (else the largest T run), the minimum over the uniform token counts, and the bar
judged on those; the zipf case's speedup at the same T is shown beside it.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_kernels.nn import PRESETS, MoEConfig, MoELayer
from moe_kernels.nn import torch_native

from . import harness as h


@dataclass(frozen=True)
class Spec:
    preset: str  # moe_kernels.nn.PRESETS key; also the perf.md shape the case stands for
    hf: str | None  # transformers family: "qwen3_moe", "deepseek_v3", "mixtral"; None: no peer
    overrides: tuple[tuple[str, object], ...] = ()  # preset overrides (the tiny CPU shapes)
    ep: int = 1  # perf.md's expert parallelism: E // ep is the floor when memory forces fewer experts
    why_no_hf: str = ""


MODELS = {
    "qwen3-30b-a3b": Spec("qwen3-30b-a3b", "qwen3_moe"),
    "deepseek-v3": Spec("deepseek-v3", "deepseek_v3", ep=8),
    "qwen3-235b": Spec("qwen3-235b", "qwen3_moe", ep=8),
    "mixtral-8x7b": Spec("mixtral-8x7b", "mixtral"),
    "gpt-oss-120b": Spec("gpt-oss-120b", None, why_no_hf=(
        "transformers' GPT-OSS experts add biases and use a clamped SwiGLU on interleaved, transposed "
        "weights: another function than this layer's")),
}
TOKENS = (4096, 8192, 16384)
_TINY = (("hidden_size", 64), ("num_experts", 8), ("ffn_size", 32), ("k", 2))
# Tiny shapes keep the CPU run (CI) to seconds. The tiny DeepSeek keeps 2 experts per group, as
# transformers' group score (the sum of a group's top 2) needs.
CPU_MODELS = {
    "tiny-qwen3-30b-a3b": Spec("qwen3-30b-a3b", "qwen3_moe", _TINY),
    "tiny-deepseek-v3": Spec("deepseek-v3", "deepseek_v3", _TINY + (
        ("shared_ffn_size", 32), ("num_groups", 4), ("group_topk", 2), ("group_score_topk", 2))),
    "tiny-mixtral-8x7b": Spec("mixtral-8x7b", "mixtral", _TINY),
}
CPU_TOKENS = (64, 256)
OPS = ("moe_layer_fwd", "moe_layer_fwd_bwd")
PEERS = ("torch_native", "hf_eager", "hf_grouped_mm")
HEADLINE_PRESETS = ("qwen3-30b-a3b", "deepseek-v3")
HEADLINE_T = 8192
HEADLINE_ROUTING = "uniform"
BARS = {"hf_eager": 3.0, "hf_grouped_mm": 1.3}  # moe_layer_fwd_bwd, peer time / ours

BF16_RTOL = 1.6e-2  # torch.testing's bf16 rtol
ATOL_RMS = 2.0**-5  # atol as a fraction of the expected tensor's rms (module docstring)
REL_L2 = 2.0**-6  # relative L2 error bound of a compared tensor
OUTLIER_FRAC, OUTLIER_FACTOR = 1e-4, 4.0  # elements allowed beyond the elementwise tolerance, and how far
_CHUNK = 1 << 26  # elements per piece when comparing on the device
AUX_RTOL = 1e-3
MIN_AGREE_FP32, MIN_AGREE_BF16 = 0.99, 0.90  # fraction of tokens with the same top-k set
CHECK_EXPERTS = 8  # expert-weight gradients compared on this many experts (memory: deepseek-v3's are 22.5 GB)
EXPERT_BIAS_STD = 0.02
TIME_BUDGET_S = 15.0  # per implementation and op; on the CPU the tiny shapes never reach it
MIN_REPS = 5
MEMORY_HEADROOM = 0.9  # of the free GPU memory
ROUTINGS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.2  # rank r's target top-1 share ~ 1/r^1.2, as bench_grouped_mm's zipf split
ZIPF_LOGIT_SCALE = 0.5  # rank r's logit offset = this x ln(r^-ZIPF_EXPONENT) logit standard deviations
EMPTY_FRACTION = 8  # the coldest E // 8 ranks (at least one) get no tokens
EMPTY_LOGIT_OFFSET = -6.0  # their logit offset, in logit standard deviations
ZIPF_SEED_OFFSET = 29  # the rank permutation's seed is ctx.seed + this
INPUT_SEED_OFFSET = 1000  # input set i's seed is ctx.seed + this + i, apart from the weights' ctx.seed


# ---------------------------------------------------------------------------------------------------
# Implementations


@dataclass
class Impl:
    name: str
    module: nn.Module
    variant: str
    router_weight: nn.Parameter  # the parameter its router multiplies by
    route: Callable[[Tensor], Tensor] | None  # x [T, H] -> indices [T, k]; None for ours
    fp32_router: bool = True

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        out = self.module(x)
        return out if isinstance(out, tuple) else (out, None)

    def params(self) -> list[Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]


def _layer_config(spec: Spec, num_experts: int | None = None) -> MoEConfig:
    overrides = dict(spec.overrides)
    if num_experts is not None:
        overrides["num_experts"] = num_experts
    return PRESETS[spec.preset](**overrides)


def _weight_bytes(cfg: MoEConfig) -> int:
    H, F_, E = cfg.hidden_size, cfg.ffn_size, cfg.num_experts
    return (E * 3 * H * F_ + 3 * H * cfg.shared_ffn_size) * 2 + E * H * 4


def _ours_need_bytes(cfg: MoEConfig, T: int, n_sets: int) -> int:
    """Our forward+backward's peak, roughly: weights and their gradients, the saved activations and the
    backward's temporaries (2 x T*k*(2H + 3F) bf16), and the input sets."""
    H, F_, k = cfg.hidden_size, cfg.ffn_size, cfg.router.k
    acts = 2 * T * k * (2 * H + 3 * F_) * 2 + 4 * T * (H + cfg.shared_ffn_size) * 2
    return 2 * _weight_bytes(cfg) + acts + 2 * n_sets * T * H * 2


def fit_config(ctx: h.Context, spec: Spec, T_max: int) -> tuple[MoEConfig, str]:
    """The preset, with the expert count halved (never below E / EP) only while our forward+backward at
    T_max would not fit the free GPU memory. Returns (config, a sentence on what was done)."""
    cfg = _layer_config(spec)
    E0, r = cfg.num_experts, cfg.router
    what = (f"E={E0} routed experts on one {'GPU' if ctx.is_cuda else 'device'}, routing over all {E0}, k={r.k}"
            + (f", {r.num_groups} groups / top-{r.group_topk}" if r.num_groups else "")
            + (f", shared expert F={cfg.shared_ffn_size}" if cfg.shared_ffn_size else ""))
    if spec.ep > 1:
        what += f" (perf.md's EP={spec.ep} would hold {E0 // spec.ep} per GPU; this is the whole layer)"
    if not ctx.is_cuda:
        return cfg, what
    _release(ctx)
    free, _ = torch.cuda.mem_get_info(ctx.device)
    E, floor = E0, max(E0 // spec.ep, r.k, 2 * (r.num_groups or 1))
    budget = MEMORY_HEADROOM * free
    while _ours_need_bytes(_layer_config(spec, E), T_max, ctx.n_input_sets) > budget and E // 2 >= floor:
        E //= 2
    if E != E0:
        cfg = _layer_config(spec, E)
        what = (f"E={E} routed experts (reduced from {E0}: {free / 2**30:.0f} GiB of GPU memory free), "
                f"routing over {E}, k={r.k}" + (f", {r.num_groups} groups / top-{r.group_topk}" if r.num_groups else "")
                + (f", shared expert F={cfg.shared_ffn_size}" if cfg.shared_ffn_size else ""))
    return cfg, what


def build_ours(ctx: h.Context, cfg: MoEConfig) -> MoELayer:
    torch.manual_seed(ctx.seed)
    layer = MoELayer(cfg, device=ctx.device, dtype=torch.bfloat16)  # the router stays fp32
    layer.router.float()
    if layer.router.expert_bias is not None:
        g = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 17)
        with torch.no_grad():
            layer.router.expert_bias.copy_(
                torch.randn(cfg.num_experts, generator=g, device=ctx.device) * EXPERT_BIAS_STD)
    return layer.train()


def build_torch_native(layer: MoELayer) -> Impl:
    peer = MoELayer(layer.config.replace(backend="torch"), device="meta")
    # keep_vars + assign: the peer holds our very parameter and buffer tensors
    peer.load_state_dict(layer.state_dict(keep_vars=True), assign=True)
    _assert_no_meta(peer)
    if not all(a is b for a, b in zip(peer.parameters(), layer.parameters(), strict=True)):
        raise RuntimeError("bench setup: torch_native does not hold our parameters")
    cfg, router = layer.config.router, peer.router

    def route(x2):
        logits = torch_native.router_logits(x2, router.weight)  # as MoELayer(backend="torch") does
        return torch_native.route(logits, cfg, router.expert_bias)[1]

    return Impl("torch_native", peer.train(), 'MoELayer(backend="torch"): topk routing, argsort dispatch, '
                "torch._grouped_mm, index_add_", router.weight, route)


def _assert_no_meta(peer: nn.Module) -> None:
    for name, t in [*peer.named_parameters(), *peer.named_buffers()]:
        if t.is_meta:
            raise RuntimeError(f"bench setup: the peer's {name} was left on the meta device")


def hf_semantics(cfg: MoEConfig, family: str) -> dict:
    """transformers config kwargs computing the same routing as `cfg`; ValueError where none does."""
    r = cfg.router
    kw = dict(hidden_size=r.hidden_size, num_experts_per_tok=r.k, hidden_act="silu")
    plain_softmax = (r.score == "softmax" and r.num_groups is None and not r.expert_bias
                     and r.scaling_factor is None and not cfg.shared_ffn_size)
    if family == "qwen3_moe":
        if not plain_softmax:
            raise ValueError("Qwen3-MoE routes by plain softmax top-k, without shared experts")
        return dict(kw, num_experts=r.num_experts, moe_intermediate_size=cfg.ffn_size,
                    norm_topk_prob=not r.pre_softmax)
    if family == "mixtral":
        if not plain_softmax or r.pre_softmax:
            raise ValueError("Mixtral renormalises the softmax over the top-k, without shared experts")
        return dict(kw, num_local_experts=r.num_experts, intermediate_size=cfg.ffn_size, router_jitter_noise=0.0)
    if family == "deepseek_v3":
        G, g = r.num_groups or 1, r.group_topk or 1
        gst = r.group_score_topk if r.group_score_topk is not None else max(1, r.k // g)
        if r.score != "sigmoid" or not r.expert_bias or (G > 1 and gst != min(2, r.num_experts // G)):
            raise ValueError("DeepSeek-V3 routes by sigmoid + expert bias, a group scored by its top 2")
        if not cfg.shared_ffn_size or cfg.shared_ffn_size % cfg.ffn_size or cfg.shared_gate:
            raise ValueError("DeepSeek-V3's shared experts are n_shared_experts x moe_intermediate_size, ungated")
        return dict(kw, n_routed_experts=r.num_experts, moe_intermediate_size=cfg.ffn_size,
                    n_shared_experts=cfg.shared_ffn_size // cfg.ffn_size, n_group=G, topk_group=g,
                    routed_scaling_factor=r.scaling_factor or 1.0,
                    norm_topk_prob=r.normalize if r.normalize is not None else r.k > 1)
    raise ValueError(f"no transformers family {family!r}")


_HF_CLASSES = {  # family -> (config class, module, block class)
    "qwen3_moe": ("Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "deepseek_v3": ("DeepseekV3Config", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
    "mixtral": ("MixtralConfig", "transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
}


def build_hf(layer: MoELayer, family: str, implementation: str, bf16_router: nn.Parameter | None) -> Impl:
    """The transformers block over our weights (module docstring), experts run by `implementation`."""
    import importlib

    import transformers

    cfg = layer.config
    kw = hf_semantics(cfg, family)
    config_cls, module, block_cls = _HF_CLASSES[family]
    hf_config = getattr(transformers, config_cls)(**kw, experts_implementation=implementation)
    with torch.device("meta"):
        block = getattr(importlib.import_module(module), block_cls)(hf_config)
    experts = block.experts
    if experts.config._experts_implementation != implementation:
        raise RuntimeError(f"transformers did not take experts_implementation={implementation!r}")
    for hf_w, ours_w in ((experts.gate_up_proj, layer.experts.w13), (experts.down_proj, layer.experts.w2),
                         (block.gate.weight, layer.router.weight)):
        if hf_w.shape != ours_w.shape:
            raise RuntimeError(f"bench setup: the {block_cls} built from {kw} holds {tuple(hf_w.shape)} "
                               f"where ours is {tuple(ours_w.shape)}")
    experts.gate_up_proj = layer.experts.w13  # [E, 2F, H], gate rows first: our layout
    experts.down_proj = layer.experts.w2  # [E, H, F]
    if family == "deepseek_v3":
        block.gate.weight = layer.router.weight  # fp32; transformers upcasts to fp32 anyway
        block.gate.e_score_correction_bias = layer.router.expert_bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.shared_experts, name, getattr(layer.shared_experts, name))
    else:
        block.gate.weight = bf16_router
    _assert_no_meta(block)
    gate = block.gate
    version = getattr(transformers, "__version__", "?")
    how = {"eager": "per-expert loop", "grouped_mm": hf_grouped_mm_path(layer)}.get(implementation, implementation)
    return Impl(f"hf_{implementation}", block.train(),
                f'transformers {version} {block_cls}, experts_implementation="{implementation}" ({how})',
                gate.weight, lambda x2: gate(x2)[2], fp32_router=family == "deepseek_v3")


def hf_grouped_mm_path(layer: MoELayer) -> str:
    """Which GEMM transformers' grouped_mm experts will call for these weights (its private dispatch)."""
    try:
        from transformers.integrations import moe as hf_moe

        w = layer.experts.w13.detach().transpose(-2, -1)
        x = w.new_zeros(8, w.shape[1])
        offs = torch.full((w.shape[0],), 8, dtype=torch.int32, device=w.device)
        if not hf_moe._can_use_grouped_mm(x, w, offs):
            return "transformers' per-expert fallback loop"
        return "torch.nn.functional.grouped_mm" if hasattr(F, "grouped_mm") else "torch._grouped_mm"
    except (ImportError, AttributeError, RuntimeError, TypeError) as e:
        return f"grouped_mm path unknown: {type(e).__name__}"


def build_peers(layer: MoELayer, spec: Spec) -> tuple[dict[str, Impl], dict[str, str]]:
    """(peer -> Impl, peer -> why it is left out)."""
    peers, skipped = {}, {}
    try:
        peers["torch_native"] = build_torch_native(layer)
    except (RuntimeError, ValueError, TypeError) as e:
        skipped["torch_native"] = _why(e)
    hf_names = ("hf_eager", "hf_grouped_mm")
    if spec.hf is None:
        return peers, {**skipped, **{p: spec.why_no_hf for p in hf_names}}
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return peers, {**skipped, **{p: f"transformers not importable: {e}" for p in hf_names}}
    bf16_router = None
    if spec.hf != "deepseek_v3":
        bf16_router = nn.Parameter(layer.router.weight.detach().to(torch.bfloat16))
    for impl in ("eager", "grouped_mm"):
        try:
            peers[f"hf_{impl}"] = build_hf(layer, spec.hf, impl, bf16_router)
        except (ImportError, AttributeError, RuntimeError, ValueError, TypeError, KeyError) as e:
            skipped[f"hf_{impl}"] = _why(e)
    return peers, skipped


def ours_impl(layer: MoELayer) -> Impl:
    return Impl("ours", layer, "MoELayer(backend=\"kernels\")", layer.router.weight, None)


def _why(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:300]


# ---------------------------------------------------------------------------------------------------
# One call of each op


def fwd(impl: Impl) -> Callable:
    def call(x, dout):
        return impl.forward(x)[0]

    return call


def fwd_bwd(impl: Impl, params: list[Tensor]) -> Callable:
    def call(x, dout):
        out, aux = impl.forward(x)
        outs, grads = [out], [dout]
        if aux is not None and aux.requires_grad:
            outs.append(aux)
            grads.append(torch.ones_like(aux))
        return torch.autograd.grad(outs, [x, *params], grads, allow_unused=True)

    return call


def make_inputs(ctx: h.Context, cfg: MoEConfig, T: int, seed: int,
                shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [1, T, H] ~ randn (+ the routing case's shift [H], added in fp32, then bf16), dout ~ randn."""
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    shape = (1, T, cfg.hidden_size)
    x = torch.randn(shape, generator=g, device=ctx.device, dtype=torch.bfloat16)
    if shift is not None:
        x = (x.float() + shift).to(torch.bfloat16)
    dout = torch.randn(shape, generator=g, device=ctx.device, dtype=torch.bfloat16)
    return x.requires_grad_(), dout


# ---------------------------------------------------------------------------------------------------
# Routing skew


def routing_shift(ctx: h.Context, layer: MoELayer, routing: str) -> Tensor | None:
    """The input shift [H] fp32 that skews the layer's own routing (module docstring); None for uniform."""
    if routing == "uniform":
        return None
    if routing != "zipf":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    w = layer.router.weight.detach().double()  # [E, H]
    E = w.shape[0]
    rank = torch.arange(1, E + 1, dtype=torch.float64)
    z = ZIPF_LOGIT_SCALE * -ZIPF_EXPONENT * rank.log()  # in logit standard deviations; rank 1 unshifted
    n_empty = min(max(1, E // EMPTY_FRACTION), E - layer.config.router.k)
    if n_empty > 0:
        z[E - n_empty:] = EMPTY_LOGIT_OFFSET
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(ctx.seed + ZIPF_SEED_OFFSET))
    offsets = torch.empty_like(z)
    offsets[perm] = z  # expert perm[r - 1] has rank r: hot experts anywhere, not first
    b = offsets.to(w.device) * w.norm(dim=1)  # x ~ randn: expert e's logit has std ||W[e]||
    v = w.T @ torch.linalg.solve(w @ w.T, b)  # the least-norm v with W v = b
    return v.float()


def routing_skew(layer: MoELayer, x: Tensor) -> dict[str, float]:
    """How our router spreads x's tokens (module docstring: routing_skew)."""
    T, E = x.shape[1], layer.config.num_experts
    with torch.no_grad():
        counts = layer.router(x.detach().reshape(-1, x.shape[-1]), seq_len=T).tokens_per_expert
    c = counts.long().sort(descending=True).values.cpu()
    total = max(1, int(c.sum()))  # T*k routed tokens
    return {"max_expert_frac": float(c[0]) / T, "max_over_mean": float(c[0]) * E / total,
            "empty_experts": int((c == 0).sum()), "experts_for_half": int((c.cumsum(0) < total / 2).sum()) + 1}


# ---------------------------------------------------------------------------------------------------
# Checks


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
    """Within bf16 precision (module docstring): relative L2 error <= REL_L2, and |a - e| <= atol + rtol*|e|
    (rtol = BF16_RTOL, atol = ATOL_RMS x the larger of rms(e) and the element's local rms) on all but
    OUTLIER_FRAC of the elements, none beyond OUTLIER_FACTOR x that. The local rms of element [b, i, j] of
    e viewed as [B, R, C] (_as_slices) is sqrt(ms(row i) x ms(column j) / ms(slice b)), the mean squares
    ms taken within slice b; a vector has none (atol = ATOL_RMS x rms(e)). Computed on the device in
    pieces of whole rows: no copy to the host."""
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
    """Raises AssertionError where the peer and ours disagree (module docstring); returns the fraction of
    tokens whose top-k expert set agrees."""
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


# ---------------------------------------------------------------------------------------------------
# Timing


def _sync(ctx: h.Context) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def _release(ctx: h.Context) -> None:
    """Hands freed GPU memory back between implementations (deepseek-v3 leaves little to spare)."""
    if ctx.is_cuda:
        gc.collect()
        torch.cuda.empty_cache()


def time_impl(ctx: h.Context, fn: Callable, inputs: list[tuple]) -> tuple[h.Timing, int]:
    """harness.time_fn with the run's warmup and reps, or fewer reps (>= MIN_REPS) where one call is so
    slow that they would take longer than TIME_BUDGET_S. Returns (timing, reps)."""
    for args in inputs[:2]:  # up to two untimed calls: the last one's time sets the reps
        _sync(ctx)
        t0 = time.perf_counter()
        fn(*args)
        _sync(ctx)
        one = time.perf_counter() - t0
        if one > 1.0:  # a slow call: its one-time costs are noise, and a second one would waste seconds
            break
    warmup, reps = ctx.warmup, ctx.reps
    if one * (warmup + reps) > TIME_BUDGET_S:
        reps = max(MIN_REPS, int(TIME_BUDGET_S / one) - 1)
        warmup = 1
    t = h.time_fn(fn, inputs_list=inputs, warmup=warmup, reps=reps, device=ctx.device,
                  flush=ctx.l2_flush_buffer())
    return t, reps


@dataclass
class LayerResult(h.Result):
    model: str = ""  # the perf.md shape this case stands for
    setup: str = ""  # experts and routing as run (module docstring)
    routing: str = ""  # "uniform" or "zipf"
    routing_skew: dict[str, float] = field(default_factory=dict)  # as measured (module docstring)
    tokens_per_s: float = 0.0
    routing_agreement: dict[str, float] = field(default_factory=dict)  # peer -> fraction of tokens
    reps: dict[str, int] = field(default_factory=dict)  # "ours" and each peer -> timed reps
    peer_skipped: dict[str, str] = field(default_factory=dict)  # peer -> why it was not timed


def flops(cfg: MoEConfig, T: int) -> int:
    H, F_, E, k = cfg.hidden_size, cfg.ffn_size, cfg.num_experts, cfg.router.k
    return 2 * T * k * 3 * H * F_ + 2 * T * 3 * H * cfg.shared_ffn_size + 2 * T * H * E


def nbytes(op: str, cfg: MoEConfig, T: int) -> int:
    act, w = T * cfg.hidden_size * 2, _weight_bytes(cfg)
    return 2 * act + w if op == "moe_layer_fwd" else 4 * act + 2 * w


def run_case(ctx: h.Context, name: str, spec: Spec, cfg: MoEConfig, setup: str, T: int, layer: MoELayer,
             peers: dict[str, Impl], skipped: dict[str, str], routing: str = "uniform",
             shift: Tensor | None = None) -> tuple[list[LayerResult], list[str]]:
    case = f"{name}/T{T}/{routing}"
    seeds = [ctx.seed + INPUT_SEED_OFFSET + i for i in range(ctx.n_input_sets)]
    sets = [make_inputs(ctx, cfg, T, seed, shift) for seed in seeds]
    skew = routing_skew(layer, sets[0][0])
    skipped = dict(skipped)
    agreement: dict[str, float] = {}
    live: dict[str, Impl] = {}
    for p, impl in peers.items():
        try:
            agreement[p] = check_peer(case, layer, impl, *sets[0])
            live[p] = impl
        except AssertionError as e:  # ours and a peer disagree: the case is not timed
            return [], [f"{case}: {e}"]
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:  # e.g. out of memory
            skipped[p] = _why(e)
        finally:
            _release(ctx)

    ours = ours_impl(layer)
    timings: dict[str, dict[str, tuple[h.Timing, int]]] = {op: {} for op in OPS}
    for key, impl in [("ours", ours), *live.items()]:
        try:
            timings["moe_layer_fwd"][key] = time_impl(ctx, fwd(impl), sets)
            _release(ctx)
            timings["moe_layer_fwd_bwd"][key] = time_impl(ctx, fwd_bwd(impl, impl.params()), sets)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            if key == "ours":
                return [], [f"{case}: ours raised {_why(e)}"]
            skipped[key] = _why(e)
            for op in OPS:
                timings[op].pop(key, None)
        finally:
            _release(ctx)

    results = []
    for op in OPS:
        t = timings[op]["ours"][0]
        peer_t = {p: tr[0] for p, tr in timings[op].items() if p != "ours"}
        fl = flops(cfg, T) * (1 if op == "moe_layer_fwd" else 3)
        r = h.make_result(ctx, op=op, case=case, shape=shape(cfg, T), dtype=torch.bfloat16, timing=t,
                          nbytes=nbytes(op, cfg, T), flops=fl, peers=peer_t,
                          peer_variant={p: live[p].variant for p in peer_t})
        results.append(LayerResult(
            **vars(r), model=spec.preset, setup=setup, routing=routing, routing_skew=skew,
            tokens_per_s=T / (max(t.us, 1e-3) * 1e-6),
            routing_agreement=agreement, reps={p: tr[1] for p, tr in timings[op].items()},
            peer_skipped={p: why for p, why in skipped.items() if p not in peer_t}))
    return results, []


def shape(cfg: MoEConfig, T: int) -> dict[str, int]:
    return dict(T=T, H=cfg.hidden_size, E=cfg.num_experts, k=cfg.router.k, F=cfg.ffn_size,
                F_shared=cfg.shared_ffn_size)


# ---------------------------------------------------------------------------------------------------
# Headline and run


def _headline_case(rs: list[LayerResult]) -> LayerResult:
    return next((r for r in rs if r.shape["T"] == HEADLINE_T), max(rs, key=lambda r: r.shape["T"]))


def headline(ctx: h.Context, results: list[LayerResult]) -> list[str]:
    lines = []
    bars = ", ".join(f">= {b:g}x {p}" for p, b in BARS.items())
    for preset in HEADLINE_PRESETS:
        rs = [r for r in results
              if r.op == "moe_layer_fwd_bwd" and r.model == preset and r.routing == HEADLINE_ROUTING]
        if not rs:
            lines.append(f"moe_layer_fwd_bwd {preset}: no {HEADLINE_ROUTING} case timed (see FAILED) "
                         f"(bar: {bars})")
            continue
        top = _headline_case(rs)
        zipf = next((r for r in results if r.op == top.op and r.model == preset and r.routing == "zipf"
                     and r.shape["T"] == top.shape["T"]), None)
        perf = f"ours {top.us:.0f} us, {_rate(top.tokens_per_s)}, {top.tflops or 0:.1f} TFLOP/s"
        for peer, bar in BARS.items():
            if peer not in top.speedup:
                lines.append(f"moe_layer_fwd_bwd {top.case}: {peer} not timed "
                             f"({top.peer_skipped.get(peer, 'see FAILED')}); {perf} (bar: >= {bar:g}x {peer})")
                continue
            s = [(r.speedup[peer], r.case) for r in rs if peer in r.speedup]
            worst = min(s)
            ok = all(v >= bar for v, _ in s)
            at_zipf = "not timed"
            if zipf is not None and peer in zipf.speedup:
                at_zipf = f"{zipf.speedup[peer]:.2f}x at {zipf.case}"
            lines.append(f"moe_layer_fwd_bwd {top.case}: {top.speedup[peer]:.2f}x {peer} "
                         f"({top.peer_variant[peer]}); min {worst[0]:.2f}x at {worst[1]} over {len(s)} token "
                         f"count(s); zipf routing: {at_zipf}; {perf} (bar: >= {bar:g}x {peer}) "
                         f"[{'meets bar' if ok else 'below bar'}]")
        fwd_r = next((r for r in results if r.op == "moe_layer_fwd" and r.case == top.case), None)
        if fwd_r is not None and fwd_r.speedup:
            vs = ", ".join(f"{s:.2f}x {p}" for p, s in fwd_r.speedup.items())
            lines.append(f"moe_layer_fwd {fwd_r.case}: {vs}; ours {fwd_r.us:.0f} us, "
                         f"{_rate(fwd_r.tokens_per_s)}, {fwd_r.tflops or 0:.1f} TFLOP/s (no bar: forward only)")
    return lines


def notes(ctx: h.Context, results: list[LayerResult], setups: dict[str, str]) -> list[str]:
    out = [f"{name}: {setup}" for name, setup in setups.items()]
    skews: dict[str, list[str]] = {}
    for r in results:
        if r.op == "moe_layer_fwd_bwd" and r.routing_skew:
            name, rest = r.case.split("/", 1)
            k = r.routing_skew
            skews.setdefault(name, []).append(
                f"{rest} {k['max_expert_frac']:.2f} ({k['max_over_mean']:.1f}x the mean), {k['empty_experts']} "
                f"empty, half on {k['experts_for_half']} of E={r.shape['E']}")
    out += [f"{name} routing skew (our router, the first input set: busiest expert's fraction of the tokens, "
            f"its load over the mean, empty experts, fewest experts taking half the routed tokens): "
            + "; ".join(cases) for name, cases in skews.items()]
    agree: dict[str, list[float]] = {}
    for r in results:
        for p, f in r.routing_agreement.items():
            agree.setdefault(p, []).append(f)
    if agree:
        out.append("routing agreement with ours (tokens whose top-k set matches; outputs and gradients "
                   "compared on those), min over cases: "
                   + ", ".join(f"{p} {min(f):.2%}" for p, f in agree.items())
                   + " (the Qwen3-MoE and Mixtral blocks compute their router logits in bf16)")
    skips: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.op == "moe_layer_fwd_bwd":
            for p, why in r.peer_skipped.items():
                skips.setdefault((p, why), []).append(r.case)
    out += [f"{p} not timed at {', '.join(cases)}: {why}" for (p, why), cases in skips.items()]
    for r in results:
        few = {k: n for k, n in r.reps.items() if n < ctx.reps}
        if few:
            out.append(f"{r.op} {r.case}: timed with fewer reps than {ctx.reps} (one call would overrun "
                       f"{TIME_BUDGET_S:g} s): " + ", ".join(f"{k} {n}" for k, n in few.items()))
    return [f"note: {line}" for line in out]


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:.2f}M tokens/s" if tokens_per_s >= 1e5 else f"{tokens_per_s:.0f} tokens/s"


def run(ctx: h.Context) -> h.Report:
    try:
        import transformers

        tf = f"transformers {transformers.__version__}"
    except ImportError:
        tf = "no transformers"
    print(f"moe_layer on {ctx.device}: ours runs {'the CUDA kernels' if ctx.ours_runs_kernels else 'the reference'}"
          f"; {tf}")
    ctx.ceilings()  # measured before the layers take the memory
    models = MODELS if ctx.is_cuda else CPU_MODELS
    tokens = (((HEADLINE_T,) if ctx.quick else TOKENS) if ctx.is_cuda
              else (CPU_TOKENS[:1] if ctx.quick else CPU_TOKENS))
    results: list[LayerResult] = []
    failures: list[str] = []
    setups: dict[str, str] = {}
    for name, spec in models.items():
        layer = peers = None
        try:
            cfg, setups[name] = fit_config(ctx, spec, max(tokens))
            layer = build_ours(ctx, cfg)
            peers, skipped = build_peers(layer, spec)
            shifts = {routing: routing_shift(ctx, layer, routing) for routing in ROUTINGS}
            for T in tokens:
                for routing, shift in shifts.items():
                    rs, fs = run_case(ctx, name, spec, cfg, setups[name], T, layer, peers, skipped,
                                      routing, shift)
                    results += rs
                    failures += fs
        except (RuntimeError, ValueError) as e:  # e.g. out of memory building the layer
            failures.append(f"{name}: {_why(e)}")
        finally:
            del layer, peers
            _release(ctx)
    return h.Report(results, headline(ctx, results) + notes(ctx, results, setups), failures)
