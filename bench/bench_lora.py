"""LoRA on fused experts (moe_kernels.integrations.peft) against peft's own path, at the specs/perf.md MoE
layer shapes.

Case: our MoELayer with peft LoRA (r = 16, alpha = 32) on `experts.w13` and `experts.w2`, the base weights
frozen (fine-tuning), bf16 on a GPU (fp32 on the CPU), the input's gradient taken (as every layer's after the
first). One op, lora_fwd_bwd: the layer's forward and backward (router, permute, experts, unpermute; the router
and the permutes are the same code on both sides).
  ours               fuse_lora: each adapted product is grouped_mm(x, W) + s grouped_mm(grouped_mm(x, A), B)
  peft_materialised  peft's ParamWrapper: W + s B A formed for every expert on each forward (baddbmm),
                     then the same grouped GEMMs on it
FLOPs: 2 x 2 x rows x (2F H + H F), the frozen base products' forward and dgrad (no wgrad: W is frozen); the
adapters' rank-r work is not counted (it is what the two sides do differently). Bytes: x, w13, w2 and the
adapters read once, out written once.
Peak memory: on CUDA the peak allocated during one step above the step's start, for ours and the peer
(extra.peak_mib, extra.peer_peak_mib); not measured on the CPU.
Checked first, on the first input set: the outputs and the adapter gradients of both sides, relative L2
error at most 4 x 2^-8 apart on the GPU (two bf16 computations of one function: each bf16 rounding is
2^-9 relative, and peft's path also rounds W + BA to bf16) and 1e-5 on the CPU (fp32).
"""

from __future__ import annotations

import copy

import torch

from moe_kernels.integrations.peft import fuse_lora
from moe_kernels.nn import MoELayer
from moe_kernels.nn.moe import PRESETS

from . import harness as h

RANK = 16
# name: (T on the GPU, preset overrides)
MODELS = {"qwen3-30b-a3b": "qwen3-30b-a3b", "mixtral-8x7b": "mixtral-8x7b", "deepseek-v3": "deepseek-v3"}
CPU_OVERRIDES = dict(hidden_size=64, ffn_size=32, num_experts=8, k=2)


Case = h.ModelCase


def cases(ctx: h.Context) -> list[Case]:
    if not ctx.is_cuda:
        return [Case("tiny", 64)]
    tokens = (4096,) if ctx.quick else (4096, 8192)
    return [Case(m, T) for m in MODELS for T in tokens]


def _layers(ctx: h.Context, c: Case):
    import peft

    cfg = PRESETS[MODELS[c.model]]() if ctx.is_cuda else PRESETS["qwen3-30b-a3b"](**CPU_OVERRIDES)
    cfg = cfg.replace(shared_ffn_size=0) if getattr(cfg, "shared_ffn_size", 0) else cfg
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    torch.manual_seed(ctx.seed)
    layer = MoELayer(cfg, device=ctx.device, dtype=dtype)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=[],
                             target_parameters=["experts.w13", "experts.w2"], init_lora_weights=False)
    theirs = peft.get_peft_model(layer, config)
    ours = copy.deepcopy(theirs)
    assert fuse_lora(ours) == 2
    return cfg, ours, theirs, dtype


def _step(model):
    def run(x):
        out, aux = model(x)
        (out.float().square().mean() + aux).backward()
        return out
    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _check(ctx, c, ours, theirs, x) -> None:
    bound = 4 * 2.0**-8 if ctx.is_cuda else 1e-5
    outs = []
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        out = _step(model)(x)
        grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
        outs.append((out.detach(), grads))
    err = _rel(outs[0][0], outs[1][0])
    if not err <= bound:
        raise AssertionError(f"{c.name} lora: output relative L2 error {err:.3g} > {bound:.3g} against peft")
    for g_ours, g_theirs in zip(outs[0][1], outs[1][1]):
        err = _rel(g_ours, g_theirs)
        if not err <= bound:
            raise AssertionError(f"{c.name} lora: adapter gradient relative L2 error {err:.3g} > {bound:.3g}")


def _peak_mib(ctx, fn, x) -> float | None:
    if not ctx.is_cuda:
        return None
    torch.cuda.synchronize(ctx.device)
    start = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    fn(x)
    torch.cuda.synchronize(ctx.device)
    return (torch.cuda.max_memory_allocated(ctx.device) - start) / 2**20


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    cfg, ours, theirs, dtype = _layers(ctx, c)
    H, F, E = cfg.hidden_size, cfg.ffn_size, cfg.num_experts
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    # the input's gradient taken, as every layer's after the first: both products' input gradients run (the FLOPs)
    sets = [(torch.randn(c.T, H, generator=g, device=ctx.device, dtype=dtype).requires_grad_(),)
            for _ in range(ctx.n_input_sets)]
    _check(ctx, c, ours, theirs, sets[0][0])
    t_ours = ctx.time(_step(ours), sets)
    t_theirs = ctx.time(_step(theirs), sets)
    peak, peer_peak = _peak_mib(ctx, _step(ours), sets[0][0]), _peak_mib(ctx, _step(theirs), sets[0][0])
    rows = c.T * cfg.router.k
    es = torch.finfo(dtype).bits // 8
    flops = 2 * 2 * rows * (2 * F * H + H * F)  # forward + dgrad of the frozen base products
    nbytes = es * (c.T * H * 2 + E * 3 * F * H + E * RANK * (3 * H + 3 * F))
    r = h.make_result(ctx, op="lora_fwd_bwd", case=c.name, shape=dict(T=c.T, H=H, F=F, E=E, k=cfg.router.k, r=RANK),
                      dtype=dtype, timing=t_ours, nbytes=nbytes, flops=flops,
                      peers={"peft_materialised": t_theirs}, peer_variant={"peft_materialised": "ParamWrapper"})
    if peak is not None:
        r.extra.update(peak_mib=peak, peer_peak_mib=peer_peak)
    return [r]


def headline(results: list[h.Result]) -> list[str]:
    lines = []
    for r in results:
        mem = (f", peak {r.extra['peak_mib']:.0f} MiB vs {r.extra['peer_peak_mib']:.0f} MiB"
               if "peak_mib" in r.extra else " (peak memory measured on CUDA only)")
        lines.append(f"lora_fwd_bwd {r.case}: {r.speedup['peft_materialised']:.2f}x peft's materialising path{mem}")
    return lines


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "lora", cases(ctx), run_case)
    return h.Report(results, headline(results) if results else [], failures, skipped)
