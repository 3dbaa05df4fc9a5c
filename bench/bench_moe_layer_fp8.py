"""The MoE layer fwd+bwd with the FP8 blockwise recipe against the same layer in BF16 (both ours).

Cases (the bar's shapes; `--tokens` overrides the token count, 8192 by default):
  deepseek-v3-ep8  DeepSeek-V3's layer with its EP-8 local expert count: 32 experts, H 7168, F 2048, k 8, the
                   shared expert and the sigmoid router with groups
  qwen3-30b-a3b    E 128, H 2048, F 768, k 8
  nemotron-3-nano  Nemotron 3 Nano's experts: E 128, H 2688, F 1856 (no multiple of 128: the FP8 contractions over F
                   zero-padded to 1920), k 6, squared-ReLU experts and a shared expert of F 3712, the sigmoid router;
                   no bar, a measurement (is FP8 worth it on this model)
  gpt-oss-120b     the perf.md preset: E 128, H = F = 2880 (no multiples of 128: every FP8 contraction zero-padded
                   to 2944), k 4, SwiGLU experts; no bar, a measurement
on the CPU (the dry run): a tiny layer of each family (H = F = 128; nemotron-3-nano F = 208, gpt-oss-120b H = 144
and F = 208, padded) on 32 tokens, ours on the reference.
Ours: MoELayer(cfg) in bf16 (router fp32), and MoELayer(cfg.replace(recipe=Fp8BlockwiseRecipe())) holding the
same weights, in training mode, x [1, T, H] bf16 ~ randn; one call = forward, then backward of (out, aux) with
(dout, 1), every parameter's and x's .grad set to None first (no accumulation). The FP8 weight cache is on, as
moe-train runs it, timed two ways:
  step x1   the cache's generation bumped before each call (an optimizer step between micro-batches): the
            expert weights are quantized in every call. The result's time, and the bar's figure.
  later mb  no bump: a later micro-batch of a step with gradient accumulation (the cache hits). In `extra`.
Peer, timed in the same run on the same inputs: moe_kernels_bf16, the BF16 layer.
Bytes: bench/bytes.py's byte model (every kernel's reads and writes, counted on meta tensors) of the FP8
layer's step x1; the BF16 layer's count and the ratio in `extra`. FLOPs: bench_moe_layer.flops (3x forward).
Checked first, on the first input set: out, dx and each expert weight's gradient of the FP8 layer within
relative L2 error 0.1 of the BF16 layer's (FP8 keeps ~3 significant bits; a wrong scale, layout or expert is
far outside), and the aux losses equal (the router is the same fp32 computation).
Bar (specs/perf.md via bench.bars "fp8_layer"): >= 1.3x our bf16 layer at deepseek-v3 EP-8 local shapes,
>= 1.0x at qwen3-30b-a3b.
"""

from __future__ import annotations

import torch

from moe_kernels.nn import PRESETS, MoELayer
from moe_kernels.quant import Fp8BlockwiseRecipe, weight_cache

from . import bars
from . import bytes as byte_model
from . import harness as h
from .bench_grouped_mm_fp8 import _rel_l2
from .bench_moe_layer import flops

CASES = {"deepseek-v3-ep8": ("deepseek-v3", dict(num_experts=32), "deepseek-v3 EP-8 local"),
         "qwen3-30b-a3b": ("qwen3-30b-a3b", {}, "qwen3-30b-a3b"),
         "nemotron-3-nano": ("deepseek-v3", dict(hidden_size=2688, ffn_size=1856, shared_ffn_size=3712, num_experts=128,
                                                 k=6, num_groups=None, group_topk=None, activation="squared_relu"),
                             None),  # None: no bar
         "gpt-oss-120b": ("gpt-oss-120b", {}, None)}
CPU_SIZES = dict(hidden_size=128, ffn_size=128)
CPU_TOKENS = 32
TOKENS = 8192
RTOL_L2 = 0.1
BAR = bars.bar("fp8_layer")


class _Case:
    def __init__(self, model: str, T: int):
        self.model, self.T, self.name = model, T, f"{model}/T{T}"


def _configs(ctx: h.Context, name: str):
    preset, kw, _ = CASES[name]
    if not ctx.is_cuda:  # E 8 (4 groups of 2 for deepseek-v3), k 4
        kw = dict(kw, **CPU_SIZES, num_experts=8, k=4)
        if name == "deepseek-v3-ep8":
            kw.update(shared_ffn_size=128, num_groups=4, group_topk=2)
        if name == "nemotron-3-nano":
            kw.update(ffn_size=208, shared_ffn_size=128)
        if name == "gpt-oss-120b":
            kw.update(hidden_size=144, ffn_size=208)
    cfg = PRESETS[preset](**kw)
    return cfg, cfg.replace(recipe=Fp8BlockwiseRecipe())


def _layers(ctx: h.Context, name: str) -> tuple[MoELayer, MoELayer]:
    cfg, cfg8 = _configs(ctx, name)
    torch.manual_seed(ctx.seed)
    bf16 = MoELayer(cfg).to(ctx.device, torch.bfloat16)
    bf16.router.float()
    fp8 = MoELayer(cfg8).to(ctx.device, torch.bfloat16)
    fp8.router.float()
    fp8.load_state_dict(bf16.state_dict())
    return bf16, fp8


def _fwd_bwd(layer: MoELayer, bump: bool):
    params = list(layer.parameters())
    one = torch.ones((), device=params[0].device)

    def call(x, dout):
        if bump:
            weight_cache._bump_generation()
        for p in params:
            p.grad = None
        x.grad = None  # no accumulation into the input's gradient either (the byte model has none)
        out, aux = layer(x)
        torch.autograd.backward((out, aux), (dout, one))
        return out, aux

    return call


def _check(bf16: MoELayer, fp8: MoELayer, x: torch.Tensor, dout: torch.Tensor) -> None:
    got = {}
    for name, layer in (("bf16", bf16), ("fp8", fp8)):
        xi = x.detach().requires_grad_()
        out, aux = _fwd_bwd(layer, bump=True)(xi, dout)
        got[name] = dict(out=out.detach(), dx=xi.grad, aux=aux.detach(), w13=layer.experts.w13.grad,
                         w2=layer.experts.w2.grad)
    for key in ("out", "dx", "w13", "w2"):
        err = _rel_l2(got["fp8"][key], got["bf16"][key])
        assert err <= RTOL_L2, f"fp8 layer {key}: relative L2 error {err:.3g} against the bf16 layer > {RTOL_L2}"
    assert torch.equal(got["fp8"]["aux"], got["bf16"]["aux"]), "fp8 layer: aux loss differs from the bf16 layer's"


def run_case(ctx: h.Context, c: _Case) -> list[h.Result]:
    bf16, fp8 = _layers(ctx, c.model)
    cfg8 = fp8.config
    H = cfg8.hidden_size
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 1000)
    sets = [(torch.randn(1, c.T, H, generator=g, device=ctx.device).to(torch.bfloat16).requires_grad_(),
             torch.randn(1, c.T, H, generator=g, device=ctx.device).to(torch.bfloat16)) for _ in range(ctx.n_input_sets)]
    was = weight_cache.enabled()
    weight_cache.enable(True)
    try:
        _check(bf16, fp8, *sets[0])
        step = ctx.time(_fwd_bwd(fp8, bump=True), sets)
        later = ctx.time(_fwd_bwd(fp8, bump=False), sets)
        peer = ctx.time(_fwd_bwd(bf16, bump=False), sets)
    finally:
        weight_cache.clear()
        weight_cache.enable(was)
    b8 = byte_model.layer(cfg8, c.T).bytes
    b16 = byte_model.layer(bf16.config, c.T).bytes
    shape = {"T": c.T, "H": H, "F": cfg8.ffn_size, "E": cfg8.num_experts, "k": cfg8.router.k}
    r = h.make_result(ctx, op="moe_layer_fp8_fwd_bwd", case=c.name, shape=shape, dtype=torch.bfloat16, timing=step,
                      nbytes=b8, flops=3 * flops(cfg8, c.T), peers={"moe_kernels_bf16": peer},
                      peer_variant={"moe_kernels_bf16": "MoELayer bf16 fwd+bwd"},
                      ceiling="matmul_fp8" if ctx.is_cuda and ctx.ceilings().matmul_fp8_tflops else None)
    r.extra.update(later_mb_us=later.us, later_mb_speedup=peer.us / later.us if later.us else 0.0,
                   bf16_bytes=b16, bytes_vs_bf16=b8 / b16)
    return [r]


def headline(results: list[h.Result]) -> list[str]:
    lines = []
    for r in results:
        name = r.case.split("/")[0]
        s = r.speedup["moe_kernels_bf16"]
        where = CASES[name][2]
        if where is None:
            bar = "no bar"
        else:
            t = BAR.threshold("speedup:moe_kernels_bf16", where)
            bar = f"bar: >= {t.value}x at {t.where}: {'met' if t.met(s) else 'missed'}"
        lines.append(f"moe_layer_fp8_fwd_bwd {r.case}: {s:.2f}x our bf16 layer with the weights quantized every call, "
                     f"{r.extra['later_mb_speedup']:.2f}x on a later micro-batch (weight cache hit); bytes "
                     f"{r.extra['bytes_vs_bf16']:.2f}x the bf16 layer's (byte model) ({bar})")
    return lines


def run(ctx: h.Context) -> h.Report:
    if ctx.is_cuda:
        names, tokens = ctx.pick(CASES, (TOKENS,))
    else:
        names, tokens = CASES, (CPU_TOKENS,)
    cases = [_Case(n, T) for n in names for T in tokens]
    results, failures, skipped = h.run_cases(ctx, "moe_layer_fp8", cases, run_case)
    return h.Report(results, headline(results) if results else [], failures, skipped)
