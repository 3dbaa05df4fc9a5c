"""Precision recipes for the routed experts (specs/lowprec.md): FP8 blockwise and NVFP4.

`Fp8BlockwiseRecipe` is DeepSeek-V3's FP8 training recipe on Hopper for the expert GEMMs, all three
products in E4M3:
  forward  out = x @ w^T      x: E4M3, one scale per 1x128 block along K; w: E4M3, one per 128x128 tile
  dgrad    dx  = dout @ w     dout: E4M3 1x128 blocks along N; w: the forward's tiles, transposed (a
                              128x128 tile is its own transpose, so the codes and scales are reused)
  wgrad    dw  = dout^T @ x   dout and x: E4M3 in 1x128 blocks along the tokens (the contraction), the
                              groups splitting it (grouped_mm_fp8_wgrad); fp32 result. `fp8_wgrad=False`
                              runs it in the input precision instead.
with fp32 accumulation promoted every 128 of the contraction. Scales are current (computed from the
tensor itself each step), optionally rounded down to powers of two. While training, each expert weight is
quantized once per optimizer step, its tiles in both layouts (one kernel, quantize_fp8_experts_dual, writes
both from one read of the weight) kept by moe_kernels.quant.weight_cache and
reused by every micro-batch and recomputation until the weight changes. Each expert's rows are padded to
`align` (a multiple of 128 for the FP8 wgrad: its token blocks must not straddle two experts). With
FP8 wgrad the forward saves x quantized along the tokens (1 byte per element) instead of x itself.
In the MoE layer (`permute_grouped_mm`, `fused_permute=True`) the first expert GEMM's input is written in E4M3
by the pass that permutes it: with FP8 wgrad and 16-bit rows, a gather of each permuted row's token writing both
layouts the GEMM reads (unpermute_bwd_quantize_fp8 with no weights: the forward's 1x128 blocks and wgrad's token-major
blocks), so no bf16 copy of the permuted rows is written or saved; otherwise permute_quantize_fp8 (the permute,
the padding and the forward quantization in one pass over the tokens).
With `fused_swiglu` the SwiGLU writes the second GEMM's input in E4M3 (swiglu_quantize_fp8), and in the
backward the first GEMM's output gradient in E4M3, both layouts (swiglu_bwd_quantize_fp8), handed to the
first GEMM's backward directly (for experts without a gate the squared ReLU's: squared_relu_quantize_fp8,
squared_relu_bwd_quantize_fp8); the unpermute's backward (`Fp8BlockwiseRecipe.unpermute`) does the same for the
second GEMM's output gradient (unpermute_bwd_quantize_fp8). No bf16 gradient inside the experts is written.
Called eagerly with these defaults (bf16 tokens, routing weights in the unpermute, training), MoELayer runs the same
kernels on the same operands as one fused region (`moe_fp8`, moe_kernels.nn.fused_fp8): one autograd node and one
extension call each way instead of the three functions here, bit for bit their results, wherever every expert GEMM
has an FP8 kernel.

Weights stored [E, K, N] (transformers' GPT-OSS, Aria and Llama 4 experts; `grouped_mm_kn`): the same three
products. The one quantization of the stored weight writes both layouts of its tiles (quantize_fp8_experts_dual on
[E, K, N]), the forward reading the transposed ones ([E, N, K], as the [E, N, K] weight's forward tiles) and dgrad
the stored ones; wgrad takes its operands the other way round (x^T dout, [E, K, N]). So no transposed copy of the
weight is made, and the codes are those of the [E, N, K] weight w.transpose(1, 2).

A contraction that is no multiple of 128 (GPT-OSS's H = F = 2880, Nemotron 3 Nano's F = 1856) is zero-padded to
one: every producer above writes its codes' rows padded with zeros in the same pass (a multiple of 8 is all they
need: 16-byte rows), as does quantize_fp8(..., pad_to_block=True) where no producer applies, and the weight's
codes in that layout are written padded by the quantization that makes both layouts
(quantize_fp8_experts_dual(..., pad_to_block=True), held by the weight cache; where an entry was made otherwise,
`Fp8Weights.gemm_tiles` pads it with one copy). The last partial block's scale covers the elements present, so
the padded products add exact zeros: the result is the unpadded one's. Only permute_quantize_fp8 (the first GEMM's
input without FP8 wgrad, or from fp32 rows) writes unpadded rows: there H off 128 takes the composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.ops.grouped_mm import autocast_input
from moe_kernels.nn import grad_sink
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8, grouped_mm_fp8_wgrad, quantize_fp8_tokens
from moe_kernels.ops.grouped_mm_nvfp4 import grouped_mm_nvfp4, quantize_nvfp4_experts
from moe_kernels.ops.activation import (quantize_fp8_dual, squared_relu, squared_relu_bwd_quantize_fp8,
                                        squared_relu_quantize_fp8, swiglu, swiglu_bwd_quantize_fp8, swiglu_quantize_fp8)
from moe_kernels.ops.permute import (permute, permute_quantize_fp8, permuted_rows, unpermute,
                                     unpermute_bwd_quantize_fp8)
from moe_kernels.ops.quant import BLOCK, NVFP4_BLOCK, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
from moe_kernels.quant import weight_cache
from moe_kernels.quant.fsdp_fp8 import Fp8GatheredWeight


@dataclass(frozen=True, kw_only=True)
class Fp8BlockwiseRecipe:
    pow2_scale: bool = False  # scales rounded down to powers of two (exact rescaling)
    fp8_dgrad: bool = True  # False: dgrad in the input precision too
    fp8_wgrad: bool = True  # False: wgrad in the input precision (the x saved as is)
    fused_permute: bool = True  # the MoE layer's first GEMM takes permute_quantize_fp8's output
    # the MoE layer's SwiGLU (or squared ReLU) writes the second GEMM's FP8 input (swiglu_quantize_fp8,
    # squared_relu_quantize_fp8), and its backward the first GEMM's output gradient
    fused_swiglu: bool = True
    align: int = 128  # rows per expert padded to this

    def __post_init__(self):
        if self.align < 1:
            raise ValueError("Fp8BlockwiseRecipe: align must be >= 1")
        if self.fp8_wgrad and self.align % BLOCK:
            raise ValueError(f"Fp8BlockwiseRecipe: align must be a multiple of {BLOCK} with fp8_wgrad (the weight "
                             f"gradient's blocks of {BLOCK} tokens must not straddle two experts), got {self.align}")

    def check_shapes(self, hidden_size: int, ffn_size: int) -> None:
        """Both expert GEMMs contract over H (gate/up) or F (down) in blocks of 128, the last zero-padded where
        the size is no multiple of 128; multiples of 16 keep every E4M3 row and bf16 output 16-byte aligned (the
        CUTLASS kernels' operands)."""
        _check_multiples(self, hidden_size, ffn_size, 16, "16-byte aligned E4M3 rows and bf16 outputs")

    def grouped_mm(self, x: Tensor, w: Tensor, group_sizes: Tensor, *, swiglu_next: bool = False,
                   squared_relu_next: bool = False) -> Tensor:
        """Drop-in for ops.grouped_mm: [M, K] x [E, N, K] -> [M, N] in x's dtype (autocast's under autocast).
        With fp8_wgrad every group must be a multiple of 128 rows (permute(..., align=128)). With FP8 wgrad a 16-bit
        x is quantized in both layouts the GEMM reads by one pass (quantize_fp8_dual), and so is the output
        gradient in the backward where dgrad and wgrad both read it.

        `swiglu_next` / `squared_relu_next`: the caller feeds the output to swiglu_grouped_mm (squared_relu_grouped_mm)
        and to nothing else, so that activation's backward hands this GEMM's backward its gradient in E4M3, as
        permute_grouped_mm's (the expert-parallel layer's first GEMM: its rows come from a dispatcher)."""
        link = self._grad_link(w, swiglu_next, squared_relu_next, "grouped_mm")
        out = _Fp8GroupedMM.apply(autocast_input(x), w, group_sizes, self, _weight_grad_needed(w),
                                  weight_cache.cacheable(w), False, link)
        if link is not None:
            out._fp8_grad_link = link
        return out

    def _grad_link(self, w: Tensor, swiglu_next: bool, squared_relu_next: bool, op: str) -> "_Fp8GradLink | None":
        """The link that carries an activation's E4M3 backward output to the GEMM that made its input, where the
        activation's producers apply: F % 8 == 0 (w [E, 2F, K] for the SwiGLU, [E, F, K] for the squared ReLU; the
        dh codes zero-padded to a multiple of 128, as dgrad's weight tiles)."""
        if swiglu_next and squared_relu_next:
            raise ValueError(f"Fp8BlockwiseRecipe.{op}: swiglu_next and squared_relu_next name two consumers of the "
                             "output; give one")
        if not (swiglu_next or squared_relu_next):
            return None
        fits = w.shape[1] % (16 if swiglu_next else 8) == 0
        if fits and self.fused_swiglu and self.fp8_dgrad and self.fp8_wgrad and not torch.compiler.is_compiling():
            return _Fp8GradLink(self.pow2_scale, gated=swiglu_next)
        return None

    def grouped_mm_kn(self, x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
        """grouped_mm for weights stored [E, K, N]: [M, K] rows times w[e] per group -> [M, N] in x's dtype; the
        same result as grouped_mm(x, w.transpose(1, 2).contiguous(), group_sizes) without the transposed copy
        (module docstring)."""
        if isinstance(w, Fp8GatheredWeight):
            raise ValueError("Fp8BlockwiseRecipe.grouped_mm_kn: expert weights gathered in FP8 by FSDP2 are [E, N, K] "
                             "weights' (moe_kernels.quant.fsdp_fp8); [E, K, N] weights are gathered in their dtype")
        if w.dim() != 3:
            raise ValueError(f"Fp8BlockwiseRecipe.grouped_mm_kn: `w` must be [E, K, N], got shape {tuple(w.shape)}")
        return _Fp8GroupedMM.apply(autocast_input(x), w, group_sizes, self, _weight_grad_needed(w),
                                   weight_cache.cacheable(w), True)

    def swiglu_grouped_mm(self, h: Tensor, row_weights: Tensor | None, w: Tensor, group_sizes: Tensor, *,
                          unpermute_next: bool = False) -> Tensor:
        """grouped_mm(swiglu(h, row_weights), w, group_sizes) with the activation written in FP8 by the SwiGLU
        kernel (swiglu_quantize_fp8: the forward's 1x128 blocks and wgrad's token-major blocks in one pass; the
        bf16 activation is never written; F zero-padded to a multiple of 128 where it is none). Bit for bit the
        composition; differentiable in h, row_weights and w (the SwiGLU backward from h, as swiglu's; in E4M3 for
        the up projection's backward when h comes from permute_grouped_mm(..., swiglu_next=True)). The
        composition runs where the fused kernel does not apply (fp8_wgrad off, F not a multiple of 8,
        fused_swiglu off).

        `unpermute_next`: the caller feeds the output to `unpermute` of this recipe and to nothing else, so
        that backward may hand this GEMM's backward its gradient in E4M3 (unpermute_bwd_quantize_fp8); the
        gradient autograd then carries for the output is a placeholder, as with permute_grouped_mm's
        `swiglu_next`."""
        F = h.shape[-1] // 2
        if not (self.fused_swiglu and self.fp8_wgrad and F % 8 == 0):
            return self.grouped_mm(swiglu(h, row_weights), w, group_sizes)
        return self._activation_grouped_mm(h, row_weights, w, group_sizes, True, unpermute_next)

    def squared_relu_grouped_mm(self, h: Tensor, w: Tensor, group_sizes: Tensor, *,
                                unpermute_next: bool = False) -> Tensor:
        """grouped_mm(squared_relu(h), w, group_sizes) for experts without a gate, as swiglu_grouped_mm: the
        activation written in FP8 by the squared ReLU's kernel (squared_relu_quantize_fp8: both layouts in one
        pass, F zero-padded to a multiple of 128 where it is none), its backward writing dh in E4M3 for the up
        projection's backward when h comes from permute_grouped_mm(..., squared_relu_next=True), and
        `unpermute_next` as there. Bit for bit the composition, which runs where the fused kernel does not apply
        (fp8_wgrad off, fused_swiglu off, F not a multiple of 8)."""
        if not (self.fused_swiglu and self.fp8_wgrad and h.shape[-1] % 8 == 0):
            return self.grouped_mm(squared_relu(h), w, group_sizes)
        return self._activation_grouped_mm(h, None, w, group_sizes, False, unpermute_next)

    def _activation_grouped_mm(self, h: Tensor, row_weights: Tensor | None, w: Tensor, group_sizes: Tensor,
                               gated: bool, unpermute_next: bool) -> Tensor:
        h_in = autocast_input(h)
        # h straight from permute_grouped_mm(..., swiglu_next / squared_relu_next=True): this backward hands it dh
        # in FP8.
        link = getattr(h, "_fp8_grad_link", None) if h_in is h else None
        if link is not None and (link.pow2_scale != self.pow2_scale or link.gated != gated):
            link = None
        # The output's gradient may arrive in FP8 too, from `unpermute` below, where the caller says so.
        out_link = None
        if unpermute_next and self.fp8_dgrad and w.shape[1] % 8 == 0 and not torch.compiler.is_compiling():
            out_link = _Fp8GradLink(self.pow2_scale)
        out = _Fp8ActivationGroupedMM.apply(h_in, row_weights, w, group_sizes, self, _weight_grad_needed(w),
                                            weight_cache.cacheable(w), link, out_link, gated)
        if out_link is not None:
            out._fp8_grad_link = out_link
        return out

    def unpermute(self, y: Tensor, row_map: Tensor, weights: Tensor | None) -> Tensor:
        """ops.unpermute(y, row_map, weights), differentiable in y and weights. Where y comes from
        swiglu_grouped_mm(..., unpermute_next=True) (or squared_relu_grouped_mm's), the backward gathers y's gradient and writes it in E4M3,
        both layouts the down projection's backward reads (unpermute_bwd_quantize_fp8), no bf16 gradient
        written; autograd carries a placeholder for y meanwhile (zeros: a hook on y or a gradient taken with
        respect to it sees zeros, and another consumer of y raises in the backward). Otherwise as
        ops.unpermute."""
        link = getattr(y, "_fp8_grad_link", None)
        if link is None or link.pow2_scale != self.pow2_scale or y.shape[1] % 8:
            return unpermute(y, row_map, weights)
        return _Fp8Unpermute.apply(y, row_map, weights, link)

    def permute_grouped_mm(
        self, x: Tensor, indices: Tensor, num_experts: int, align: int, w: Tensor, *, swiglu_next: bool = False,
        squared_relu_next: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """permute(x, indices, num_experts, align) followed by grouped_mm(., w, group_sizes), with the
        permute and the forward quantization fused (permute_quantize_fp8): (out [R, N], row_map,
        group_sizes). Differentiable in x and w; `align` must be a multiple of this recipe's.

        `swiglu_next`: the caller feeds `out` to swiglu_grouped_mm and to nothing else, so the SwiGLU backward
        may hand this GEMM's backward its gradient in E4M3, both layouts (swiglu_bwd_quantize_fp8), with no
        bf16 gradient written. The gradient autograd then carries for `out` is a placeholder (zeros, no
        memory): a hook on `out` or a gradient taken with respect to it sees zeros, and another consumer of
        `out` raises in the backward. `squared_relu_next`: the same with squared_relu_grouped_mm as `out`'s one
        consumer (squared_relu_bwd_quantize_fp8 writes the gradient)."""
        if align % self.align:
            raise ValueError(f"Fp8BlockwiseRecipe: align {align} must be a multiple of the recipe's {self.align}")
        x_in, need_wgrad = autocast_input(x), _weight_grad_needed(w)
        if x.shape[-1] % BLOCK and not _gathers_both_layouts(x_in, need_wgrad, self):
            # permute_quantize_fp8 writes unpadded rows: the composition pads the codes
            x_perm, row_map, group_sizes = permute(x, indices, num_experts, align=align)
            out = self.grouped_mm(x_perm, w, group_sizes, swiglu_next=swiglu_next, squared_relu_next=squared_relu_next)
            return out, row_map, group_sizes
        link = self._grad_link(w, swiglu_next, squared_relu_next, "permute_grouped_mm")
        out, row_map, group_sizes = _Fp8PermuteGroupedMM.apply(x_in, w, indices, num_experts, align, self, need_wgrad,
                                                               weight_cache.cacheable(w), link)
        if link is not None:
            out._fp8_grad_link = link
        return out, row_map, group_sizes


@dataclass(frozen=True, kw_only=True)
class Nvfp4Recipe:
    """The NVFP4 training recipe's expert GEMMs (specs/lowprec.md), numerics only on Hopper:
      forward  x: 1D blocks of 16 along K, round-to-nearest; w: 16x16 tiles, round-to-nearest
      dgrad    dout: 1D blocks along N, stochastic rounding (a fresh Philox seed per call, drawn on the
               device from torch's generator there: reproducible under torch.manual_seed, no host sync);
               w: its transpose in 16x16 tiles (the same values as the forward's, the point of 2D tiles)
      wgrad    random Hadamard transform along the tokens, then NVFP4 (below); or the input precision
    Both GEMMs run as grouped_mm_nvfp4: block-scaled values in fp32, fp32 accumulation, global scales last.
    With `nvfp4_wgrad` (the default) wgrad follows the recipe too: dout and x get the random Hadamard
    transform along the token dimension (blocks of 16 rows, R = H16 diag(s) / 4 with a fixed sign vector
    s; R is orthogonal, so (R dout)^T (R x) = dout^T x), then NVFP4 with 1D blocks along the tokens (dout
    stochastic, x round-to-nearest, amax after the transform), dequantized and multiplied in fp32. Its
    blocks must not straddle two experts, so each expert's rows are padded to 16 (`align`).
    """

    stochastic_dgrad: bool = True
    nvfp4_wgrad: bool = True

    @property
    def align(self) -> int:
        return NVFP4_BLOCK if self.nvfp4_wgrad else 1  # wgrad's blocks run along the tokens

    def check_shapes(self, hidden_size: int, ffn_size: int) -> None:
        _check_multiples(self, hidden_size, ffn_size, NVFP4_BLOCK, "blocks of 16 along each GEMM's K, 16x16 weight tiles")

    def grouped_mm(self, x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
        return _Nvfp4GroupedMM.apply(autocast_input(x), w, group_sizes, self)

    def grouped_mm_kn(self, x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
        """grouped_mm for weights stored [E, K, N]: the codes and results of grouped_mm(x, w.transpose(1, 2),
        group_sizes) (the forward's tiles quantized from the transposed weight, dgrad's from the stored one)."""
        if w.dim() != 3:
            raise ValueError(f"Nvfp4Recipe.grouped_mm_kn: `w` must be [E, K, N], got shape {tuple(w.shape)}")
        return _Nvfp4GroupedMM.apply(autocast_input(x), w, group_sizes, self, True)


def _check_multiples(recipe, hidden_size: int, ffn_size: int, block: int, why: str) -> None:
    if hidden_size % block or ffn_size % block:
        raise ValueError(f"{type(recipe).__name__}: hidden_size ({hidden_size}) and ffn_size ({ffn_size}) must be "
                         f"multiples of {block} ({why})")


def _rows_in_groups(t: Tensor, group_sizes: Tensor) -> Tensor:
    """Zeros in the rows past the groups (unspecified, possibly inf or NaN, in permute's and grouped_mm's
    outputs), which would otherwise enter NVFP4's per-tensor amax. No host sync."""
    valid = torch.arange(t.shape[0], device=t.device) < group_sizes.sum()
    return torch.where(valid[:, None], t, torch.zeros((), dtype=t.dtype, device=t.device))


class _Nvfp4GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, group_sizes: Tensor, recipe: Nvfp4Recipe, kn: bool = False) -> Tensor:
        # kn: w stored [E, K, N], the product that of its transpose (Nvfp4Recipe.grouped_mm_kn)
        x_q, x_s, x_g = quantize_nvfp4(_rows_in_groups(x, group_sizes))
        w_q, w_s, w_g = quantize_nvfp4_experts(w.detach().transpose(1, 2).contiguous() if kn else w.detach())
        ctx.stochastic, ctx.nvfp4_wgrad, ctx.kn = recipe.stochastic_dgrad, recipe.nvfp4_wgrad, kn
        ctx.save_for_backward(x, w, group_sizes)
        return grouped_mm_nvfp4(x_q, x_s, x_g, w_q, w_s, w_g, group_sizes, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        x, w, group_sizes = ctx.saved_tensors
        dout = dout.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            rng = _fresh_rng(dout.device) if ctx.stochastic else None
            d_q, d_s, d_g = quantize_nvfp4(_rows_in_groups(dout, group_sizes), rng=rng)
            wt = w.detach() if ctx.kn else w.detach().transpose(1, 2).contiguous()  # [E, K, N]
            wt_q, wt_s, wt_g = quantize_nvfp4_experts(wt)
            dx = _rows_in_groups(grouped_mm_nvfp4(d_q, d_s, d_g, wt_q, wt_s, wt_g, group_sizes, out_dtype=x.dtype),
                                 group_sizes)  # zeros past the groups, as grouped_mm's dgrad
        if ctx.needs_input_grad[1]:
            if ctx.nvfp4_wgrad:
                dw = _nvfp4_wgrad(dout, x, group_sizes)  # [E, N, K]
                dw = (dw.transpose(1, 2) if ctx.kn else dw).to(w.dtype)
            elif ctx.kn:
                dw = torch.ops.moe_kernels.grouped_mm_wgrad(x, dout, group_sizes).to(w.dtype)  # x^T dout: [E, K, N]
            else:
                dw = torch.ops.moe_kernels.grouped_mm_wgrad(dout, x, group_sizes).to(w.dtype)
        return dx, dw, None, None, None


def _fresh_rng(device: torch.device) -> Tensor:
    """[seed, offset] for stochastic rounding: the seed drawn on the device from torch's generator there
    (no host sync; a CUDA-graph replay draws a new one), offset 0."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    return torch.cat([seed, torch.zeros_like(seed)])


@functools.lru_cache(maxsize=None)
def _hadamard_16(device: torch.device, dtype: torch.dtype) -> Tensor:
    """R = H16 diag(s) / 4: the Sylvester Hadamard matrix with a fixed random sign per column."""
    h = torch.ones(1, 1)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (NVFP4_BLOCK,), generator=torch.Generator().manual_seed(0x5EED)) * 2.0 - 1.0
    return (h * signs / 4).to(device=device, dtype=dtype)


def random_hadamard_tokens(t: Tensor) -> Tensor:
    """[M, C] fp32 with M % 16 == 0 -> R applied to every block of 16 consecutive rows."""
    M, C = t.shape
    return torch.einsum("ij,bjc->bic", _hadamard_16(t.device, t.dtype), t.view(M // NVFP4_BLOCK, NVFP4_BLOCK, C)).reshape(M, C)


def _nvfp4_along_tokens(t: Tensor, rng: Tensor | None) -> Tensor:
    """Quantize-dequantize [M, C] with 1D NVFP4 blocks along M (the wgrad contraction), fp32."""
    q, s, g = quantize_nvfp4(t.T.contiguous(), rng=rng)  # [C, M/2], [C, M/16]
    return dequantize_nvfp4(q, s, g, dtype=torch.float32).T


def _nvfp4_wgrad(dout: Tensor, x: Tensor, group_sizes: Tensor) -> Tensor:
    M = x.shape[0]
    if group_sizes.device.type == "cpu" or _ext.checks_enabled():
        if bool((group_sizes % NVFP4_BLOCK != 0).any()):
            raise ValueError(
                "Nvfp4Recipe: NVFP4 wgrad needs every group's rows padded to 16 (permute(..., align=16)), got "
                f"group_sizes {group_sizes.tolist()}"
            )
    pad = -M % NVFP4_BLOCK

    def prepare(t: Tensor) -> Tensor:
        t = _rows_in_groups(t, group_sizes).float()
        return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t

    with torch.autocast(x.device.type, enabled=False):  # the transform and the product in fp32
        d = _nvfp4_along_tokens(random_hadamard_tokens(prepare(dout)), _fresh_rng(dout.device))
        xh = _nvfp4_along_tokens(random_hadamard_tokens(prepare(x)), None)
        return torch.ops.moe_kernels.grouped_mm_wgrad(d[:M].contiguous(), xh[:M].contiguous(), group_sizes)


RECIPES = {"bf16": None, "fp8-blockwise": Fp8BlockwiseRecipe(), "nvfp4": Nvfp4Recipe()}


def _weight_grad_needed(w: Tensor) -> bool:
    """Whether a backward will ask for dW (decided outside the autograd function: grad mode is off inside
    its forward). Without it (inference, frozen experts) nothing is kept for wgrad."""
    return torch.is_grad_enabled() and w.requires_grad


def _fp8_forward(
    x_q: Tensor, x_scale: Tensor, x: Tensor | None, w: Tensor, group_sizes: Tensor, recipe, need_wgrad: bool,
    out_dtype: torch.dtype, cache: bool, x_tokens: tuple[Tensor, Tensor] | None = None, need_dgrad: bool = True,
    kn: bool = False,
) -> tuple[Tensor, dict, list[Tensor]]:
    """The forward product from quantized rows, and what the backward needs (`state`). `x` (the rows in the
    input precision) is read only for wgrad, unless its token-major E4M3 copy `x_tokens` is given (made by the
    producer). The weight's tiles come from the weight cache when `cache`; with FP8 dgrad in view
    (`need_dgrad`) a fresh quantization writes dgrad's transposed tiles in the same pass. `kn`: w is stored
    [E, K, N] (both layouts always written: the forward reads the transposed ones, dgrad the stored ones)."""
    fp8_dgrad = recipe.fp8_dgrad
    w8 = weight_cache.fp8_expert_weights(w, pow2_scale=recipe.pow2_scale, cache=cache,
                                         transposed=kn or (fp8_dgrad and need_dgrad))
    # [E, N, Kp] codes (K zero-padded to a multiple of 128, as x_q's rows), [E, N/128, Kp/128] scales
    w_q, w_scale = w8.gemm_tiles(transposed=kn)
    out = grouped_mm_fp8(x_q, x_scale, w_q, w_scale, group_sizes).to(out_dtype)
    state = dict(fp8_dgrad=fp8_dgrad, fp8_wgrad=recipe.fp8_wgrad, pow2_scale=recipe.pow2_scale, x_dtype=out.dtype,
                 w8=w8 if fp8_dgrad else None, kn=kn)
    # wgrad reads x along the tokens: with FP8 wgrad only its token-blocked E4M3 copy is kept.
    if not need_wgrad:
        saved_x = ()
    elif recipe.fp8_wgrad:
        saved_x = x_tokens if x_tokens is not None else quantize_fp8_tokens(x.detach(), pow2_scale=recipe.pow2_scale)
    else:
        saved_x = (x,)
    state["n_x"] = len(saved_x)
    return out, state, [*saved_x, w, group_sizes]


def _fp8_backward(state: dict, saved: list[Tensor], dout: Tensor | None, need_dx: bool, need_dw: bool,
                  dout_fp8: tuple[Tensor, Tensor, Tensor, Tensor] | None = None):
    """dgrad and wgrad from dout, or from its E4M3 layouts `dout_fp8` (d_q [M, Np], d_scale [M, Np/128], d_t_q
    [N, Mp], d_t_scale [N, Mp/128]; Np = N rounded up to 128, the codes past N zero) when its producer wrote them
    (FP8 dgrad and wgrad on)."""
    n_x = state["n_x"]
    saved_x, (w, group_sizes) = saved[:n_x], saved[n_x:]
    dout = dout.contiguous() if dout_fp8 is None else None
    if (dout_fp8 is None and need_dx and need_dw and state["fp8_dgrad"] and state["fp8_wgrad"] and saved_x
            and _dual_fits(dout)):
        # dgrad and wgrad both read dout in E4M3: both layouts from one read (quantize_fp8_dual).
        dout_fp8 = quantize_fp8_dual(dout, pow2_scale=state["pow2_scale"])
    dx = dw = None
    if need_dx:
        if state["fp8_dgrad"]:
            if dout_fp8 is not None:
                d_q, d_scale = dout_fp8[:2]
            else:  # [M, Np] (N zero-padded to a multiple of 128), [M, Np/128]
                d_q, d_scale = quantize_fp8(dout, "block", pow2_scale=state["pow2_scale"], pad_to_block=True)
            # The forward's codes, tiles transposed ([E, K, Np], [E, K/128, Np/128]): made with them once per
            # weight version (quantize_fp8_experts_dual); for a weight stored [E, K, N], its own layout's.
            wt_q, wt_scale = state["w8"].gemm_tiles(transposed=not state["kn"])
            # Rows past the groups are unspecified, as grouped_mm_dgrad's: the permute backward reads only the
            # rows it mapped, so no masking pass over dx.
            dx = grouped_mm_fp8(d_q, d_scale, wt_q, wt_scale, group_sizes).to(state["x_dtype"])
        elif state["kn"]:  # dout @ w[e]^T with w [E, K, N]: grouped_mm's forward product
            dx = torch.ops.moe_kernels.grouped_mm(dout, w.to(dout.dtype), group_sizes)
        else:
            dx = torch.ops.moe_kernels.grouped_mm_dgrad(dout, w.to(dout.dtype), group_sizes)
    if need_dw:
        if not saved_x:
            raise RuntimeError("Fp8BlockwiseRecipe: the forward ran without a weight gradient in view (grad mode off "
                               "or w.requires_grad False), so nothing was kept for dW")
        if state["fp8_wgrad"]:
            d_t = dout_fp8[2:] if dout_fp8 is not None else quantize_fp8_tokens(dout, pow2_scale=state["pow2_scale"])
            # dout^T x ([E, N, K]), or x^T dout for a weight stored [E, K, N]
            operands = (*saved_x, *d_t) if state["kn"] else (*d_t, *saved_x)
            sink = grad_sink.sink_of(w)
            if sink is not None:
                # Into the fp32 main gradient from the kernel's epilogue (moe_kernels.nn.grad_sink): added to what
                # this step's earlier micro-batches wrote, or written afresh; autograd gets no gradient for w.
                grouped_mm_fp8_wgrad(*operands, group_sizes, out=sink.buffer(), accumulate=sink.written())
                sink.mark()
                return dx, None
            # The weight's dtype straight from the kernel's epilogue (bf16 or fp32): no fp32 copy, no cast.
            out_dtype = w.dtype if w.dtype in (torch.float32, torch.bfloat16) else torch.float32
            dw = grouped_mm_fp8_wgrad(*operands, group_sizes, out_dtype=out_dtype).to(w.dtype)
        elif state["kn"]:
            dw = torch.ops.moe_kernels.grouped_mm_wgrad(saved_x[0], dout, group_sizes).to(w.dtype)
        else:
            dw = torch.ops.moe_kernels.grouped_mm_wgrad(dout, saved_x[0], group_sizes).to(w.dtype)
    return dx, dw


def _gathers_both_layouts(x: Tensor, need_wgrad: bool, recipe: Fp8BlockwiseRecipe) -> bool:
    """Whether permute_grouped_mm writes its GEMM's E4M3 input in both layouts by one gather of the tokens
    (unpermute_bwd_quantize_fp8 with no weights: 16-bit rows, H % 8 == 0, zero-padded to a multiple of 128)."""
    return need_wgrad and recipe.fp8_wgrad and x.shape[-1] % 8 == 0 and x.dtype != torch.float32


def _dual_fits(t: Tensor) -> bool:
    """Whether quantize_fp8_dual's kernel takes t: 16-bit rows whose length is a multiple of 8."""
    return t.dtype in (torch.bfloat16, torch.float16) and t.shape[-1] % 8 == 0


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, group_sizes: Tensor, recipe: Fp8BlockwiseRecipe, need_wgrad: bool,
                cache: bool, kn: bool = False, link: _Fp8GradLink | None = None):
        x_tokens = None
        if need_wgrad and recipe.fp8_wgrad and _dual_fits(x):
            # Both layouts from one read of x: the forward's blocks and wgrad's token-major copy.
            x_q, x_scale, *x_tokens = quantize_fp8_dual(x, pow2_scale=recipe.pow2_scale)
        else:  # [M, Kp] (K zero-padded to a multiple of 128), [M, Kp/128]
            x_q, x_scale = quantize_fp8(x, "block", pow2_scale=recipe.pow2_scale, pad_to_block=True)
        out, ctx.state, saved = _fp8_forward(x_q, x_scale, x, w, group_sizes, recipe, need_wgrad, x.dtype, cache,
                                             x_tokens=x_tokens, need_dgrad=ctx.needs_input_grad[0], kn=kn)
        ctx.link = link
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        dout_fp8 = ctx.link.receive(dout) if ctx.link is not None else None
        dx, dw = _fp8_backward(ctx.state, list(ctx.saved_tensors), dout, *ctx.needs_input_grad[:2], dout_fp8=dout_fp8)
        return dx, dw, None, None, None, None, None, None


_ZERO_SCALARS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _zero_scalar(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d zero of dtype on device, made once per process (the placeholders below expand it: no fill kernel a
    step). Never cached from inside a CUDA graph capture, where the fill is recorded, not run."""
    device = torch.device(device)
    key = (dtype, device)
    z = _ZERO_SCALARS.get(key)
    if z is None:
        z = torch.zeros((), dtype=dtype, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ZERO_SCALARS[key] = z
    return z


class _Fp8GradLink:
    """Carries the up projection's output gradient in E4M3 from the SwiGLU backward to the GEMM backward that
    made h, past autograd (which carries a zero-stride placeholder for h meanwhile); likewise the down
    projection's output gradient from the unpermute backward. Made for one tensor; `payload` lives from the one
    backward to the other."""

    def __init__(self, pow2_scale: bool, gated: bool = True):
        self.pow2_scale = pow2_scale
        self.gated = gated  # from permute_grouped_mm: the activation that will send (SwiGLU, else the squared ReLU)
        self.payload: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self.placeholder: Tensor | None = None

    def send(self, payload: tuple[Tensor, Tensor, Tensor, Tensor], shape, dtype: torch.dtype,
             device: torch.device) -> Tensor:
        self.payload = payload
        self.placeholder = _zero_scalar(dtype, device).expand(shape)
        return self.placeholder

    def receive(self, grad: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """The E4M3 gradient, or None when none was sent (then `grad` is the gradient)."""
        payload, placeholder = self.payload, self.placeholder
        self.payload = self.placeholder = None
        if payload is None:
            return None
        # Autograd hands the placeholder over untouched unless another consumer of h added its gradient.
        if (grad is None or grad.data_ptr() != placeholder.data_ptr() or grad.stride() != placeholder.stride()
                or grad.shape != placeholder.shape):
            raise RuntimeError("Fp8BlockwiseRecipe: a tensor whose gradient travels in FP8 (the output of "
                               "permute_grouped_mm(..., swiglu_next=True or squared_relu_next=True), or of "
                               "swiglu_grouped_mm or squared_relu_grouped_mm passed to Fp8BlockwiseRecipe.unpermute) "
                               "received a gradient from another consumer; use the plain calls where the tensor has "
                               "other consumers")
        return payload


class _Fp8ActivationGroupedMM(torch.autograd.Function):
    """grouped_mm(act(h), w) with the activation written in E4M3 by its kernel: SwiGLU (`gated`, with the routing
    weights) or the squared ReLU."""

    @staticmethod
    def forward(ctx, h: Tensor, row_weights: Tensor | None, w: Tensor, group_sizes: Tensor, recipe: Fp8BlockwiseRecipe,
                need_wgrad: bool, cache: bool, link: _Fp8GradLink | None, out_link: _Fp8GradLink | None,
                gated: bool):
        # One pass over h: both E4M3 layouts of a = act(h) (fp8_wgrad is on here).
        if gated:
            a_q, a_scale, a_t_q, a_t_scale = swiglu_quantize_fp8(h, row_weights, pow2_scale=recipe.pow2_scale)
        else:  # [R, Fp] codes (F zero-padded to 128, as the down projection's weight tiles), [F, Rp]
            a_q, a_scale, a_t_q, a_t_scale = squared_relu_quantize_fp8(h, pow2_scale=recipe.pow2_scale)
        ctx.need_drw = row_weights is not None and ctx.needs_input_grad[1]
        out, ctx.state, saved = _fp8_forward(a_q, a_scale, None, w, group_sizes, recipe, need_wgrad, h.dtype, cache,
                                             x_tokens=(a_t_q, a_t_scale),
                                             need_dgrad=ctx.needs_input_grad[0] or ctx.need_drw)
        ctx.rw_dtype = None if row_weights is None else row_weights.dtype
        ctx.link, ctx.out_link, ctx.gated = link, out_link, gated
        ctx.save_for_backward(*saved, h, row_weights)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        *saved, h, row_weights = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0] or ctx.need_drw
        dout_fp8 = ctx.out_link.receive(dout) if ctx.out_link is not None else None
        da, dw = _fp8_backward(ctx.state, saved, dout, need_h, ctx.needs_input_grad[2], dout_fp8=dout_fp8)
        dh = drw = None
        if need_h and ctx.link is not None and ctx.needs_input_grad[0]:
            # dh in E4M3 only, both layouts the up projection's backward reads; autograd carries a placeholder.
            if ctx.gated:
                *dh_fp8, drw = swiglu_bwd_quantize_fp8(da.contiguous(), h, row_weights, need_dw=ctx.need_drw,
                                                       pow2_scale=ctx.link.pow2_scale)
            else:
                dh_fp8 = squared_relu_bwd_quantize_fp8(da.contiguous(), h, pow2_scale=ctx.link.pow2_scale)
            dh = ctx.link.send(tuple(dh_fp8), h.shape, h.dtype, h.device)
        elif need_h and ctx.gated:  # swiglu's backward, as the composition takes it
            dh, drw = torch.ops.moe_kernels.swiglu_bwd(da.contiguous(), h, row_weights, ctx.need_drw)
        elif need_h:
            dh = torch.ops.moe_kernels.squared_relu_bwd(da.contiguous(), h)
        drw = drw.to(ctx.rw_dtype) if ctx.need_drw else None
        return dh, drw, dw, None, None, None, None, None, None, None


class _Fp8Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, row_map: Tensor, weights: Tensor | None, link: _Fp8GradLink):
        ctx.need_dweights = weights is not None and ctx.needs_input_grad[2]
        ctx.link, ctx.y_meta = link, (y.shape, y.dtype, y.device)
        ctx.weights_dtype = None if weights is None else weights.dtype
        ctx.save_for_backward(row_map, weights, y if ctx.need_dweights else None)
        return unpermute(y, row_map, weights)

    @staticmethod
    def backward(ctx, dout: Tensor):
        row_map, weights, y = ctx.saved_tensors
        dout = dout.contiguous()
        shape, dtype, device = ctx.y_meta
        dy = dweights = None
        if ctx.needs_input_grad[0]:
            # The gather writes y's gradient in E4M3 only, both layouts the down projection's backward reads.
            *dy_fp8, dweights = unpermute_bwd_quantize_fp8(dout, row_map, weights, y, shape[0],
                                                           pow2_scale=ctx.link.pow2_scale)
            dy = ctx.link.send(tuple(dy_fp8), shape, dtype, device)
        elif ctx.need_dweights:
            _, dweights = torch.ops.moe_kernels.unpermute_bwd(dout, row_map, weights, y, shape[0])
        dweights = dweights.to(ctx.weights_dtype) if ctx.need_dweights else None
        return dy, None, dweights, None


class _Fp8PermuteGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, indices: Tensor, num_experts: int, align: int, recipe: Fp8BlockwiseRecipe,
                need_wgrad: bool, cache: bool, link: _Fp8GradLink | None = None):
        if _gathers_both_layouts(x, need_wgrad, recipe):
            # Both layouts the GEMM reads, from one gather of the tokens: the forward's 1x128 blocks and wgrad's
            # token-major blocks (bit for bit quantize_fp8 and quantize_fp8_tokens of the permuted rows), so
            # no bf16 copy of the permuted rows is written and read back. The routing alone first. (fp32 rows
            # keep permute_quantize_fp8: the gather's kernel takes 16-bit rows, and composes passes for fp32.)
            _, row_map, group_sizes = permute(x.new_empty((x.shape[0], 0)), indices, num_experts, align=align)
            rows = permuted_rows(x.shape[0], indices.shape[1], num_experts, align)
            x_q, x_scale, x_t_q, x_t_scale, _ = unpermute_bwd_quantize_fp8(x, row_map, None, None, rows,
                                                                          pow2_scale=recipe.pow2_scale)
            x_perm, x_tokens = None, (x_t_q, x_t_scale)
        else:
            # One read of each token: its codes, scales and (for a wgrad in bf16) its input-precision rows.
            x_q, x_scale, row_map, group_sizes, x_perm = permute_quantize_fp8(
                x, indices, num_experts, align=align, pow2_scale=recipe.pow2_scale, keep_rows=need_wgrad
            )
            x_tokens = None
        out, ctx.state, saved = _fp8_forward(x_q, x_scale, x_perm, w, group_sizes, recipe, need_wgrad, x.dtype, cache,
                                             x_tokens=x_tokens, need_dgrad=ctx.needs_input_grad[0])
        ctx.link = link
        ctx.save_for_backward(*saved, row_map)
        ctx.mark_non_differentiable(row_map, group_sizes)
        return out, row_map, group_sizes

    @staticmethod
    def backward(ctx, dout: Tensor, _grad_row_map, _grad_group_sizes):
        *saved, row_map = ctx.saved_tensors
        dout_fp8 = ctx.link.receive(dout) if ctx.link is not None else None
        dx_perm, dw = _fp8_backward(ctx.state, saved, dout, *ctx.needs_input_grad[:2], dout_fp8=dout_fp8)
        # permute's backward: dx[t] = sum over its slots of dx_perm[row] (fp32 accumulation).
        dx = unpermute(dx_perm.contiguous(), row_map, None) if dx_perm is not None else None
        return dx, dw, None, None, None, None, None, None, None
