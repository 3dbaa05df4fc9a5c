"""The FP8 blockwise recipe's routed experts as one fused region (`moe_fp8`), tokens in, tokens out.

The recipe's layer (moe_kernels.quant.recipe: permute_grouped_mm, swiglu_grouped_mm or squared_relu_grouped_mm,
unpermute) is three autograd functions over a dozen ops, each entered through its Python wrapper, its checks and
keyword arguments into the extension, with two E4M3 gradients handed between the functions past autograd (the
recipe's _Fp8GradLink). Here the same kernels run on the same operands from one autograd node, by the fused
regions' calling convention (moe_kernels.nn.fused) as far as Python allows: the launch resolved once per layer
call, positional calls into the extension (the ops' own launch helpers: forward_on, wgrad_on, swiglu_fp8_on, ...),
nothing the layer made checked again, and the E4M3 gradients local variables of one backward. The slot of each
permuted row (the inverse of row_map, which both gathers read) is one rows_to_tokens launch in the forward, kept
for the backward, where the recipe's functions compute it with aten ops in each gather. Each kernel is still its
own extension call (about 20 a layer fwd+bwd, where the BF16 `moe` region makes 2). Outputs and gradients are the
recipe's bit for bit (tests/nn/test_fused_fp8_gpu.py).

forward   permute_fwd (the routing only), rows_to_tokens (each row's slot), unpermute_bwd_fp8 (the tokens
          gathered into both E4M3 layouts of the permuted rows), the up projection (fp8_dequant_scales,
          grouped_mm), the activation writing both layouts of its output (swiglu_fwd_fp8, or rows_fp8 for the
          squared ReLU), the down projection, unpermute_fwd (weighted by the routing weights)
backward  unpermute_bwd_fp8 (dy in both layouts; unpermute_bwd for the routing weights' gradient), the down
          projection's dgrad and wgrad, the activation's backward writing dh in both layouts (swiglu_bwd_fp8 or
          rows_fp8), the up projection's dgrad and wgrad, unpermute_fwd (the permute's backward)

The weights' tiles come from the weight cache as in the recipe, and a weight with a live gradient sink
(moe_kernels.nn.grad_sink) gets its gradient added there by the wgrad kernel. `fits` says where the region
applies: the recipe's default (FP8 dgrad and wgrad, the fused permute and activation), bf16 tokens, routing
weights applied by the unpermute, plain expert weights that both want a gradient (training); elsewhere the layer
runs the recipe's functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.nn import fused, grad_sink
from moe_kernels.ops.activation import (ROWS_FP8_SQUARED_RELU, ROWS_FP8_SQUARED_RELU_BWD, rows_fp8_on,
                                        swiglu_bwd_fp8_on, swiglu_fp8_on)
from moe_kernels.ops.grouped_mm_fp8 import forward_on, wgrad_into_on, wgrad_on
from moe_kernels.ops.permute import permuted_rows, unpermute_bwd_fp8_on
from moe_kernels.quant import weight_cache
from moe_kernels.quant.recipe import Fp8BlockwiseRecipe

_BF16 = _ext.dtype_code(torch.bfloat16)
_PLAIN = (Tensor, torch.nn.Parameter)
SWIGLU, SQUARED_RELU = 0, 1  # the region's `act`


def fits(L: fused.Launch, recipe, x: Tensor, indices: Tensor, w13: Tensor, w2: Tensor) -> bool:
    """Whether the region takes this layer call (else the recipe's functions run it): the recipe's defaults, x
    [T, H] bf16 and contiguous with T > 0, H and F multiples of 8 (the producers' 16-byte rows), contiguous int32
    indices, plain weights that both get a gradient, and an expert count the kernels take. Where it holds, the
    recipe's functions take their fully fused path too (the gather of both layouts, both E4M3 gradient hand-offs)."""
    return (type(recipe) is Fp8BlockwiseRecipe and recipe.fp8_dgrad and recipe.fp8_wgrad and recipe.fused_permute
            and recipe.fused_swiglu and x.dtype is torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0
            and x.shape[1] % 8 == 0 and w2.shape[-1] % 8 == 0 and x.is_contiguous()
            and indices.dtype is torch.int32 and indices.is_contiguous() and type(w13) in _PLAIN and type(w2) in _PLAIN
            and torch.is_grad_enabled() and w13.requires_grad and w2.requires_grad
            and w13.shape[0] <= min(L.C.permute_max_experts, L.C.grouped_mm_max_groups))


def _act_fwd(L: fused.Launch, h: Tensor, pow2: bool, act: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both E4M3 layouts of act(h): swiglu_quantize_fp8(h) or squared_relu_quantize_fp8(h)'s kernel."""
    launch = (L.device, L.stream)
    if act == SWIGLU:
        return swiglu_fp8_on(L.C, launch, h, None, pow2)
    return rows_fp8_on(L.C, launch, ROWS_FP8_SQUARED_RELU, h, None, pow2)


def _act_bwd(L: fused.Launch, da: Tensor, h: Tensor, pow2: bool, act: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both E4M3 layouts of dh from da: swiglu_bwd_quantize_fp8 or squared_relu_bwd_quantize_fp8's kernel."""
    launch = (L.device, L.stream)
    if act == SWIGLU:
        return swiglu_bwd_fp8_on(L.C, launch, da, h, None, pow2)
    return rows_fp8_on(L.C, launch, ROWS_FP8_SQUARED_RELU_BWD, h, da, pow2)


def _wgrad(L: fused.Launch, d_t: tuple[Tensor, Tensor], x_t: tuple[Tensor, Tensor], group_sizes: Tensor,
           w: Tensor) -> Tensor | None:
    """dW = d^T x from both operands' token-major E4M3 blocks: into w's live gradient sink (None returned), else
    in w's dtype (bf16 or fp32 from the kernel's epilogue), as the recipe's backward writes it."""
    launch = (L.device, L.stream)
    sink = grad_sink.sink_of(w)
    if sink is not None:
        buffer = sink.buffer()
        wgrad_into_on(L.C, launch, *d_t, *x_t, group_sizes, buffer, sink.written())
        torch.autograd.graph.increment_version(buffer)  # written in place, as the registered op's dispatch records
        sink.mark()
        return None
    out_dtype = w.dtype if w.dtype in (torch.float32, torch.bfloat16) else torch.float32
    return wgrad_on(L.C, launch, *d_t, *x_t, group_sizes, out_dtype).to(w.dtype)


class _MoeFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, weights, w13, w2, num_experts, align, recipe, cache, L, act):
        C, dev, s = L
        T, H = x.shape
        k = indices.shape[1]
        R = permuted_rows(T, k, num_experts, align)
        pow2 = recipe.pow2_scale
        need_x = ctx.needs_input_grad[0]
        i32 = torch.int32
        # The routing alone (nothing copied), then each row's slot.
        row_map = torch.empty((T, k), dtype=i32, device=x.device)
        group_sizes = torch.empty((num_experts,), dtype=i32, device=x.device)
        ws = torch.empty((_ext.size_of(C, "permute_workspace_bytes", T * k, num_experts),), dtype=torch.uint8,
                         device=x.device)
        C.permute_fwd(0, indices.data_ptr(), 0, row_map.data_ptr(), group_sizes.data_ptr(), _ext.ptr(ws), T, k, 0,
                      num_experts, align, dev, s)
        slot = torch.empty((R,), dtype=i32, device=x.device)
        C.rows_to_tokens(row_map.data_ptr(), T * k, 1, R, slot.data_ptr(), dev, s)
        # The permuted rows in both E4M3 layouts (the forward's and wgrad's), from one gather of the tokens.
        x_q, x_scale, *x_t = unpermute_bwd_fp8_on(C, (dev, s), x, slot, None, k, pow2)
        w8_13 = weight_cache.fp8_expert_weights(w13, pow2_scale=pow2, cache=cache[0], transposed=need_x)
        h = forward_on(C, (dev, s), x_q, x_scale, *w8_13.gemm_tiles(transposed=False), group_sizes)
        a_q, a_scale, *a_t = _act_fwd(L, h, pow2, act)
        w8_2 = weight_cache.fp8_expert_weights(w2, pow2_scale=pow2, cache=cache[1], transposed=True)
        y = forward_on(C, (dev, s), a_q, a_scale, *w8_2.gemm_tiles(transposed=False), group_sizes)
        out = x.new_empty((T, H))
        w = fused._f32(weights)
        C.unpermute_fwd(y.data_ptr(), row_map.data_ptr(), _ext.ptr(w), out.data_ptr(), T, k, H, R, _BF16, dev, s)
        need_dw = weights is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(*x_t, h, *a_t, row_map, slot, group_sizes, w, y if need_dw else None, w13, w2)
        ctx.L, ctx.w8, ctx.pow2, ctx.act, ctx.need_dw = L, (w8_13, w8_2), pow2, act, need_dw
        ctx.w_dtype = None if weights is None else weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        fused._first_order_only()
        x_tq, x_ts, h, a_tq, a_ts, row_map, slot, group_sizes, w, y, w13, w2 = ctx.saved_tensors
        L, (w8_13, w8_2), pow2 = ctx.L, ctx.w8, ctx.pow2
        launch = (L.device, L.stream)
        need_x, need_w13, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        T, k = row_map.shape
        R, H = slot.shape[0], dout.shape[1]
        dout = dout.contiguous()
        # The down projection's output gradient in both E4M3 layouts, gathered from dout (times each slot's weight).
        dy_q, dy_scale, *dy_t = unpermute_bwd_fp8_on(L.C, launch, dout, slot, w, k, pow2)
        dweights = None
        if ctx.need_dw:  # unpermute_bwd's own reduction (dy not written)
            dweights = torch.empty((T, k), dtype=torch.float32, device=dout.device)
            L.C.unpermute_bwd(dout.data_ptr(), y.data_ptr(), row_map.data_ptr(), _ext.ptr(w), 0, dweights.data_ptr(), 0,
                              T, k, H, R, _BF16, L.device, L.stream)
            dweights = fused.as_dtype(dweights, ctx.w_dtype)
        da = forward_on(L.C, launch, dy_q, dy_scale, *w8_2.gemm_tiles(transposed=True), group_sizes)
        dw2 = _wgrad(L, dy_t, (a_tq, a_ts), group_sizes, w2) if need_w2 else None
        dh_q, dh_scale, *dh_t = _act_bwd(L, da, h, pow2, ctx.act)
        dw13 = _wgrad(L, dh_t, (x_tq, x_ts), group_sizes, w13) if need_w13 else None
        dx = None
        if need_x:
            # Rows past the groups are unspecified: the permute's backward reads only the rows it mapped.
            dx_perm = forward_on(L.C, launch, dh_q, dh_scale, *w8_13.gemm_tiles(transposed=True), group_sizes)
            dx = dout.new_empty((T, H))
            L.C.unpermute_fwd(dx_perm.data_ptr(), row_map.data_ptr(), 0, dx.data_ptr(), T, k, H, R, _BF16, L.device,
                              L.stream)
        return dx, None, dweights, dw13, dw2, None, None, None, None, None, None


def _moe_fp8_ops(x: Tensor, indices: Tensor, weights: Tensor | None, w13: Tensor, w2: Tensor, num_experts: int,
                 align: int, recipe: Fp8BlockwiseRecipe, act: int = SWIGLU) -> Tensor:
    """The same layer through the recipe's functions (they call the registered ops where those must run)."""
    gated = act == SWIGLU
    h, row_map, group_sizes = recipe.permute_grouped_mm(x, indices, num_experts, align, w13, swiglu_next=gated,
                                                        squared_relu_next=not gated)
    if gated:
        y = recipe.swiglu_grouped_mm(h, None, w2, group_sizes, unpermute_next=True)
    else:
        y = recipe.squared_relu_grouped_mm(h, w2, group_sizes, unpermute_next=True)
    return recipe.unpermute(y, row_map, weights)


@fused._register("moe_fp8", _moe_fp8_ops,
                 "permute_fwd, rows_to_tokens, unpermute_bwd_fp8, 2 x (fp8_dequant_scales, grouped_mm) around "
                 "swiglu_fwd_fp8 / rows_fp8, unpermute_fwd / unpermute_bwd_fp8 [unpermute_bwd], 4 x "
                 "(fp8_dequant_scales, grouped_mm) around swiglu_bwd_fp8 / rows_fp8, unpermute_fwd")
def moe_fp8_region(L: fused.Launch, x: Tensor, indices: Tensor, weights: Tensor | None, w13: Tensor, w2: Tensor,
                   num_experts: int, align: int, recipe: Fp8BlockwiseRecipe, act: int = SWIGLU) -> Tensor:
    """out [T, H] = unpermute(act(permute(x) w13^T) w2^T, weights) with every expert GEMM in the recipe's FP8
    (`fits` says where it applies); the recipe's functions bit for bit."""
    cache = (weight_cache.cacheable(w13), weight_cache.cacheable(w2))
    return _MoeFp8.apply(x, indices, weights, w13, w2, num_experts, align, recipe, cache, L, act)
