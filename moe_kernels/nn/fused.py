"""The MoE layer's hot path as a table of fused regions, each one autograd node over the extension.

Why: a registered custom op called eagerly pays for torch.library's Python autograd wrapper, the
dispatcher, the CUDA implementation's checks, keyword arguments to pybind and a stream lookup, per op and
per backward op: tens of microseconds a call, more than the router's kernels take on a GPU. Here each
region of the layer is one `torch.autograd.Function` whose forward and backward call the extension
directly. The calling convention, which every op on the hot path follows:

- A `Launch` (the extension module, device index, stream) is resolved once per layer call by
  `launch_for` and handed to every region; the backward reuses the forward's (autograd runs a backward
  node on its forward's stream).
- The extension is called with positional arguments; a region's forward is one extension call (the routed
  experts: permute, experts and unpermute in `moe`), the router's one kernel each way (router_fused) takes its
  losses too. The FP8 recipe's region (`moe_fp8`, moe_kernels/nn/fused_fp8.py) is one call each way too, where
  every expert GEMM has an FP8 kernel (else the recipe's functions run, with their dequantizing fallback).
- Workspaces are sized by the region itself: a region that needs one returns the bytes it needs when
  the given workspace is too small, launching nothing; the size is remembered per shape, so the steady
  state is one call, and each workspace is a fresh caching-allocator block on the current stream
  (never shared between streams; safe under CUDA-graph capture, ARCHITECTURE decision 4).
- Inputs the layer made itself (indices, row maps, group sizes) are not validated again; what the user
  gives (x, weights, config) is checked once per layer or once per module.
- No Python dispatch on dtypes: dtype codes and option codes are computed once per module.

`run(name, launch, *args)` picks the region's thin path, or with `launch=None` its composition of the
registered custom ops: under torch.compile, torch.export and ONNX export (the ops have fake
implementations and decompositions there), on CPU tensors outside emulation (the references), and on a
GPU the extension cannot serve. Both paths give bitwise identical outputs and gradients
(tests/nn/test_fused_regions_gpu.py, tests/nn/test_fused_fp8_gpu.py). New fused kernels add an entry to `REGIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.nn.gating import gating_grads, gating_linear, gating_saved
from moe_kernels.ops import expert_mlp as _mlp
from moe_kernels.ops.activation import squared_relu, swiglu
from moe_kernels.ops.grouped_mm import TORCH_GROUPED_MM, grouped_mm, grouped_mm_backend
from moe_kernels.ops.permute import permute, permuted_row_values, permuted_rows, unpermute
from moe_kernels.ops.router import resolve_topk_options
from moe_kernels.ops.router_fused import kernel_fits, launch_bwd, launch_fwd
from moe_kernels.ops.router_losses import capacity

_F32, _I32, _U8 = torch.float32, torch.int32, torch.uint8


Launch = _ext.Launch


def launch_for(x: Tensor) -> Launch | None:
    """The fused regions' launch for kernels on x's device and current stream, or None for the registered
    ops (compiling, exporting, the checking mode, fake or subclass tensors, the references on the CPU, no
    usable extension): moe_kernels._ext.eager."""
    return _ext.eager(x)


# ---------------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Region:
    name: str
    thin: Callable  # (launch, *args): the autograd node over the extension
    ops: Callable  # (*args): the same region as registered custom ops
    launches: str  # what one forward / backward call launches, for the overhead bench and the docs


REGIONS: dict[str, Region] = {}


def run(name: str, launch: Launch | None, *args):
    region = REGIONS[name]
    return region.ops(*args) if launch is None else region.thin(launch, *args)


def _register(name: str, ops: Callable, launches: str):
    def wrap(thin):
        REGIONS[name] = Region(name, thin, ops, launches)
        return thin

    return wrap


_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _f32(t: Tensor | None) -> Tensor | None:
    """t as contiguous fp32; t itself when it already is (no dispatch on the hot path)."""
    if t is None or (t.dtype is _F32 and t.is_contiguous()):
        return t
    return t.float().contiguous()


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype) without the dispatch when t already has it."""
    return t if t.dtype is dtype else t.to(dtype)


def _first_order_only() -> None:
    """The regions' backward kernels are not differentiable: a second derivative (backward with
    create_graph=True) must fail loudly, not come out silently zero."""
    if torch.is_grad_enabled():
        raise RuntimeError("moe_kernels: the MoE layer's fused regions have first derivatives only; for a "
                           "second derivative, run the layer under torch.compile or with backend='reference'")


# ---------------------------------------------------------------------------------------------------
# permute / unpermute


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, num_experts, align, L):
        T, H = x.shape
        k = indices.shape[1]
        x_perm = x.new_empty((permuted_rows(T, k, num_experts, align), H))
        row_map = torch.empty((T, k), dtype=_I32, device=x.device)
        group_sizes = torch.empty((num_experts,), dtype=_I32, device=x.device)
        ws = torch.empty((_ext.size_of(L.C, "permute_workspace_bytes", T * k, num_experts),), dtype=_U8,
                         device=x.device)
        L.C.permute_fwd(_ext.ptr(x), _ext.ptr(indices), _ext.ptr(x_perm), _ext.ptr(row_map), group_sizes.data_ptr(),
                        _ext.ptr(ws), T, k, H * x.element_size(), num_experts, align, L.device, L.stream)
        ctx.mark_non_differentiable(row_map, group_sizes)
        ctx.set_materialize_grads(False)  # no zero gradients allocated for the index outputs
        ctx.save_for_backward(row_map)
        ctx.L, ctx.T = L, T
        return x_perm, row_map, group_sizes

    @staticmethod
    def backward(ctx, g, _g_row_map, _g_sizes):
        _first_order_only()
        (row_map,) = ctx.saved_tensors
        L = ctx.L
        if g is None:
            return None, None, None, None, None
        g = g.contiguous()
        dx = g.new_empty((ctx.T, g.shape[1]))
        L.C.unpermute_fwd(_ext.ptr(g), _ext.ptr(row_map), 0, _ext.ptr(dx), ctx.T, row_map.shape[1], g.shape[1],
                          g.shape[0], _DTYPE[g.dtype], L.device, L.stream)
        return dx, None, None, None, None


@_register("permute", lambda x, indices, E, align: permute(x, indices, E, align=align),
           "permute_fwd / unpermute_fwd")
def permute_region(L: Launch, x: Tensor, indices: Tensor, num_experts: int, align: int):
    return _Permute.apply(x, indices, num_experts, align, L)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_map, weights, L):
        T, k = row_map.shape
        out = y.new_empty((T, y.shape[1]))
        w = _f32(weights)
        L.C.unpermute_fwd(_ext.ptr(y), _ext.ptr(row_map), _ext.ptr(w), _ext.ptr(out), T, k, y.shape[1], y.shape[0],
                          _DTYPE[y.dtype], L.device, L.stream)
        need_dw = weights is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(row_map, w, y if need_dw else None)
        ctx.L, ctx.num_rows, ctx.need_dw = L, y.shape[0], need_dw
        ctx.w_dtype = None if weights is None else weights.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        _first_order_only()
        row_map, w, y = ctx.saved_tensors
        L = ctx.L
        g = g.contiguous()
        T, k = row_map.shape
        dy = g.new_empty((ctx.num_rows, g.shape[1]))
        dw = torch.empty((T, k) if ctx.need_dw else (0,), dtype=_F32, device=g.device)
        row_mask = torch.zeros((ctx.num_rows,), dtype=_U8, device=g.device)
        L.C.unpermute_bwd(_ext.ptr(g), _ext.ptr(y), _ext.ptr(row_map), _ext.ptr(w), _ext.ptr(dy),
                          _ext.ptr(dw) if ctx.need_dw else 0, _ext.ptr(row_mask), T, k, g.shape[1], ctx.num_rows,
                          _DTYPE[g.dtype], L.device, L.stream)
        return dy, None, (as_dtype(dw, ctx.w_dtype) if ctx.need_dw else None), None


@_register("unpermute", unpermute, "unpermute_fwd / unpermute_bwd")
def unpermute_region(L: Launch, y: Tensor, row_map: Tensor, weights: Tensor | None):
    return _Unpermute.apply(y, row_map, weights, L)


# ---------------------------------------------------------------------------------------------------
# experts: grouped GEMM, SwiGLU, grouped GEMM (and the five products of the backward) in one call each way


def _experts_fwd(L: Launch, x: Tensor, group_sizes: int, E: int, w13: Tensor, w2: Tensor, rw: Tensor | None,
                 act: int = 0):
    """experts_fwd on x [R, H] (group_sizes: the device address of the sizes, 0 for one group of every row):
    (h [R, 2F], y [R, H]); the activation a [R, F] is scratch (the backward writes it again from h). act 1: the
    squared ReLU of experts without a gate (w13 [E, F, H], h [R, F], no row weights)."""
    R, H = x.shape
    F = w2.shape[-1]
    h = x.new_empty((R, w13.shape[-2]))
    y = x.new_empty((R, H))
    dt = _DTYPE[x.dtype]
    if R:
        _ext.with_scratch(("experts_fwd", L.device, R, H, F, E, act, dt), x, (R * F * x.element_size(),),
                          lambda scratch, ws, nbytes: L.C.experts_fwd(
                              _ext.ptr(x), _ext.ptr(w13), _ext.ptr(w2), group_sizes, _ext.ptr(rw), _ext.ptr(h),
                              scratch[0], _ext.ptr(y), R, H, F, E, act, dt, ws, nbytes, L.device, L.stream))
    return h, y


def _experts_bwd(L: Launch, dy: Tensor, x: Tensor, h: Tensor, w13: Tensor, w2: Tensor, group_sizes: int, E: int,
                 rw: Tensor | None, need_x: bool, need_w13: bool, need_w2: bool, need_rw: bool, act: int = 0):
    """experts_bwd: (dx, dw13, dw2, drow_weights fp32), each None where not needed; the weights' gradients zero
    where there are no rows."""
    R, H = x.shape
    F = w2.shape[-1]
    dy = dy.contiguous()
    dx = x.new_empty((R, H)) if need_x else None
    alloc = torch.empty_like if R else torch.zeros_like
    dw13 = alloc(w13) if need_w13 else None
    dw2 = alloc(w2) if need_w2 else None
    drw = torch.empty((R,), dtype=_F32, device=x.device) if need_rw else None
    if R:
        dt, es = _DTYPE[x.dtype], x.element_size()
        # scratch: da [R, F], dh [R, 2F] ([R, F] for the squared ReLU), a [R, F] (the activation again, for dw2)
        _ext.with_scratch(("experts_bwd", L.device, R, H, F, E, act, dt), x,
                          (R * F * es, R * h.shape[1] * es, R * F * es if need_w2 else 0),
                          lambda scratch, ws, nbytes: L.C.experts_bwd(
                              _ext.ptr(dy), _ext.ptr(x), _ext.ptr(h), scratch[2], _ext.ptr(w13), _ext.ptr(w2),
                              group_sizes, _ext.ptr(rw), scratch[0], scratch[1], _ext.ptr(dx), _ext.ptr(dw13),
                              _ext.ptr(dw2), _ext.ptr(drw), R, H, F, E, act, dt, ws, nbytes, L.device, L.stream))
    return dx, dw13, dw2, drw


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_sizes, w13, w2, row_weights, L, act):
        rw = _f32(row_weights)
        h, y = _experts_fwd(L, x, _ext.ptr(group_sizes), w13.shape[0], w13, w2, rw, act)
        ctx.save_for_backward(x, h, w13, w2, group_sizes, rw)
        ctx.L, ctx.act = L, act
        ctx.rw_dtype = None if row_weights is None else row_weights.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        _first_order_only()
        x, h, w13, w2, group_sizes, rw = ctx.saved_tensors
        need_x, _, need_w13, need_w2, need_rw, _, _ = ctx.needs_input_grad
        need_rw = need_rw and rw is not None
        dx, dw13, dw2, drw = _experts_bwd(ctx.L, dy, x, h, w13, w2, _ext.ptr(group_sizes), w13.shape[0], rw, need_x,
                                          need_w13, need_w2, need_rw, ctx.act)
        return dx, None, dw13, dw2, (as_dtype(drw, ctx.rw_dtype) if need_rw else None), None, None


def _experts_ops(x, group_sizes, w13, w2, row_weights):
    return grouped_mm(swiglu(grouped_mm(x, w13, group_sizes), row_weights), w2, group_sizes)


@_register("experts", _experts_ops, "experts_fwd (grouped_mm, swiglu, grouped_mm) / experts_bwd (5 products)")
def experts_region(L: Launch, x: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor, row_weights: Tensor | None):
    if not experts_fit(x):
        return _experts_ops(x, group_sizes, w13, w2, row_weights)
    return _Experts.apply(x, group_sizes, w13, w2, row_weights, L, 0)


def _squared_relu_experts_ops(x, group_sizes, w_up, w2):
    return grouped_mm(squared_relu(grouped_mm(x, w_up, group_sizes)), w2, group_sizes)


@_register("experts_squared_relu", _squared_relu_experts_ops,
           "experts_fwd (grouped_mm, squared_relu, grouped_mm) / experts_bwd (5 products)")
def experts_squared_relu_region(L: Launch, x: Tensor, group_sizes: Tensor, w_up: Tensor, w2: Tensor):
    """The `experts` region for experts without a gate (Nemotron-H's): relu(x w_up^T)^2 w2^T per group, w_up
    [E, F, H], w2 [E, H, F], no row weights (the unpermute or the combine applies the routing weights)."""
    if not experts_fit(x):
        return _squared_relu_experts_ops(x, group_sizes, w_up, w2)
    return _Experts.apply(x, group_sizes, w_up, w2, None, L, 1)


def experts_fit(x: Tensor) -> bool:
    """The composite runs our grouped GEMM (CUTLASS on sm_90a, else the portable kernel); where grouped_mm
    prefers torch._grouped_mm for this GPU and dtype (ops/grouped_mm.py, `grouped_mm_backend`), the region
    composes the registered ops instead, which call it."""
    return grouped_mm_backend(x.device, x.dtype) != TORCH_GROUPED_MM


# ---------------------------------------------------------------------------------------------------
# mlp: a dense SwiGLU MLP (the shared experts) as the experts' products over one group of every row


class _Mlp(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) for x [T, H], gate and up [F, H], down [H, F]: experts_fwd / experts_bwd with
    one expert whose w13 is gate and up stacked (a copy of those weights in each direction, not kept between them;
    under autocast gate and up are casts, kept as the registered ops keep them) and no group sizes (the GEMMs take
    every row as one group)."""

    @staticmethod
    def forward(ctx, x, gate, up, down, L):
        h, y = _experts_fwd(L, x, 0, 1, torch.cat((gate, up)), down, None)
        ctx.save_for_backward(x, h, gate, up, down)
        ctx.L = L
        return y

    @staticmethod
    def backward(ctx, dy):
        _first_order_only()
        x, h, gate, up, down = ctx.saved_tensors
        need_x, need_gate, need_up, need_down, _ = ctx.needs_input_grad
        dx, dw13, ddown, _ = _experts_bwd(ctx.L, dy, x, h, torch.cat((gate, up)), down, 0, 1, None, need_x,
                                          need_gate or need_up, need_down, False)
        dgate, dup = dw13.chunk(2) if dw13 is not None else (None, None)
        return dx, dgate, dup, ddown, None


def _mlp_ops(x, gate, up, down):
    sizes = torch.full((1,), x.shape[0], dtype=_I32, device=x.device)
    return _experts_ops(x, sizes, torch.cat((gate, up)).unsqueeze(0), down.unsqueeze(0), None)


@_register("mlp", _mlp_ops, "experts_fwd (grouped_mm, swiglu, grouped_mm; one group) / experts_bwd (5 products)")
def mlp_region(L: Launch, x: Tensor, gate: Tensor, up: Tensor, down: Tensor):
    """(silu(x gate^T) * (x up^T)) down^T [T, H] for x [T, H]: a dense SwiGLU MLP of bias-free nn.Linear weights."""
    if not experts_fit(x):
        return _mlp_ops(x, gate, up, down)
    return _Mlp.apply(x, gate, up, down, L)


# ---------------------------------------------------------------------------------------------------
# moe: permute, experts and the weighted unpermute as one node, tokens in, tokens out, one call each way


class _Moe(torch.autograd.Function):
    """Its tensors for the backward: x and indices (the backward permutes x again, bit for bit the forward's rows:
    no permuted copy of x is kept; in training x is what the router's gating keeps too, except under autocast, where
    the layer hands the region x's cast copy), h, and y when the weights need a gradient, h and y parts of one
    allocation; the workspace and the scratch of each direction are another: two allocator calls each way besides the
    outputs. The activation a is scratch each way: the backward writes it again from h."""

    @staticmethod
    def forward(ctx, x, indices, weights, w13, w2, num_experts, align, L, act, in_activation):
        """in_activation: the routing weights applied in the activation (SwiGLU), the unpermute a plain sum."""
        T, H = x.shape
        k = indices.shape[1]
        E, F2, _ = w13.shape  # F2: the first projection's width, 2F for SwiGLU, F for the squared ReLU (act 1)
        F = w2.shape[-1]
        R = permuted_rows(T, k, num_experts, align)
        es = x.element_size()
        need_w = weights is not None and ctx.needs_input_grad[2]
        keep_y = need_w and not in_activation  # the unpermute's weights' gradient reads y
        kept, (h, y) = _ext.carve(x, R * F2 * es, R * H * es if keep_y else 0, saved=True)
        out = x.new_empty((T, H))
        w = _f32(weights)
        dt = _DTYPE[x.dtype]
        # scratch: x_perm [R, H], row_map [T, k], group_sizes [E], the row weights [R] (in the activation), a [R, F],
        # and y [R, H] where it is not kept
        _ext.with_scratch(("moe_fwd", L.device, T, k, R, H, F, E, act, in_activation, dt), x,
                          (R * H * es, T * k * 4, E * 4, R * 4 if in_activation else 0, R * F * es,
                           0 if keep_y else R * H * es),
                          lambda scratch, ws, nbytes: L.C.moe_fwd(
                              _ext.ptr(x), _ext.ptr(indices), _ext.ptr(w), _ext.ptr(w13), _ext.ptr(w2), scratch[0],
                              scratch[1], scratch[2], scratch[3], h, scratch[4], y or scratch[5], _ext.ptr(out), T, k,
                              R, H, F, E, align, act, dt, ws, nbytes, L.device, L.stream))
        ctx.save_for_backward(x, indices, kept, w, w13, w2)
        ctx.L, ctx.need_w, ctx.shape, ctx.act, ctx.align = L, need_w, (T, k, R, H, F, F2, E, es), act, align
        ctx.in_activation = in_activation
        ctx.offsets = [p - kept.data_ptr() if p else -1 for p in (h, y)]
        ctx.w_dtype = None if weights is None else weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        _first_order_only()
        x, indices, kept, w, w13, w2 = ctx.saved_tensors
        L, need_w = ctx.L, ctx.need_w
        T, k, R, H, F, F2, E, es = ctx.shape
        kept = _aligned(kept)  # (held: the kernels read it)
        base = kept.data_ptr()
        h, y = (base + o if o >= 0 else 0 for o in ctx.offsets)
        need_x, _, _, need_w13, need_w2 = ctx.needs_input_grad[:5]
        dout = dout.contiguous()
        dev = dout.device
        if R == 0:  # no slots: nothing flows back
            dx = dout.new_zeros((T, H)) if need_x else None
            dw13 = torch.zeros_like(w13) if need_w13 else None
            dw2 = torch.zeros_like(w2) if need_w2 else None
            dw = torch.zeros((T, k), dtype=_F32, device=dev) if need_w else None
        else:
            x, indices = _aligned(x), _aligned(indices)
            dx = dout.new_empty((T, H)) if need_x else None
            dw13 = torch.empty_like(w13) if need_w13 else None
            dw2 = torch.empty_like(w2) if need_w2 else None
            dw = torch.empty((T, k), dtype=_F32, device=dev) if need_w else None
            dt = _DTYPE[dout.dtype]
            wia = ctx.in_activation
            # scratch: x_perm (for dw13), row_map, group_sizes (the permute again), the row weights and their
            # gradient (in the activation), dy, da, dh, dx_perm, a (the activation again, for dw2)
            _ext.with_scratch(("moe_bwd", L.device, T, k, R, H, F, E, ctx.act, wia, dt), dout,
                              (R * H * es if need_w13 else 0, T * k * 4, E * 4, R * 4 if wia else 0,
                               R * 4 if wia and need_w else 0, R * H * es, R * F * es, R * F2 * es,
                               R * H * es if need_x else 0, R * F * es if need_w2 else 0),
                              lambda scratch, ws, nbytes: L.C.moe_bwd(
                                  _ext.ptr(dout), _ext.ptr(x), _ext.ptr(indices), _ext.ptr(w), h, scratch[9], y,
                                  _ext.ptr(w13), _ext.ptr(w2), *scratch[:9], _ext.ptr(dx), _ext.ptr(dw13),
                                  _ext.ptr(dw2), _ext.ptr(dw), T, k, R, H, F, E, ctx.align, ctx.act, dt, ws, nbytes,
                                  L.device, L.stream))
        return dx, None, (as_dtype(dw, ctx.w_dtype) if need_w else None), dw13, dw2, None, None, None, None, None


def _aligned(t: Tensor) -> Tensor:
    """t, or a copy at a 16-byte aligned address where a saved_tensors_hooks unpack restored it elsewhere (the
    kernels' vector loads)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _moe_ops(x, indices, weights, w13, w2, num_experts, align, experts=None):
    """experts: (x_perm, group_sizes, w13, w2) -> y; default SwiGLU's without row weights."""
    x_perm, row_map, group_sizes = permute(x, indices, num_experts, align=align)
    y = _experts_ops(x_perm, group_sizes, w13, w2, None) if experts is None else experts(x_perm, group_sizes, w13, w2)
    return unpermute(y, row_map, weights)


@_register("moe", _moe_ops, "moe_fwd (permute, grouped_mm, swiglu, grouped_mm, unpermute) / "
           "moe_bwd (permute again, unpermute_bwd, 5 products, unpermute of dx)")
def moe_region(L: Launch, x: Tensor, indices: Tensor, weights: Tensor | None, w13: Tensor, w2: Tensor,
               num_experts: int, align: int):
    """out [T, H] = unpermute(experts(permute(x)), weights): the plain local layer's routed experts (the routing
    weights applied in the unpermute)."""
    return _Moe.apply(x, indices, weights, w13, w2, num_experts, align, L, 0, False)


def _moe_weights_in_activation_ops(x, indices, weights, w13, w2, num_experts, align):
    x_perm, row_map, group_sizes = permute(x, indices, num_experts, align=align)
    row_weights = permuted_row_values(weights, row_map, x_perm.shape[0])
    return unpermute(_experts_ops(x_perm, group_sizes, w13, w2, row_weights), row_map, None)


@_register("moe_weights_in_activation", _moe_weights_in_activation_ops,
           "moe_fwd (permute, the weights to their rows, grouped_mm, swiglu, grouped_mm, unpermute) / "
           "moe_bwd (permute again, unpermute_bwd, 5 products, the weights' gradient to their slots, unpermute of dx)")
def moe_weights_in_activation_region(L: Launch, x: Tensor, indices: Tensor, weights: Tensor, w13: Tensor,
                                     w2: Tensor, num_experts: int, align: int):
    """The `moe` region with the routing weights applied in the SwiGLU (MoEConfig.weights_in_activation,
    Megatron's): out [T, H] = unpermute(swiglu(x_perm w13^T, the weights moved to their rows) w2^T), a plain sum.
    Keeps h only (no permuted copy, no expert outputs: the weights' gradient comes from the activation's backward)."""
    return _Moe.apply(x, indices, weights, w13, w2, num_experts, align, L, 0, True)


def _moe_squared_relu_ops(x, indices, weights, w_up, w2, num_experts, align):
    return _moe_ops(x, indices, weights, w_up, w2, num_experts, align, experts=_squared_relu_experts_ops)


@_register("moe_squared_relu", _moe_squared_relu_ops,
           "moe_fwd (permute, grouped_mm, squared_relu, grouped_mm, unpermute) / "
           "moe_bwd (permute again, unpermute_bwd, 5 products, unpermute of dx)")
def moe_squared_relu_region(L: Launch, x: Tensor, indices: Tensor, weights: Tensor | None, w_up: Tensor, w2: Tensor,
                            num_experts: int, align: int):
    """The `moe` region for experts without a gate (Nemotron-H's): out [T, H] = unpermute(relu(x_perm w_up^T)^2
    w2^T, weights), w_up [E, F, H], w2 [E, H, F]; the same kernels and launches, the squared ReLU for SwiGLU."""
    return _Moe.apply(x, indices, weights, w_up, w2, num_experts, align, L, 1, False)


# ---------------------------------------------------------------------------------------------------
# expert_mlp: the gather-fused experts (ops/expert_mlp.py), tokens in, tokens out, one call each way


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_map, group_sizes, w13, w2, row_weights, num_rows, L):
        rw = _f32(row_weights)
        out, row_token, h = _mlp.launch_fwd(L.C, L.device, L.stream, x, row_map, group_sizes, w13, w2, rw, num_rows)
        ctx.save_for_backward(x, row_token, row_map, h, w13, w2, group_sizes, rw)
        ctx.L = L
        ctx.rw_dtype = None if row_weights is None else row_weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        _first_order_only()
        x, row_token, row_map, h, w13, w2, group_sizes, rw = ctx.saved_tensors
        L = ctx.L
        need_x, _, _, need_w13, need_w2, need_rw, _, _ = ctx.needs_input_grad
        dx, dw13, dw2, drw = _mlp.launch_bwd(L.C, L.device, L.stream, dout.contiguous(), x, row_token, row_map, h, w13,
                                             w2, group_sizes, rw, need_x, need_w13, need_w2, need_rw)
        return dx, None, None, dw13, dw2, (as_dtype(drw, ctx.rw_dtype) if drw is not None else None), None, None


def _expert_mlp_ops(x, row_map, group_sizes, w13, w2, row_weights, num_rows):
    return _mlp.expert_mlp(x, row_map, group_sizes, w13, w2, row_weights, num_rows=num_rows)


@_register("expert_mlp", _expert_mlp_ops,
           "expert_mlp_fwd (rows_to_tokens, gathered grouped_mm + SwiGLU epilogue, grouped_mm, unpermute) / "
           "expert_mlp_bwd (gathered dgrad, swiglu_bwd writing the activation again, gathered wgrad, dgrad, unpermute, "
           "gathered wgrad)")
def expert_mlp_region(L: Launch, x: Tensor, row_map: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor,
                      row_weights: Tensor | None, num_rows: int):
    return _ExpertMLP.apply(x, row_map, group_sizes, w13, w2, row_weights, num_rows, L)


# ---------------------------------------------------------------------------------------------------
# router: the gating linear, top-k, capacity, per-expert counts and the configured losses; their gradients in one
# backward


class RouterSpec(NamedTuple):
    """A Router's options as the kernels take them, resolved once per module (the config is frozen)."""

    E: int
    k: int
    score: int
    pre_softmax: bool
    num_groups: int
    group_topk: int
    group_score_topk: int
    scale: float
    normalize: bool
    capacity_factor: float | None
    by_probs: bool
    aux_coeff: float
    seq_coeff: float
    z_coeff: float


_SCORE_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def router_spec(cfg) -> RouterSpec:
    G, g, gst, scale, norm = resolve_topk_options(cfg.k, cfg.num_groups, cfg.group_topk, cfg.group_score_topk,
                                                  cfg.scaling_factor, cfg.normalize, cfg.num_experts, score=cfg.score)
    return RouterSpec(cfg.num_experts, cfg.k, _SCORE_CODES[cfg.score], cfg.pre_softmax, G, g, gst, scale, norm,
                      cfg.capacity_factor, cfg.capacity_policy == "probs", float(cfg.aux_loss_coeff),
                      float(cfg.seq_aux_loss_coeff), float(cfg.z_loss_coeff))


def router_fits(C, spec: RouterSpec) -> bool:
    """Whether the fused router kernel takes these options (else the router composes the separate ops)."""
    return kernel_fits(C, spec.E, spec.k, spec.num_groups) and (
        spec.capacity_factor is None or spec.E <= C.balance_max_experts)


class _Router(torch.autograd.Function):
    """x [T, H] (fp32, bf16 or fp16), weight [E, H] fp32 -> weights [T, k] fp32, indices [T, k] int32, counts [E]
    int32, loss [] fp32, logits [T, E] fp32: the gating linear (x kept in its own dtype, as moe_kernels.nn.gating
    keeps it), then the router_fused kernel each way (capacity adds its select and the counts after it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_len, spec, L):
        logits = torch.nn.functional.linear(x if x.dtype is _F32 else x.float(), weight)
        C, dev, s = L.C, L.device, L.stream
        weights, indices, counts, aux_counts, seq_counts, loss = launch_fwd(
            C, dev, s, logits, bias, spec.k, spec.score, spec.pre_softmax, spec.num_groups, spec.group_topk,
            spec.group_score_topk, spec.scale, spec.normalize, spec.aux_coeff, spec.seq_coeff, seq_len,
            spec.z_coeff)
        kept = indices
        if spec.capacity_factor is not None:
            T, E, k = logits.shape[0], spec.E, spec.k
            n = T * k
            cap = min(capacity(T, k, E, spec.capacity_factor), n)
            w_out, kept = torch.empty_like(weights), torch.empty_like(indices)
            ws = torch.empty((_ext.size_of(C, "capacity_workspace_bytes", n, E),), dtype=_U8, device=logits.device)
            C.apply_capacity(_ext.ptr(weights), _ext.ptr(indices), _ext.ptr(w_out), _ext.ptr(kept), _ext.ptr(ws), n, E,
                             cap, spec.by_probs, 0, dev, s)
            weights = w_out
            C.tokens_per_expert(_ext.ptr(kept), n, E, counts.data_ptr(), dev, s)
        ctx.mark_non_differentiable(kept, counts)
        ctx.set_materialize_grads(False)  # no zero gradients allocated for the index outputs
        ctx.save_for_backward(*gating_saved(ctx, x, weight), logits, indices, kept, aux_counts, seq_counts)
        ctx.spec, ctx.seq_len, ctx.L = spec, seq_len, L
        return weights, kept, counts, loss, logits

    @staticmethod
    def backward(ctx, g_weights, _g_indices, _g_counts, g_loss, g_logits):
        _first_order_only()
        x, weight, logits, indices, kept, aux_counts, seq_counts = ctx.saved_tensors
        spec, L = ctx.spec, ctx.L
        if g_weights is None and g_loss is None:  # only the logits, used elsewhere, reached the router, or nothing did
            # (zero then, as the registered ops materialize it: x and the weight get zero gradients, not None)
            grad = g_logits if g_logits is not None else torch.zeros_like(logits)
        else:
            if g_weights is None:  # the loss alone reached the router's kernel
                g_weights = torch.zeros(indices.shape, dtype=_F32, device=logits.device)
            elif spec.capacity_factor is not None:
                g_weights = torch.where(kept >= 0, g_weights, 0.0)
            g_loss = _f32(g_loss)
            grad = launch_bwd(L.C, L.device, L.stream, _f32(g_weights), g_loss, logits, indices, aux_counts,
                              seq_counts, spec.k, spec.score, spec.pre_softmax, spec.normalize, spec.scale,
                              spec.aux_coeff, spec.seq_coeff, ctx.seq_len, spec.z_coeff)
            if g_logits is not None:
                grad = grad + g_logits
        dx, dw = gating_grads(ctx, grad, x, weight)
        return dx, dw, None, None, None, None


def _router_ops(router, x: Tensor, weight: Tensor, seq_len: int):
    logits = gating_linear(x, weight)
    return (*router.route_with_ops(logits, seq_len), logits)


@_register("router", _router_ops, "router_fused_fwd [apply_capacity tokens_per_expert] / router_fused_bwd")
def router_region(L: Launch, router, x: Tensor, weight: Tensor, seq_len: int):
    """(weights, indices, counts, loss, logits) of `router` (a moe_kernels.nn.Router) on x [T, H]: the gating linear
    x weight^T (weight: the router's, in fp32) and the routing on its logits."""
    return _Router.apply(x, weight, router.expert_bias, router.checked_seq_len(x, seq_len), router.spec, L)
