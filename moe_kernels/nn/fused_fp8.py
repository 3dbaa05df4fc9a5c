"""The FP8 blockwise recipe's routed experts as one fused region (`moe_fp8`), tokens in, tokens out.

The recipe's layer (moe_kernels.quant.recipe: permute_grouped_mm, swiglu_grouped_mm or squared_relu_grouped_mm,
unpermute) is three autograd functions over a dozen ops, each entered through its Python wrapper, its checks and
keyword arguments into the extension, with two E4M3 gradients handed between the functions past autograd (the
recipe's _Fp8GradLink). Here the same kernels run on the same operands from one autograd node and one extension
call each way (python_api/regions_fp8.cpp), by the fused regions' calling convention (moe_kernels.nn.fused): the
launch resolved once per layer call, positional arguments, nothing the layer made checked again, the tensors kept
for the backward parts of one allocation, and the E4M3 operands that live inside one direction (the GEMMs' inputs,
their dequantization scales, the gradients between the backward's GEMMs) carved from that call's workspace. The
slot of each permuted row (the inverse of row_map, which both gathers read) is one rows_to_tokens launch in the
forward, kept for the backward, where the recipe's functions compute it with aten ops in each gather. Outputs and
gradients are the recipe's bit for bit (tests/nn/test_fused_fp8_gpu.py).

forward   moe_fp8_fwd: permute_fwd (the routing only), rows_to_tokens (each row's slot), unpermute_bwd_fp8 (the
          tokens gathered into both E4M3 layouts of the permuted rows), the up projection (fp8_dequant_scales,
          grouped_mm), the activation writing both layouts of its output (swiglu_fwd_fp8, or rows_fp8 for the
          squared ReLU), the down projection, unpermute_fwd (weighted by the routing weights)
backward  moe_fp8_bwd: unpermute_bwd_fp8 (dy in both layouts; unpermute_bwd for the routing weights' gradient),
          the down projection's dgrad and wgrad, the activation's backward writing dh in both layouts
          (swiglu_bwd_fp8 or rows_fp8), the up projection's wgrad and dgrad, unpermute_fwd (the permute's backward)

The weights' tiles come from the weight cache as in the recipe, and a weight with a live gradient sink
(moe_kernels.nn.grad_sink) gets its gradient added there by the wgrad kernel. `fits` says where the region
applies: the recipe's default (FP8 dgrad and wgrad, the fused permute and activation), bf16 tokens, routing
weights applied by the unpermute, plain expert weights that both want a gradient (training), and an FP8 kernel
for every expert GEMM on this GPU (C.moe_fp8_path: the sm_90a or sm_100f blockwise kernels, or the tensor-core
portable one); elsewhere the layer runs the recipe's functions (their dequantizing fallback included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.nn import fused, grad_sink
from moe_kernels.ops.permute import permuted_rows
from moe_kernels.ops.quant import BLOCK
from moe_kernels.quant import weight_cache
from moe_kernels.quant.recipe import Fp8BlockwiseRecipe

_F32_CODE = _ext.dtype_code(torch.float32)
_PLAIN = (Tensor, torch.nn.Parameter)
SWIGLU, SQUARED_RELU = 0, 1  # the region's `act`

def fits(L: fused.Launch, recipe, x: Tensor, indices: Tensor, w13: Tensor, w2: Tensor, num_experts: int | None = None,
         align: int = BLOCK) -> bool:
    """Whether the region takes this layer call (else the recipe's functions run it): the recipe's defaults, x
    [T, H] bf16 and contiguous with T > 0, H and F multiples of 8 (the producers' 16-byte rows), contiguous int32
    indices, plain weights that both get a gradient, an expert count the kernels take (`num_experts`, the weights'
    by default), and an FP8 kernel for every expert GEMM. Where it holds, the recipe's functions take their fully
    fused path too (the gather of both layouts, both E4M3 gradient hand-offs)."""
    E = w13.shape[0]
    ok = (type(recipe) is Fp8BlockwiseRecipe and recipe.fp8_dgrad and recipe.fp8_wgrad and recipe.fused_permute
          and recipe.fused_swiglu and x.dtype is torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0
          and x.shape[1] % 8 == 0 and w2.shape[-1] % 8 == 0 and x.is_contiguous()
          and indices.dtype is torch.int32 and indices.dim() == 2 and indices.is_contiguous()
          and type(w13) in _PLAIN and type(w2) in _PLAIN
          and torch.is_grad_enabled() and w13.requires_grad and w2.requires_grad
          and (num_experts is None or num_experts == E)
          and E <= min(L.C.permute_max_experts, L.C.grouped_mm_max_groups))
    if not ok:
        return False
    act = SWIGLU if w13.shape[1] == 2 * w2.shape[-1] else SQUARED_RELU  # (the squared ReLU's w13 is [E, F, H])
    R = permuted_rows(x.shape[0], indices.shape[1], E, align)
    return L.C.moe_fp8_path(R, x.shape[1], w2.shape[-1], act, E, L.device)


def _rounded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _wgrad_into(w: Tensor) -> tuple[Tensor, int, bool, object]:
    """Where w's gradient goes: (the tensor, its dtype code, accumulate, the live gradient sink or None): the sink's
    fp32 buffer, else a fresh tensor in w's dtype (float32 or bfloat16 from the epilogue; float32 for others, cast
    after), as the recipe's backward writes it."""
    sink = grad_sink.sink_of(w)
    if sink is not None:
        return sink.buffer(), _F32_CODE, sink.written(), sink
    dtype = w.dtype if w.dtype in (torch.float32, torch.bfloat16) else torch.float32
    return torch.empty(w.shape, dtype=dtype, device=w.device), _ext.dtype_code(dtype), False, None


def _wgrad_done(dw: Tensor | None, sink, w: Tensor) -> Tensor | None:
    """The gradient autograd gets for w once its wgrad ran: None where it went into w's sink (written in place: its
    version counter bumped, as the registered op's dispatch records, and the sink marked), else dw in w's dtype."""
    if sink is not None:
        torch.autograd.graph.increment_version(dw)
        sink.mark()
        return None
    return None if dw is None else fused.as_dtype(dw, w.dtype)


class _MoeFp8(torch.autograd.Function):
    """Its tensors for the backward (row_map, group_sizes, slot, x's and a's token-major E4M3 layouts, h, and y when
    the routing weights need a gradient) are parts of one allocation; each direction's scratch is in its
    workspace."""

    @staticmethod
    def forward(ctx, x, indices, weights, w13, w2, num_experts, align, recipe, cache, L, act):
        T, H = x.shape
        k = indices.shape[1]
        E, F2, _ = w13.shape
        F = w2.shape[-1]
        if F2 != (2 * F if act == SWIGLU else F):  # h [R, F2] is written at the activation's width
            raise ValueError(f"moe_fp8: `w13` [E, {F2}, H] does not fit the activation's `w2` [E, H, {F}] "
                             f"({'SwiGLU: 2F' if act == SWIGLU else 'the squared ReLU: F'} rows)")
        R = permuted_rows(T, k, num_experts, align)
        Rp = _rounded(R)
        Rb = Rp // BLOCK
        pow2 = recipe.pow2_scale
        need_dw = weights is not None and ctx.needs_input_grad[2]
        # row_map, group_sizes, slot, x_t (codes, scales), h, a_t (codes, scales), y
        sizes = (T * k * 4, E * 4, R * 4, H * Rp, H * Rb * 4, R * F2 * 2, F * Rp, F * Rb * 4, R * H * 2 if need_dw else 0)
        kept, parts = _ext.carve(x, *sizes, saved=True)
        w8_13 = weight_cache.fp8_expert_weights(w13, pow2_scale=pow2, cache=cache[0], transposed=ctx.needs_input_grad[0])
        w8_2 = weight_cache.fp8_expert_weights(w2, pow2_scale=pow2, cache=cache[1], transposed=True)
        q13, s13 = w8_13.gemm_tiles(transposed=False)
        q2, s2 = w8_2.gemm_tiles(transposed=False)
        out = x.new_empty((T, H))
        w = fused._f32(weights)
        if x.data_ptr() % 16:  # 16-byte loads of x's rows
            x = x.clone()
        _ext.with_workspace(("moe_fp8_fwd", L.device, T, k, R, H, F, E, act, need_dw), L.C.moe_fp8_fwd, x,
                            x.data_ptr(), indices.data_ptr(), _ext.ptr(w), q13.data_ptr(), s13.data_ptr(),
                            q2.data_ptr(), s2.data_ptr(), *parts, out.data_ptr(), T, k, R, H, F, E, align, act, pow2,
                            L.device, L.stream)
        ctx.save_for_backward(kept, w, w13, w2)
        ctx.L, ctx.w8, ctx.pow2, ctx.act, ctx.need_dw = L, (w8_13, w8_2), pow2, act, need_dw
        ctx.shape = (T, k, R, H, F, E)
        ctx.offsets = [p - kept.data_ptr() if p else -1 for p in parts]
        ctx.w_dtype = None if weights is None else weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        fused._first_order_only()
        kept, w, w13, w2 = ctx.saved_tensors
        L, (w8_13, w8_2) = ctx.L, ctx.w8
        T, k, R, H, F, E = ctx.shape
        need_x, need_w13, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        kept = fused._aligned(kept)  # (held: the kernels read it)
        base = kept.data_ptr()
        saved = [base + o if o >= 0 else 0 for o in ctx.offsets]
        dout = dout.contiguous()
        if dout.data_ptr() % 16:  # 16-byte loads of dout's rows
            dout = dout.clone()
        dx = dout.new_empty((T, H)) if need_x else None
        dweights = torch.empty((T, k), dtype=torch.float32, device=dout.device) if ctx.need_dw else None
        dw13, code13, acc13, sink13 = _wgrad_into(w13) if need_w13 else (None, 0, False, None)
        dw2, code2, acc2, sink2 = _wgrad_into(w2) if need_w2 else (None, 0, False, None)
        q13t, s13t = w8_13.gemm_tiles(transposed=True) if need_x else (None, None)
        q2t, s2t = w8_2.gemm_tiles(transposed=True)
        _ext.with_workspace(("moe_fp8_bwd", L.device, T, k, R, H, F, E, ctx.act, need_x), L.C.moe_fp8_bwd, dout,
                            dout.data_ptr(), _ext.ptr(w), _ext.ptr(q13t), _ext.ptr(s13t), q2t.data_ptr(),
                            s2t.data_ptr(), *saved, _ext.ptr(dx), _ext.ptr(dw13), code13, acc13, _ext.ptr(dw2), code2,
                            acc2, _ext.ptr(dweights), T, k, R, H, F, E, ctx.act, ctx.pow2, L.device, L.stream)
        dw2 = _wgrad_done(dw2, sink2, w2)  # in the order their wgrads ran
        dw13 = _wgrad_done(dw13, sink13, w13)
        if dweights is not None:
            dweights = fused.as_dtype(dweights, ctx.w_dtype)
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
                 "moe_fp8_fwd (permute_fwd, rows_to_tokens, unpermute_bwd_fp8, 2 x (fp8_dequant_scales, grouped_mm) "
                 "around swiglu_fwd_fp8 / rows_fp8, unpermute_fwd) / moe_fp8_bwd (unpermute_bwd_fp8 [unpermute_bwd], "
                 "4 x (fp8_dequant_scales, grouped_mm) around swiglu_bwd_fp8 / rows_fp8, unpermute_fwd)")
def moe_fp8_region(L: fused.Launch, x: Tensor, indices: Tensor, weights: Tensor | None, w13: Tensor, w2: Tensor,
                   num_experts: int, align: int, recipe: Fp8BlockwiseRecipe, act: int = SWIGLU) -> Tensor:
    """out [T, H] = unpermute(act(permute(x) w13^T) w2^T, weights) with every expert GEMM in the recipe's FP8
    (`fits` says where it applies); the recipe's functions bit for bit."""
    cache = (weight_cache.cacheable(w13), weight_cache.cacheable(w2))
    return _MoeFp8.apply(x, indices, weights, w13, w2, num_experts, align, recipe, cache, L, act)
