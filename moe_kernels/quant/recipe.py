"""Precision recipes for the routed experts (specs/lowprec.md).

`Fp8BlockwiseRecipe` is DeepSeek-V3's FP8 training recipe on Hopper for the expert GEMMs:
  forward  out = x @ w^T      x: E4M3, one scale per 1x128 block along K; w: E4M3, one per 128x128 tile
  dgrad    dx  = dout @ w     dout: E4M3 1x128 blocks along N; w: the forward's tiles, transposed (a
                              128x128 tile is its own transpose, so the codes and scales are reused)
  wgrad    dw  = dout^T @ x   in the input precision (bf16 under autocast): the grouped FP8 kernel
                              splits M by groups, and wgrad contracts over M
with fp32 accumulation promoted every 128 of K (grouped_mm_fp8). Scales are current (computed from the
tensor itself each step), optionally rounded down to powers of two. Each expert's rows are padded to
`align` by permute. The saved activations stay in the input precision (wgrad reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_kernels.ops.grouped_mm import autocast_input
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8, quantize_fp8_experts
from moe_kernels.ops.quant import BLOCK, quantize_fp8


@dataclass(frozen=True, kw_only=True)
class Fp8BlockwiseRecipe:
    pow2_scale: bool = False  # scales rounded down to powers of two (exact rescaling)
    fp8_dgrad: bool = True  # False: dgrad in the input precision too
    align: int = 128  # rows per expert padded to this

    def __post_init__(self):
        if self.align < 1:
            raise ValueError("Fp8BlockwiseRecipe: align must be >= 1")

    def check_shapes(self, hidden_size: int, ffn_size: int) -> None:
        """Both expert GEMMs contract over H (gate/up) or F (down) in blocks of 128."""
        if hidden_size % BLOCK or ffn_size % BLOCK:
            raise ValueError(
                f"Fp8BlockwiseRecipe: hidden_size ({hidden_size}) and ffn_size ({ffn_size}) must be multiples of "
                f"{BLOCK} (one scale per 128 along each GEMM's K)"
            )

    def grouped_mm(self, x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
        """Drop-in for ops.grouped_mm: [M, K] x [E, N, K] -> [M, N] in x's dtype (autocast's under autocast)."""
        return _Fp8GroupedMM.apply(autocast_input(x), w, group_sizes, self)


RECIPES = {"bf16": None, "fp8-blockwise": Fp8BlockwiseRecipe()}


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, group_sizes: Tensor, recipe: Fp8BlockwiseRecipe) -> Tensor:
        x_q, x_scale = quantize_fp8(x, "block", pow2_scale=recipe.pow2_scale)  # [M, K], [M, K/128]
        w_q, w_scale = quantize_fp8_experts(w.detach(), pow2_scale=recipe.pow2_scale)  # [E, N, K], [E, N/128, K/128]
        out = grouped_mm_fp8(x_q, x_scale, w_q, w_scale, group_sizes).to(x.dtype)
        fp8_dgrad = recipe.fp8_dgrad and w.shape[1] % BLOCK == 0
        ctx.fp8_dgrad, ctx.pow2_scale = fp8_dgrad, recipe.pow2_scale
        ctx.save_for_backward(x, w, group_sizes, *((w_q, w_scale) if fp8_dgrad else ()))
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        x, w, group_sizes, *w_fp8 = ctx.saved_tensors
        dout = dout.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if ctx.fp8_dgrad:
                w_q, w_scale = w_fp8
                d_q, d_scale = quantize_fp8(dout, "block", pow2_scale=ctx.pow2_scale)  # [M, N], [M, N/128]
                wt_q = w_q.transpose(1, 2).contiguous()  # [E, K, N]
                wt_scale = w_scale.transpose(1, 2).contiguous()  # [E, K/128, N/128]
                dx = grouped_mm_fp8(d_q, d_scale, wt_q, wt_scale, group_sizes).to(x.dtype)
            else:
                dx = torch.ops.moe_kernels.grouped_mm_dgrad(dout, w.to(dout.dtype), group_sizes)
        if ctx.needs_input_grad[1]:
            dw = torch.ops.moe_kernels.grouped_mm_wgrad(dout, x, group_sizes).to(w.dtype)
        return dx, dw, None, None
