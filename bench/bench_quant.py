"""FP8 quantization (current scaling) at the activation and weight shapes of specs/perf.md.

Bytes, each input read once and each output written once (es = element size of x, bf16):
  quantize_fp8_<granularity>   x M*K*es -> q M*K + scales 4 per scale
  dequantize_fp8_block         q M*K + scales -> x M*K*es
  quantize_nvfp4_<mode>        x M*K*es (+ the global amax) -> codes M*K/2 + block scales M*K/16 + 4;
                               modes: given_amax (the perf.md bar: >= 80% of copy bandwidth), 1d (an
                               amax pass first: x is read twice, counted once), stochastic, tile_2d (weights)
  dequantize_nvfp4             codes + block scales -> x M*K*es
  quantize_fp8_experts_dual    w E*N*K*es -> codes in both layouts 2*E*N*K + scales 2*4 per 128x128 tile
  quantize_fp8_experts_dual_copy
                               fp32 masters E*N*K*4 -> bf16 copy E*N*K*2 + the dual codes and scales (the
                               master-weights step's write of an expert weight, weight_cache.refresh)
Cases: activations [T, H] ("tensor", "row", "block" = 1x128 along H) and one expert's weight
[2F, H] stacked over the local experts ("tile" = 128x128), per perf.md model.
Peer, timed in the same run on the same inputs:
  torch_eager  moe_kernels' PyTorch reference called directly: abs + amax per scale (padding the last
               block), one division per scale, multiply, clamp, cast, and a NaN code fix-up; the
               vectorised composition a user would write.
  copy_then_quantize  (the copying form only) what it replaces: the bf16 copy written by `copy_`, then read
               back by our one-layout-pair kernel (quantize_fp8_experts_dual).
Checked before timing, on the first input set: codes and scales bit-identical to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import moe_kernels
from moe_kernels.ops.quant import (
    dequantize_fp8_reference,
    dequantize_nvfp4_reference,
    quantize_fp8_reference,
    quantize_nvfp4_reference,
    scale_shape,
)

from . import harness as h

# name: (H, expert FFN)
MODELS = {"deepseek-v3": (7168, 2048), "qwen3-235b": (4096, 1536), "mixtral-8x7b": (4096, 14336)}
TOKENS = (8192, 16384)
CPU_MODELS = {"tiny": (256, 128)}
HEADLINE_CASE = "deepseek-v3/T16384"
ACT_GRANULARITIES = ("tensor", "row", "block")


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    H: int
    F: int

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}"


def cases(ctx: h.Context) -> list[Case]:
    return [Case(*c) for c in h.model_sweep(ctx, MODELS, CPU_MODELS, TOKENS, (16384,))]


def _nbytes_quant(gran: str, M: int, K: int, es: int) -> int:
    n_scales = 1
    for d in scale_shape(gran, M, K):
        n_scales *= d
    return M * K * es + M * K + 4 * n_scales


def _check(what: str, ours: tuple, ref: tuple) -> None:
    h.check_exact(f"{what} codes", ours[0].view(torch.uint8), ref[0].view(torch.uint8))
    h.check_exact(f"{what} scales", ours[1], ref[1])


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(ctx.seed)
    acts = [torch.randn(c.T, c.H, generator=gen, device=dev).to(torch.bfloat16) for _ in range(ctx.n_input_sets)]
    # tile: the gate/up weight [2F, H] of one expert, 8 experts stacked: a weight-sized problem
    weights = [torch.randn(8 * 2 * c.F, c.H, generator=gen, device=dev).to(torch.bfloat16) * 0.02
               for _ in range(ctx.n_input_sets)]
    jobs = [(g, acts) for g in ACT_GRANULARITIES] + [("tile", weights)]
    results = []
    for gran, xs in jobs:
        what = f"{c.name} quantize_fp8_{gran}"
        _check(what, moe_kernels.quantize_fp8(xs[0], gran), quantize_fp8_reference(xs[0], gran))
        ours = ctx.time(lambda x, g=gran: moe_kernels.quantize_fp8(x, g), [(x,) for x in xs])
        peer = ctx.time(lambda x, g=gran: quantize_fp8_reference(x, g), [(x,) for x in xs])
        M, K = xs[0].shape
        results.append(h.make_result(ctx, op=f"quantize_fp8_{gran}", case=c.name, shape=dict(M=M, K=K),
                                     dtype=torch.bfloat16, timing=ours, nbytes=_nbytes_quant(gran, M, K, 2),
                                     flops=0, peers={"torch_eager": peer}, peer_variant={"torch_eager": "reference"}))
    quantized = [moe_kernels.quantize_fp8(x, "block") for x in acts]
    ref = dequantize_fp8_reference(*quantized[0], "block")
    h.check_exact(f"{c.name} dequantize_fp8_block", moe_kernels.dequantize_fp8(*quantized[0], "block"), ref)
    ours = ctx.time(lambda q, s: moe_kernels.dequantize_fp8(q, s, "block"), quantized)
    peer = ctx.time(lambda q, s: dequantize_fp8_reference(q, s, "block"), quantized)
    results.append(h.make_result(ctx, op="dequantize_fp8_block", case=c.name, shape=dict(M=c.T, K=c.H),
                                 dtype=torch.bfloat16, timing=ours, nbytes=_nbytes_quant("block", c.T, c.H, 2),
                                 flops=0, peers={"torch_eager": peer}, peer_variant={"torch_eager": "reference"}))
    results += _experts(ctx, c, weights)
    results += _nvfp4(ctx, c, acts, weights)
    return results


def _nbytes_experts_dual(E: int, N: int, K: int, es_in: int, es_copy: int = 0) -> int:
    tiles = E * -(-N // 128) * -(-K // 128)
    return E * N * K * (es_in + es_copy + 2) + 2 * 4 * tiles


def _experts(ctx: h.Context, c: Case, weights: list) -> list[h.Result]:
    """The weight cache's quantization of the stacked experts [8, 2F, H], from bf16 weights and, with the copy,
    from fp32 masters."""
    from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_experts_dual_reference

    def check_tiles(what: str, got: tuple, want: tuple) -> None:
        for name, a, b in zip(("codes", "scales", "transposed codes", "transposed scales"), got, want):
            bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
            h.check_exact(f"{what} {name}", bits(a), bits(b))

    ws = [w.view(8, 2 * c.F, c.H) for w in weights]
    E, N, K = ws[0].shape
    what = f"{c.name} quantize_fp8_experts_dual"
    check_tiles(what, moe_kernels.quantize_fp8_experts_dual(ws[0]), quantize_fp8_experts_dual_reference(ws[0]))
    ours = ctx.time(lambda w: moe_kernels.quantize_fp8_experts_dual(w), [(w,) for w in ws])
    peer = ctx.time(lambda w: quantize_fp8_experts_dual_reference(w), [(w,) for w in ws])
    results = [h.make_result(ctx, op="quantize_fp8_experts_dual", case=c.name, shape=dict(E=E, N=N, K=K),
                             dtype=torch.bfloat16, timing=ours, nbytes=_nbytes_experts_dual(E, N, K, 2), flops=0,
                             peers={"torch_eager": peer}, peer_variant={"torch_eager": "reference"})]
    masters = [w.float() * 1.001 for w in ws]  # values a bf16 copy rounds
    copies = [torch.empty_like(w) for w in ws]
    got = moe_kernels.quantize_fp8_experts_dual(masters[0], copy_to=copies[0])
    h.check_exact(f"{what} copy", copies[0], masters[0].to(torch.bfloat16))
    check_tiles(f"{what} copy", got, moe_kernels.quantize_fp8_experts_dual(masters[0].to(torch.bfloat16)))

    def composed(m, cp):
        cp.copy_(m)
        return moe_kernels.quantize_fp8_experts_dual(cp)

    inputs = list(zip(masters, copies))
    ours = ctx.time(lambda m, cp: moe_kernels.quantize_fp8_experts_dual(m, copy_to=cp), inputs)
    peer = ctx.time(composed, inputs)
    results.append(h.make_result(ctx, op="quantize_fp8_experts_dual_copy", case=c.name, shape=dict(E=E, N=N, K=K),
                                 dtype=torch.float32, timing=ours, nbytes=_nbytes_experts_dual(E, N, K, 4, 2),
                                 flops=0, peers={"copy_then_quantize": peer},
                                 peer_variant={"copy_then_quantize": "ours"}))
    return results


def _nbytes_nvfp4(M: int, K: int, es: int) -> int:
    return M * K * es + M * K // 2 + M * K // 16 + 4


def _nvfp4(ctx: h.Context, c: Case, acts: list, weights: list) -> list[h.Result]:
    dev = ctx.device
    amax = [x.float().abs().amax() for x in acts]
    rng = torch.tensor([1, 0], device=dev)
    # Each input set as the op's arguments (x, global_amax, tile_2d, rng); the reference takes the same.
    jobs = {
        "given_amax": [(x, a, False, None) for x, a in zip(acts, amax)],
        "1d": [(x, None, False, None) for x in acts],
        "stochastic": [(x, None, False, rng) for x in acts],
        "tile_2d": [(w, None, True, None) for w in weights],
    }
    ours_op = torch.ops.moe_kernels.quantize_nvfp4
    results = []
    for mode, inputs in jobs.items():
        ours0, ref0 = ours_op(*inputs[0]), quantize_nvfp4_reference(*inputs[0])
        what = f"{c.name} quantize_nvfp4_{mode}"
        h.check_exact(f"{what} codes", ours0[0], ref0[0])
        h.check_exact(f"{what} block scales", ours0[1].view(torch.uint8), ref0[1].view(torch.uint8))
        h.check_exact(f"{what} global scale", ours0[2], ref0[2])
        ours, peer = ctx.time(ours_op, inputs), ctx.time(quantize_nvfp4_reference, inputs)
        M, K = inputs[0][0].shape
        results.append(h.make_result(ctx, op=f"quantize_nvfp4_{mode}", case=c.name, shape=dict(M=M, K=K),
                                     dtype=torch.bfloat16, timing=ours, nbytes=_nbytes_nvfp4(M, K, 2), flops=0,
                                     peers={"torch_eager": peer}, peer_variant={"torch_eager": "reference"}))
    quantized = [moe_kernels.quantize_nvfp4(x) for x in acts]
    h.check_exact(f"{c.name} dequantize_nvfp4", moe_kernels.dequantize_nvfp4(*quantized[0]),
                  dequantize_nvfp4_reference(*quantized[0]))
    ours = ctx.time(lambda p, s, g: moe_kernels.dequantize_nvfp4(p, s, g), quantized)
    peer = ctx.time(lambda p, s, g: dequantize_nvfp4_reference(p, s, g), quantized)
    results.append(h.make_result(ctx, op="dequantize_nvfp4", case=c.name, shape=dict(M=c.T, K=c.H),
                                 dtype=torch.bfloat16, timing=ours, nbytes=_nbytes_nvfp4(c.T, c.H, 2), flops=0,
                                 peers={"torch_eager": peer}, peer_variant={"torch_eager": "reference"}))
    return results


def headline(ctx: h.Context, results: list[h.Result]) -> list[str]:
    case = HEADLINE_CASE if any(r.case == HEADLINE_CASE for r in results) else results[0].case
    return [f"{r.op} {case}: {r.pct_of_ceiling:.1f}% of copy bandwidth ({r.gbps:.0f} of "
            f"{ctx.ceiling_of(r).copy_gbps:.0f} GB/s), "
            + ", ".join(f"{r.speedup[p]:.2f}x {p.replace('_', ' ')}" for p in r.speedup)
            for r in results if r.case == case]


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "quant", cases(ctx), run_case)
    return h.Report(results, headline(ctx, results) if results else [], failures, skipped)
