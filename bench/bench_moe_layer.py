"""The full MoE layer, forward and forward+backward, at the specs/perf.md shapes.

Ours: moe_kernels.nn.MoELayer(PRESETS[model]()) with bf16 expert (and shared-expert) weights and the
router in fp32 (Router keeps its weight and logits fp32), in training mode, called on x [1, T, H] bf16
(T in {4096, 8192, 16384}, and 32768 for qwen3-30b-a3b, whose TFLOP/s bar names it; 8192 alone with
--quick; x and dout from input set i's own seed, ctx.seed + 1000 + i,
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
                     every parameter (ours, torch_native and liger include their aux loss; the Hugging
                     Face blocks compute none: their model adds it outside the block).
Peers (built in bench/moe_layer_peers.py), timed in the same run, on the same inputs, with the same
weights (the very same parameter tensors, shared, so deepseek-v3's 22.5 GB of experts exist once):
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
  liger          Liger's fused MoE (liger-kernel's LigerFusedMoEFunction, Triton: a routing-metadata pass,
                 the gather fused into the gate/up grouped GEMM with SwiGLU in its epilogue, the down
                 grouped GEMM, a weighted gather-sum per token; its backward recomputes rather than keeps
                 the [T*k, H] expert outputs). It takes precomputed routing, so it runs inside
                 torch_native's layer: the same fp32 router (softmax/sigmoid + topk + gather, our weight and
                 expert bias), our w13 [E, 2F, H] (gate rows first: Liger's gate_up_proj layout) and w2
                 [E, H, F] as its gate_up_proj and down_proj, indices as int32, the fp32 routing weights
                 as its top_k_weights, our shared experts (nn.Linear) and torch_native's aux loss. So it
                 computes this layer's function on every preset; the differences are Liger's roundings
                 (its expert outputs and its routing-weight gradient come back in x's dtype, bf16, and
                 autograd casts the latter to the fp32 weights'). Where liger_kernel does not import,
                 or the run is not on a GPU (Triton), it is left out with the reason recorded
                 (`peer_skipped`).
Checked before timing (bench/moe_layer_checks.py, which holds the tolerances named here and the error
model they follow from), per case (each routing) and peer, on the case's first input set. Routing: every
token that ours or the peer routes otherwise than the exact (fp64) router logits would must be a near-tie,
its top-k set reachable by moving each logit no further than that router's rounding can (fp32: 64 eps_fp32
x sum_h |x_h W_eh|; the Qwen3-MoE and Mixtral blocks' bf16 logits: 2^-8 x that more); the fraction of tokens
whose top-k sets agree is recorded. On the agreeing tokens, the output; then one forward+backward with dout
zeroed on the other tokens, and dx, the router weight's gradient, w13's and w2's on CHECK_EXPERTS experts
(the busiest half and the least loaded half by our router's counts, so empty experts are among them where
there are any) and the shared experts'; torch_native's and liger's aux loss within rtol 1e-3. Each of
these, ours' and the peer's, against the layer computed in fp64 on the same weights and inputs with our
expert selection (moe_layer_checks.reference64: one expert at a time, its weights upcast inside a
checkpoint, so no fp64 copy of all the experts is held), per slice (each expert's weight gradient on its own, else the whole
tensor): both within bf16 precision (relative L2 error <= 2^-5, no element off by more than 2^-4 x the
slice's max |exact|), and ours within the flash-attention rule of the peer's error (L2 error <= 2x the
peer's + 2^-8 x ||exact||). A wrong expert, gate/up order, routing weight or a lost token is far
outside. A case that fails is reported (FAILED) and not timed, except where the
peer that disagrees is one not yet checked on a GPU (UNVERIFIED_PEERS: Liger): that peer is left out of
the case with the reason, and ours stays checked against the others. A peer that raises (say, out
of memory) is left out of that case with the reason recorded (`peer_skipped`, a `note:` line).
Timing: harness.time_fn (CUDA events, L2 flushed, input sets rotated). One call of each implementation
is timed first (synchronised); one whose warmup + reps would take longer than TIME_BUDGET_S (15 s;
QUICK_TIME_BUDGET_S, 3 s, with --quick, which the perf mode runs) per op gets fewer reps, at least
MIN_REPS, and the result's `reps` records how many (the Hugging Face eager loop's fwd+bwd, ~0.3 s a call,
is the one that hits it). With `--modes` (the perf mode's
layer part) moe_layer_fwd_bwd also reports host issue, kernel and CUDA-graph replay time for ours,
torch_native and Liger (harness.time_modes, reps capped the same way: about 3 calls a rep; the Hugging
Face blocks sync with the host, so they are not captured), and the ratios eager vs eager and replayed vs
replayed. Each check, timing and mode pass prints one flushed `[moe_layer]` line with its wall time as it
ends, so a run cut short shows where its time went.
Cost beyond the timed calls (read from the code, and the CPU dry run's lines): per case and peer, one
check (the fp64 layer, one expert at a time, plus one fwd+bwd of ours and of the peer); per case and
capturable implementation, a profiler pass and a CUDA-graph capture (time_modes); per model, building
the Hugging Face blocks (on the meta device, then our tensors assigned: cheap). Liger's fused MoE
autotunes its Triton kernels on first use (32 configs for each of its four GEMM kernels, 16 for each
weight-gradient kernel, 40 for each of the gather-sum's two uses: 240 compiles and benchmark loops,
minutes on a fresh machine, once per process, keyed by H and F only); the perf mode sets liger-kernel's own switch
LIGER_FUSED_MOE_AUTOTUNE=0 (one fixed config per kernel) unless the environment sets it, and the
peer's variant says which ran.
FLOPs (forward) = 2*T*k*3*H*F (routed experts) + 2*T*3*H*F_shared (shared experts) + 2*T*H*E (router);
forward+backward = 3x the forward. tokens/s = T / time.
Bytes, each input read once and each output written once (W = expert and shared weights in bf16 + the
router weight in fp32): fwd x T*H + W -> out T*H; fwd_bwd x + dout + W -> out + dx + the weights'
gradients W; the same for both routings (every expert's weights and gradients counted, empty ones too).
Headline, against perf.md's bars (BARS, per op and peer), for qwen3-30b-a3b and deepseek-v3 with uniform
routing at T = 8192 (else the largest T run): the speedup, the minimum over the uniform token counts, and
the bar judged on those; the zipf case's speedup at the same T beside it. Against hf_eager the bar is
judged on the forward (moe_layer_fwd): its experts' backward builds a full-size weight gradient per
expert, which is what eager indexing costs, not a kernel comparison; its fwd+bwd ratio is shown without
a bar. Against hf_grouped_mm and liger the bar is on moe_layer_fwd_bwd. TFLOPS_BAR: qwen3-30b-a3b's
moe_layer_fwd_bwd TFLOP/s at T = 32768, uniform routing (a line saying it was not run otherwise).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from moe_kernels.nn import PRESETS, MoEConfig, MoELayer

from . import bars
from . import harness as h
from .moe_layer_checks import check_peer
from .moe_layer_peers import Impl, Spec, build_peers, ours_impl, reason

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
HEADLINE_PRESETS = ("qwen3-30b-a3b", "deepseek-v3")
# Peers whose agreement with the fp64 layer is not yet established on a GPU: one outside the check's
# tolerance is left out of the case (with the reason) instead of failing it; ours is still checked
# against the others.
UNVERIFIED_PEERS = ("liger",)
MODE_PEERS = ("torch_native", "liger")  # capturable peers timed with host / kernel / graph modes
EXTRA_TOKENS = {"qwen3-30b-a3b": (32768,)}  # GPU full run: a bar names this token count
HEADLINE_T = 8192
HEADLINE_ROUTING = "uniform"
# perf.md's bars (bench/bars.py), (op, peer) -> peer time / ours; hf_eager's on the forward only (module
# docstring). TFLOPS_BAR: moe_layer_fwd_bwd TFLOP/s (preset, T, bar).
_BAR = bars.bar("moe_layer")
BARS = {("moe_layer_fwd", "hf_eager"): _BAR.threshold("speedup:hf_eager").value,
        ("moe_layer_fwd_bwd", "hf_grouped_mm"): _BAR.threshold("speedup:hf_grouped_mm").value,
        ("moe_layer_fwd_bwd", "liger"): _BAR.threshold("speedup:liger").value}
TFLOPS_BAR = ("qwen3-30b-a3b", 32768, _BAR.threshold("tflops").value)

EXPERT_BIAS_STD = 0.02
TIME_BUDGET_S = 15.0  # per implementation and op; on the CPU the tiny shapes never reach it
QUICK_TIME_BUDGET_S = 3.0  # the same with --quick (the perf mode): a slow peer costs seconds, not minutes
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
# Our layer


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
# Timing


def _sync(ctx: h.Context) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def _release(ctx: h.Context) -> None:
    """Hands freed GPU memory back between implementations (deepseek-v3 leaves little to spare)."""
    if ctx.is_cuda:
        gc.collect()
        torch.cuda.empty_cache()


def time_budget_s(ctx: h.Context) -> float:
    return QUICK_TIME_BUDGET_S if ctx.quick else TIME_BUDGET_S


def one_call_s(ctx: h.Context, fn: Callable, inputs: list[tuple]) -> float:
    """Wall time of one call, synchronised: up to two untimed calls, the last one's time (a first call
    carries one-time costs: allocator growth, cuBLAS handles, Triton compiles)."""
    for args in inputs[:2]:
        _sync(ctx)
        t0 = time.perf_counter()
        fn(*args)
        _sync(ctx)
        one = time.perf_counter() - t0
        if one > 1.0:  # a slow call: its one-time costs are noise, and a second one would waste seconds
            break
    return one


def time_impl(ctx: h.Context, fn: Callable, inputs: list[tuple]) -> tuple[h.Timing, int, float]:
    """harness.time_fn with the run's warmup and reps, or fewer reps (>= MIN_REPS) where one call is so
    slow that they would take longer than time_budget_s (TIME_BUDGET_S; QUICK_TIME_BUDGET_S with --quick).
    Returns (timing, reps, one call's seconds)."""
    one = one_call_s(ctx, fn, inputs)
    warmup, reps = ctx.warmup, ctx.reps
    budget = time_budget_s(ctx)
    if one * (warmup + reps) > budget:
        reps = min(reps, max(MIN_REPS, int(budget / one) - 1))
        warmup = 1
    t = h.time_fn(fn, inputs_list=inputs, warmup=warmup, reps=reps, device=ctx.device,
                  flush=ctx.flush)
    return t, reps, one


def modes_reps(ctx: h.Context, one: float) -> int:
    """time_modes makes about 3 x reps calls (host, profiled, replayed): reps within time_budget_s."""
    return max(MIN_REPS, min(ctx.reps, int(time_budget_s(ctx) / (3 * max(one, 1e-6)))))


def progress(case: str, what: str, seconds: float, detail: str = "") -> None:
    """One flushed line per check, timing and mode pass as it ends: a run cut short shows where its time went."""
    print(f"[moe_layer] {case} {what}{': ' + detail if detail else ''} ({seconds:.1f} s)", flush=True)


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
        t0 = time.perf_counter()
        verdict = "ok"
        try:
            agreement[p] = check_peer(case, layer, impl, *sets[0])
            live[p] = impl
        except AssertionError as e:
            verdict = f"outside the tolerance: {str(e)[:200]}"
            if p in UNVERIFIED_PEERS:  # ours is held to the established peers; this one is left out
                skipped[p] = f"outside the check's tolerance: {str(e)[:300]}"
                continue
            return [], [f"{case}: {e}"]  # ours and an established peer disagree: the case is not timed
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:  # e.g. out of memory
            skipped[p] = verdict = reason(e)
        finally:
            _release(ctx)
            progress(case, f"check vs {p}", time.perf_counter() - t0, verdict)

    ours = ours_impl(layer)
    timings: dict[str, dict[str, tuple[h.Timing, int]]] = {op: {} for op in OPS}
    one_s: dict[str, float] = {}  # one fwd+bwd call's seconds, per implementation
    for key, impl in [("ours", ours), *live.items()]:
        for op, fn in (("moe_layer_fwd", fwd(impl)), ("moe_layer_fwd_bwd", fwd_bwd(impl, impl.params()))):
            t0 = time.perf_counter()
            try:
                t, reps, one = time_impl(ctx, fn, sets)
                timings[op][key] = (t, reps)
                one_s[key] = one
                progress(case, f"{key} {op}", time.perf_counter() - t0,
                         f"{t.us:.0f} us median of {reps} reps (one call {one * 1e3:.1f} ms)")
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                progress(case, f"{key} {op}", time.perf_counter() - t0, f"raised {reason(e)}")
                if key == "ours":
                    if isinstance(e, torch.OutOfMemoryError):
                        raise  # the case does not fit: run() records it as skipped
                    return [], [f"{case}: ours raised {reason(e)}"]
                skipped[key] = reason(e)
                for o in OPS:
                    timings[o].pop(key, None)
                break
            finally:
                _release(ctx)

    # With ctx.modes (the perf mode): host issue, kernel and graph-replay time of fwd+bwd, for the
    # implementations whose call can be captured (the Hugging Face blocks sync with the host).
    modes: dict[str, h.Modes] = {}
    if ctx.modes:
        for key, impl in [("ours", ours), *((p, i) for p, i in live.items() if p in MODE_PEERS)]:
            if key in timings["moe_layer_fwd_bwd"]:
                t0 = time.perf_counter()
                reps = modes_reps(ctx, one_s[key])
                try:
                    modes[key] = m = h.time_modes(fwd_bwd(impl, impl.params()), inputs_list=sets,
                                                  warmup=min(ctx.warmup, 2), reps=reps, device=ctx.device,
                                                  flush=ctx.flush)
                    detail = (f"host / kernel / graph {h.mode_cell(m.host_us, ctx, '.0f')} / "
                              f"{h.mode_cell(m.kernel_us, ctx, '.0f')} / {h.mode_cell(m.graph_us, ctx, '.0f')} us, "
                              f"{reps} reps" + (f" ({m.why_not})" if m.why_not and ctx.is_cuda else ""))
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                    skipped.setdefault(f"{key} modes", reason(e))
                    detail = f"raised {reason(e)}"
                finally:
                    _release(ctx)
                progress(case, f"{key} modes", time.perf_counter() - t0, detail)

    results = []
    for op in OPS:
        t = timings[op]["ours"][0]
        peer_t = {p: tr[0] for p, tr in timings[op].items() if p != "ours"}
        fl = flops(cfg, T) * (1 if op == "moe_layer_fwd" else 3)
        with_modes = op == "moe_layer_fwd_bwd" and "ours" in modes
        r = h.make_result(ctx, op=op, case=case, shape=shape(cfg, T), dtype=torch.bfloat16, timing=t,
                          nbytes=nbytes(op, cfg, T), flops=fl, peers=peer_t,
                          peer_variant={p: live[p].variant for p in peer_t},
                          modes=modes.get("ours") if with_modes else None,
                          peer_modes={p: m for p, m in modes.items() if p != "ours"} if with_modes else None)
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


def _bar_line(op: str, peer: str, bar: float | None, rs: list[LayerResult], results: list[LayerResult],
              preset: str) -> str:
    """One headline line: `op`'s speedup over `peer` at the headline case, the minimum over the uniform
    token counts, the zipf case beside it; judged against `bar` (None: shown without a bar)."""
    top = _headline_case(rs)
    perf = f"ours {top.us:.0f} us, {_rate(top.tokens_per_s)}, {top.tflops or 0:.1f} TFLOP/s"
    judged = (f"(bar: >= {bar:g}x {peer}" + (", forward only" if op == "moe_layer_fwd" else "") + ")"
              if bar is not None else _NO_BAR.get((op, peer), "(no bar)"))
    if peer not in top.speedup:
        return f"{op} {top.case}: {peer} not timed ({top.peer_skipped.get(peer, 'see FAILED')}); {perf} {judged}"
    s = [(r.speedup[peer], r.case) for r in rs if peer in r.speedup]
    worst = min(s)
    zipf = next((r for r in results if r.op == op and r.model == preset and r.routing == "zipf"
                 and r.shape["T"] == top.shape["T"]), None)
    at_zipf = f"{zipf.speedup[peer]:.2f}x at {zipf.case}" if zipf is not None and peer in zipf.speedup else "not timed"
    verdict = "" if bar is None else f" [{'meets bar' if all(v >= bar for v, _ in s) else 'below bar'}]"
    return (f"{op} {top.case}: {top.speedup[peer]:.2f}x {peer} ({top.peer_variant[peer]}); min {worst[0]:.2f}x at "
            f"{worst[1]} over {len(s)} token count(s); zipf routing: {at_zipf}; {perf} {judged}{verdict}")


_NO_BAR = {("moe_layer_fwd_bwd", "hf_eager"): "(no bar: its backward builds a full-size weight gradient per expert; "
                                              "the bar is on the forward)"}


def headline(ctx: h.Context, results: list[LayerResult]) -> list[str]:
    lines = []
    all_bars = ", ".join(f">= {b:g}x {p} ({op})" for (op, p), b in BARS.items())
    for preset in HEADLINE_PRESETS:
        for op in OPS:
            rs = [r for r in results if r.op == op and r.model == preset and r.routing == HEADLINE_ROUTING]
            if not rs:
                lines.append(f"{op} {preset}: no {HEADLINE_ROUTING} case timed (see FAILED) (bar: {all_bars})")
                continue
            for peer in (p for (o, p) in BARS if o == op):
                lines.append(_bar_line(op, peer, BARS[(op, peer)], rs, results, preset))
            for peer in (p for o, p in _NO_BAR if o == op):
                lines.append(_bar_line(op, peer, None, rs, results, preset))
        if preset == TFLOPS_BAR[0]:
            lines.append(_tflops_line(results))
    return lines


def _tflops_line(results: list[LayerResult]) -> str:
    preset, T, bar = TFLOPS_BAR
    r = next((r for r in results if r.op == "moe_layer_fwd_bwd" and r.model == preset and r.shape["T"] == T
              and r.routing == HEADLINE_ROUTING), None)
    if r is None:
        return (f"moe_layer_fwd_bwd {preset}/T{T}/{HEADLINE_ROUTING}: not run (the full GPU run only, or see "
                f"FAILED) (bar: >= {bar:g} TFLOP/s)")
    return (f"moe_layer_fwd_bwd {r.case}: {r.tflops or 0:.1f} TFLOP/s, ours {r.us:.0f} us "
            f"(bar: >= {bar:g} TFLOP/s) [{'meets bar' if (r.tflops or 0) >= bar else 'below bar'}]")


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
                       f"{time_budget_s(ctx):g} s): " + ", ".join(f"{k} {n}" for k, n in few.items()))
    return [f"note: {line}" for line in out]


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:.2f}M tokens/s" if tokens_per_s >= 1e5 else f"{tokens_per_s:.0f} tokens/s"


def token_counts(ctx: h.Context, name: str) -> tuple[int, ...]:
    """The token counts model `name` runs at (module docstring)."""
    if not ctx.is_cuda:
        return CPU_TOKENS[:1] if ctx.quick else CPU_TOKENS
    if ctx.tokens is not None:
        return tuple(ctx.tokens)
    return (HEADLINE_T,) if ctx.quick else TOKENS + EXTRA_TOKENS.get(name, ())


def run(ctx: h.Context) -> h.Report:
    try:
        import transformers

        tf = f"transformers {transformers.__version__}"
    except ImportError:
        tf = "no transformers"
    print(f"moe_layer on {ctx.device}: ours runs {'the CUDA kernels' if ctx.ours_runs_kernels else 'the reference'}"
          f"; {tf}", flush=True)
    ctx.ceilings()  # measured before the layers take the memory
    models = ctx.pick(MODELS, ())[0] if ctx.is_cuda else CPU_MODELS
    results: list[LayerResult] = []
    failures: list[str] = []
    skipped_cases: list[str] = []
    setups: dict[str, str] = {}
    for i, (name, spec) in enumerate(models.items()):
        layer = peers = None
        tokens = token_counts(ctx, name)
        try:
            t0 = time.perf_counter()
            cfg, setups[name] = fit_config(ctx, spec, max(tokens))
            layer = build_ours(ctx, cfg)
            peers, skipped = build_peers(layer, spec)
            shifts = {routing: routing_shift(ctx, layer, routing) for routing in ROUTINGS}
            progress(name, "built ours and the peers", time.perf_counter() - t0,
                     ", ".join(peers) + (f"; left out: {', '.join(skipped)}" if skipped else ""))
            for T in tokens:
                for routing, shift in shifts.items():
                    t0 = time.perf_counter()
                    try:
                        rs, fs = run_case(ctx, name, spec, cfg, setups[name], T, layer, peers, skipped,
                                          routing, shift)
                    except torch.OutOfMemoryError as e:  # ours does not fit at this size: said, not fatal
                        h.skip_case("moe_layer", f"{name}/T{T}/{routing}", e, skipped_cases)
                        rs, fs = [], []
                    results += rs
                    failures += fs
                    _release(ctx)
                    progress(f"{name}/T{T}/{routing}", "case done", time.perf_counter() - t0)
        except (RuntimeError, ValueError) as e:  # e.g. out of memory building the layer
            failures.append(f"{name}: {reason(e)}")
        finally:
            del layer, peers
            _release(ctx)
        ctx.case_done("moe_layer", i, len(models))
    ctx.finish("moe_layer", results)
    return h.Report(results, headline(ctx, results) + notes(ctx, results, setups), failures, skipped_cases)
