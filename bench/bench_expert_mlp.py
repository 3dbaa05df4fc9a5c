"""The gather-fused expert MLP (MoEConfig(gather_experts=True), moe_kernels/ops/expert_mlp.py) against the layer's
permuted path, at the specs/perf.md MoE layer shapes: activation memory kept for the backward, and time.

Case: MoELayer(PRESETS[model](weights_in_activation=True)) in training mode, bf16 weights and x [1, T, H] on a GPU
(the router fp32), fp32 on the CPU; every routed expert on the one GPU (EP = 1). One op, expert_mlp_fwd_bwd: the
layer's forward and backward (router, routing, experts, combine, shared experts), for
  ours       gather_experts=True: the routing alone (no token copied), then expert_mlp: the first GEMM gathers x's
             rows, SwiGLU and the routing weight in its epilogue; the backward gathers dout's rows
  permuted   gather_experts=False: permute copies x into expert order, the experts, unpermute (the fused regions)
Reported per case:
  kept_bytes (extra.kept_mib, extra.peer_kept_mib, extra.saved_mib): the bytes autograd keeps for the backward
             beyond the parameters and x, counted on the meta device (no memory, no kernels: the same on a CPU
             and a GPU), each storage once. The difference is R (H + F) elements (x_perm and the activation,
             which the gathered path recomputes from h) less R int32 (row_token), R = T k rounded per expert;
             the analytic value is checked against the count (extra.saved_mib_model). Counted on the registered
             ops, which meta tensors take. Eagerly on a GPU (fused_kept_bytes) the permuted path's `experts` region
             does not keep the activation either (its backward writes it again from h): R F elements fewer; and
             on both paths the shared experts' `mlp` region keeps neither their activation nor (no autocast) its
             stacked copy of their gate and up weights: T Fs + 2 Fs H elements fewer. The memory lines print both
             counts.
  peak       on CUDA, the peak allocated during one step above the step's start, ours and permuted
             (extra.peak_mib, extra.peer_peak_mib); not measured on the CPU.
  time       fwd+bwd, harness.time_fn, ours against permuted in the same run.
The gathered products run the sm_90a gather kernels where MOE_KERNELS_GATHER_CUTLASS=1 was set before the process
first asked (the perf mode sets it), else the portable grouped GEMM, on tensor cores where MOE_KERNELS_PORTABLE_MMA=1
was set (bf16, fp16; sm_80 and later); the result's peer_variant["ours"], extra.gather_kernels and
extra.tensor_cores say which.
Checked first, on the first input set: both paths' outputs and x gradients, relative L2 error at most
4 x 2^-8 apart on a GPU (bf16: each rounding 2^-9 relative, the two paths sum in other orders on sm_90a), and
equal on the CPU (the same reference products).
FLOPs: 3 x (2 T k 3 H F + 2 T 3 H F_shared + 2 T H E), as bench_moe_layer. Bytes: x, dout and the weights read
once, out, dx and the weight gradients written once.
"""

from __future__ import annotations


import torch

from moe_kernels.nn import MoELayer
from moe_kernels.nn.moe import PRESETS
from moe_kernels.ops.grouped_mm import portable_mma_opted_in
from moe_kernels.ops.permute import permuted_rows

from . import harness as h

MODELS = ("qwen3-30b-a3b", "deepseek-v3", "qwen3-235b", "mixtral-8x7b", "gpt-oss-120b")
QUICK_MODELS = ("qwen3-30b-a3b", "deepseek-v3")
TOKENS = 8192
CPU_OVERRIDES = dict(hidden_size=64, ffn_size=32, num_experts=8, k=2)
CPU_TOKENS = 64
CHECK_REL = 4 * 2.0**-8


Case = h.ModelCase


def cases(ctx: h.Context) -> list[Case]:
    if not ctx.is_cuda:
        return [Case("tiny-qwen3-30b-a3b", CPU_TOKENS), Case("tiny-deepseek-v3", CPU_TOKENS)]
    models = ctx.models or (QUICK_MODELS if ctx.quick else MODELS)
    return [Case(m, T) for m in models for T in (ctx.tokens or (TOKENS,))]


def config(model: str, **changes):
    if model.startswith("tiny-"):
        extra = dict(num_groups=4, group_topk=2, shared_ffn_size=32) if "deepseek" in model else {}
        return PRESETS[model.removeprefix("tiny-")](**CPU_OVERRIDES, **extra, weights_in_activation=True, **changes)
    return PRESETS[model](weights_in_activation=True, **changes)


def kept_bytes(cfg, T: int, dtype: torch.dtype) -> int:
    """Bytes autograd keeps for the layer's backward beyond its parameters and x, on the meta device."""
    with torch.device("meta"):
        layer = MoELayer(cfg).to(dtype)
        layer.router.float()
        x = torch.empty(1, T, cfg.hidden_size, dtype=dtype, requires_grad=True)
    own = {id(p.untyped_storage()) for p in layer.parameters()} | {id(x.untyped_storage())}
    own_params = {p for p in layer.parameters()} | {x}
    kept: dict[int, int] = {}

    def pack(t):
        if not any(t is o for o in own_params) and id(t.untyped_storage()) not in own:
            kept[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values())


def fused_kept_bytes(cfg, T: int, dtype: torch.dtype, kept: int) -> int:
    """`kept` (kept_bytes: the registered ops) as the fused regions keep it eagerly on a GPU (module docstring)."""
    c = torch.finfo(dtype).bits // 8
    Fs = cfg.shared_ffn_size  # (+ 4: their one group's size, kept by the registered GEMM)
    shared = (T * Fs + 2 * Fs * cfg.hidden_size) * c + (4 if Fs else 0)
    R = permuted_rows(T, cfg.router.k, cfg.num_experts, cfg.permute_align)
    routed = 0 if cfg.gather_experts else R * cfg.ffn_size * c
    return kept - routed - shared


def saved_model_bytes(cfg, T: int, dtype: torch.dtype) -> int:
    """R (H + F) elements of `dtype` less R int32: what the gathered path does not keep (module docstring)."""
    R = permuted_rows(T, cfg.router.k, cfg.num_experts, cfg.permute_align)
    return R * (cfg.hidden_size + cfg.ffn_size) * (torch.finfo(dtype).bits // 8) - 4 * R


def _step(layer):
    def run(x, dout):
        x = x.detach().requires_grad_()
        out, aux = layer(x)
        torch.autograd.backward((out, aux), (dout, torch.ones_like(aux)))
        return out.detach(), x.grad
    return run


def _peak_mib(ctx: h.Context, fn, *args) -> float | None:
    if not ctx.is_cuda:
        return None
    torch.cuda.synchronize(ctx.device)
    start = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    fn(*args)
    torch.cuda.synchronize(ctx.device)
    return (torch.cuda.max_memory_allocated(ctx.device) - start) / 2**20


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    cfg = config(c.model)
    ours_cfg = cfg.replace(gather_experts=True)
    kept, peer_kept = kept_bytes(ours_cfg, c.T, dtype), kept_bytes(cfg, c.T, dtype)
    model = saved_model_bytes(cfg, c.T, dtype)
    if peer_kept - kept != model:
        raise AssertionError(f"{c.name}: the gathered path keeps {peer_kept - kept} bytes fewer, the model says {model}")
    torch.manual_seed(ctx.seed)
    ours = MoELayer(ours_cfg, device=ctx.device, dtype=dtype)
    ours.router.float()
    peer = MoELayer(cfg, device=ctx.device, dtype=dtype)
    peer.router.float()
    peer.load_state_dict(ours.state_dict())
    H = cfg.hidden_size
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 1)
    sets = [(torch.randn(1, c.T, H, generator=g, device=ctx.device, dtype=dtype),
             torch.randn(1, c.T, H, generator=g, device=ctx.device, dtype=dtype)) for _ in range(ctx.n_input_sets)]
    (o1, dx1), (o2, dx2) = _step(ours)(*sets[0]), _step(peer)(*sets[0])
    if ours.expert_path != "gathered":
        raise AssertionError(f"{c.name}: the layer took its {ours.expert_path!r} path, not the gathered one")
    bound = CHECK_REL if ctx.is_cuda else 0.0
    for what, a, b in (("out", o1, o2), ("dx", dx1, dx2)):
        err = _rel(a, b)
        if not err <= bound:
            raise AssertionError(f"{c.name}: {what} relative L2 error {err:.3g} > {bound:.3g} against the permuted path")
    t_ours = ctx.time(_step(ours), sets)
    t_peer = ctx.time(_step(peer), sets)
    peak, peer_peak = _peak_mib(ctx, _step(ours), *sets[0]), _peak_mib(ctx, _step(peer), *sets[0])
    k, E, F, Fs = cfg.router.k, cfg.num_experts, cfg.ffn_size, cfg.shared_ffn_size
    flops = 3 * (2 * c.T * k * 3 * H * F + 2 * c.T * 3 * H * Fs + 2 * c.T * H * E)
    es = torch.finfo(dtype).bits // 8
    weights = es * (E * 3 * H * F + 3 * H * Fs) + 4 * E * H
    nbytes = es * 4 * c.T * H + 2 * weights
    r = h.make_result(ctx, op="expert_mlp_fwd_bwd", case=c.name, shape=dict(T=c.T, H=H, F=F, E=E, k=k),
                      dtype=dtype, timing=t_ours, nbytes=nbytes, flops=flops, peers={"permuted": t_peer},
                      peer_variant={"permuted": "permute + fused experts region + unpermute"})
    C = getattr(__import__("moe_kernels")._ext, "_C", None)
    gather = ctx.is_cuda and C is not None and getattr(C, "grouped_mm_gather_enabled", lambda: False)()
    cores = (ctx.is_cuda and not gather and dtype != torch.float32 and torch.cuda.get_device_capability()[0] >= 8
             and portable_mma_opted_in())
    r.peer_variant["ours"] = ("sm_90a gather kernels" if gather else
                              "portable grouped GEMM on tensor cores (gathered rows)" if cores else
                              "portable grouped GEMM (gathered rows)")
    r.extra.update(gather_kernels=float(gather), tensor_cores=float(cores), kept_mib=kept / 2**20, peer_kept_mib=peer_kept / 2**20, saved_mib=(peer_kept - kept) / 2**20,
                   saved_mib_model=model / 2**20)
    if peak is not None:
        r.extra.update(peak_mib=peak, peer_peak_mib=peer_peak)
    return [r]


def _mib(x: float) -> str:
    return f"{x:.1f} MiB" if x >= 1 else f"{x * 1024:.1f} KiB"


def headline(results: list[h.Result]) -> list[str]:
    lines = []
    for r in results:
        x = r.extra
        mem = (f"; peak {x['peak_mib']:.0f} MiB vs {x['peer_peak_mib']:.0f} MiB" if "peak_mib" in x
               else " (peak memory measured on CUDA only)")
        lines.append(f"expert_mlp {r.case}: keeps {_mib(x['kept_mib'])} for the backward vs {_mib(x['peer_kept_mib'])} "
                     f"({_mib(x['saved_mib'])} less per layer, computed); fwd+bwd "
                     f"{r.speedup['permuted']:.2f}x the permuted path{mem}")
    return lines


# The perf.md shapes whose memory is computed on any device (meta tensors), bf16.
MEMORY_SHAPES = [(m, TOKENS) for m in MODELS] + [("qwen3-30b-a3b", 32768)]


def memory_lines() -> list[str]:
    """The activation bytes kept per layer at the perf.md shapes, bf16, both paths (computed, no device)."""
    lines = []
    for model, T in MEMORY_SHAPES:
        cfg = config(model)
        ours, peer = kept_bytes(cfg.replace(gather_experts=True), T, torch.bfloat16), kept_bytes(cfg, T, torch.bfloat16)
        if peer - ours != saved_model_bytes(cfg, T, torch.bfloat16):
            raise AssertionError(f"{model}/T{T}: the kept bytes do not follow the model")
        ours_f = fused_kept_bytes(cfg.replace(gather_experts=True), T, torch.bfloat16, ours)
        peer_f = fused_kept_bytes(cfg, T, torch.bfloat16, peer)
        lines.append(f"expert_mlp memory {model}/T{T} bf16 (computed): on the fused regions (eager, GPU) keeps "
                     f"{ours_f / 2**20:.0f} MiB for the backward vs {peer_f / 2**20:.0f} MiB on the permuted path, "
                     f"{(peer_f - ours_f) / 2**20:.0f} MiB less per layer ({1 - ours_f / peer_f:.0%}); on the "
                     f"registered ops (compiled) {ours / 2**20:.0f} vs {peer / 2**20:.0f} MiB "
                     f"({1 - ours / peer:.0%} less)")
    return lines


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "expert_mlp", cases(ctx), run_case)
    return h.Report(results, (headline(results) if results else []) + memory_lines(), failures, skipped)
