"""The gather-fused expert MLP: the routed experts' SwiGLU MLPs read straight from the tokens.

    out[t] = sum over t's slots j with row_map[t, j] >= 0 of  y[row_map[t, j]],   where for row r of expert e
    y[r] = swiglu(x[token(r)] @ w13[e]^T, row_weights[r]) @ w2[e]^T

with `row_map` [T, k] and `group_sizes` [E] from permute (rows grouped by expert, R rows in all, padding rows
belonging to no token) and token(r) the token whose slot maps to row r. The routing weights, when given, are
applied inside the activation (`MoEConfig.weights_in_activation`), so the tokens' outputs are plain sums.

It computes what `permute -> grouped_mm -> swiglu -> grouped_mm -> unpermute` computes, bit for bit on the same
kernels, without writing what that chain writes only to move rows around:
- the forward's first GEMM gathers its rows from x by `row_token` (the inverse of row_map), with SwiGLU and
  the routing weight applied in its epilogue: no permuted copy of x, kept or not;
- the backward gathers dout's rows into both products of the down projection: the expert outputs' gradient
  [R, H] is never written, and x's rows again into the up projection's weight gradient;
- it keeps only h = x W13^T [R, 2F] (and row_token [R]) for the backward; the activation is recomputed
  from h there, and the expert outputs are not kept (the weights live in the activation).
Per layer that keeps R * (H + F) elements fewer than the composition (its x_perm and activation) and writes
R * H fewer in each direction (x_perm; the expert outputs' gradient).

On sm_90a the gathered products run WGMMA kernels of their own (csrc/gemm/sm90/gather_sm90.cuh: cp.async row
gathers, the SwiGLU epilogue from registers), opt-in with MOE_KERNELS_GATHER_CUTLASS=1 until they have run on a GPU;
elsewhere, and by default, the portable grouped GEMM. MoEConfig(gather_experts=True) opts the layer in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.ops._checks import CUDA_FLOAT_DTYPES, FLOAT_DTYPES, check_cuda_dtype, check_int, check_shape, check_tensor
from moe_kernels.ops.activation import swiglu_bwd_reference, swiglu_reference
from moe_kernels.ops.grouped_mm import (
    _check_sizes_values,
    grouped_mm_dgrad_reference,
    grouped_mm_reference,
    grouped_mm_wgrad_reference,
)
from moe_kernels.ops.permute import _check_row_map_values, slot_of_row, unpermute_reference

_OP = "expert_mlp"


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The routing weights' gradient's dtype (swiglu_bwd's): fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
_INT32_MAX = 2**31 - 1


def _check(x: Tensor, row_map: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor, row_weights: Tensor | None,
           num_rows: int) -> None:
    op = _OP
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    dev = x.device
    check_tensor(op, "row_map", row_map, ndim=2, dtypes=(torch.int32,), device=dev)
    if row_map.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: `row_map` has {row_map.shape[0]} rows but `x` has {x.shape[0]} tokens; "
                         "expected [T, k] from permute")
    check_tensor(op, "w13", w13, ndim=3, dtypes=(x.dtype,), device=dev)
    E, F2, H = w13.shape
    if H != x.shape[1]:
        raise ValueError(f"{op}: `w13` has H={H} in-features but `x` has H={x.shape[1]}; w13 is [E, 2F, H]")
    if F2 % 2:
        raise ValueError(f"{op}: `w13` must hold [gate | up] rows, got an odd 2F={F2}")
    check_tensor(op, "w2", w2, ndim=3, dtypes=(x.dtype,), device=dev)
    check_shape(op, "w2", w2, (E, H, F2 // 2), "[E, H, F] with E, H, F from w13")
    check_tensor(op, "group_sizes", group_sizes, ndim=1, dtypes=(torch.int32,), device=dev)
    check_shape(op, "group_sizes", group_sizes, (E,), "one size per expert, E from w13")
    check_int(op, "num_rows", num_rows, minimum=0, maximum=_INT32_MAX)
    if row_weights is not None:
        check_tensor(op, "row_weights", row_weights, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check_shape(op, "row_weights", row_weights, (num_rows,), "one weight per permuted row")


def _check_bwd(dout: Tensor, x: Tensor, row_token: Tensor, row_map: Tensor, h: Tensor, w13: Tensor, w2: Tensor,
               group_sizes: Tensor, row_weights: Tensor | None) -> None:
    """The backward op's arguments: the forward's checks, and dout, row_token and h as the forward made them."""
    R = h.shape[0] if isinstance(h, Tensor) and h.dim() == 2 else 0
    _check(x, row_map, group_sizes, w13, w2, row_weights, R)
    op = f"{_OP} backward"
    check_tensor(op, "dout", dout, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape(op, "dout", dout, tuple(x.shape), "the shape of x")
    check_tensor(op, "h", h, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape(op, "h", h, (R, w13.shape[1]), "[R, 2F], the forward's")
    check_tensor(op, "row_token", row_token, ndim=1, dtypes=(torch.int32,), device=x.device)
    check_shape(op, "row_token", row_token, (R,), "one token per permuted row, the forward's")


def _check_values(row_map: Tensor, group_sizes: Tensor, num_rows: int) -> None:
    """Host-syncing checks of the routing's values (the CPU path, and the CUDA path in the checking mode)."""
    _check_row_map_values(row_map, num_rows, _OP)
    _check_sizes_values(group_sizes, num_rows, _OP)


# ---------------------------------------------------------------------------------------------------
# References: the composition it replaces, on the plain PyTorch references


def rows_to_tokens_reference(row_map: Tensor, num_rows: int) -> Tensor:
    """[R] int32: the token whose slot row_map sends to each row, -1 for rows no slot maps to."""
    slot = slot_of_row(row_map, num_rows)
    return torch.where(slot >= 0, slot // row_map.shape[1], -1).to(torch.int32)


def _gather_rows(t: Tensor, row_token: Tensor) -> Tensor:
    """t's rows in permuted order, zeros for padding rows (what permute writes there): row -1 takes the zero row
    appended to t (which also serves T = 0, where t has no row to clamp an index to)."""
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[row_token.long()]


def expert_mlp_reference(x: Tensor, row_map: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor,
                         row_weights: Tensor | None, num_rows: int) -> Tensor:
    """The definition; differentiable (plain PyTorch)."""
    return _forward_reference(x, row_map, group_sizes, w13, w2, row_weights, num_rows)[0]


def _forward_reference(x, row_map, group_sizes, w13, w2, row_weights, num_rows):
    """(out, row_token, h): the definition with what its backward keeps."""
    row_token = rows_to_tokens_reference(row_map, num_rows)
    h = grouped_mm_reference(_gather_rows(x, row_token), w13, group_sizes)
    y = grouped_mm_reference(swiglu_reference(h, row_weights), w2, group_sizes)
    return unpermute_reference(y, row_map, None), row_token, h


def expert_mlp_bwd_reference(dout: Tensor, x: Tensor, row_token: Tensor, row_map: Tensor, h: Tensor, w13: Tensor,
                             w2: Tensor, group_sizes: Tensor, row_weights: Tensor | None, need_dx: bool,
                             need_dw13: bool, need_dw2: bool, need_drw: bool):
    dy = _gather_rows(dout, row_token)  # the expert outputs' gradient (the kernels gather it inside the GEMMs)
    da = grouped_mm_dgrad_reference(dy, w2, group_sizes)
    dw2 = grouped_mm_wgrad_reference(dy, swiglu_reference(h, row_weights), group_sizes) if need_dw2 else None
    dh, drw = swiglu_bwd_reference(da, h, row_weights, need_drw)
    dx = unpermute_reference(grouped_mm_dgrad_reference(dh, w13, group_sizes), row_map, None) if need_dx else None
    dw13 = grouped_mm_wgrad_reference(dh, _gather_rows(x, row_token), group_sizes) if need_dw13 else None
    return dx, dw13, dw2, (drw if need_drw else None)


# ---------------------------------------------------------------------------------------------------
# Registered ops


@torch.library.custom_op("moe_kernels::expert_mlp", mutates_args=())
def _expert_mlp(x: Tensor, row_map: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor, row_weights: Tensor | None,
                num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    _check(x, row_map, group_sizes, w13, w2, row_weights, num_rows)
    _check_values(row_map, group_sizes, num_rows)
    return _forward_reference(x, row_map, group_sizes, w13, w2, row_weights, num_rows)


@torch.library.custom_op("moe_kernels::expert_mlp_bwd", mutates_args=())
def _expert_mlp_bwd(dout: Tensor, x: Tensor, row_token: Tensor, row_map: Tensor, h: Tensor, w13: Tensor, w2: Tensor,
                    group_sizes: Tensor, row_weights: Tensor | None, need_dx: bool, need_dw13: bool, need_dw2: bool,
                    need_drw: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_bwd(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights)
    dx, dw13, dw2, drw = expert_mlp_bwd_reference(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights,
                                                  need_dx, need_dw13, need_dw2, need_drw)
    return _filled(dx, dw13, dw2, drw, x)


def _filled(dx, dw13, dw2, drw, x):
    """Gradients not asked for as empty tensors (a custom op returns tensors)."""
    def empty():  # one each: a custom op's outputs may not alias
        return x.new_empty((0,))

    return (empty() if dx is None else dx, empty() if dw13 is None else dw13, empty() if dw2 is None else dw2,
            x.new_empty((0,), dtype=_acc(x.dtype)) if drw is None else drw)


@_expert_mlp.register_fake
def _(x, row_map, group_sizes, w13, w2, row_weights, num_rows):
    _check(x, row_map, group_sizes, w13, w2, row_weights, num_rows)
    return (x.new_empty(x.shape), row_map.new_empty((num_rows,)), x.new_empty((num_rows, w13.shape[1])))


@_expert_mlp_bwd.register_fake
def _(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights, need_dx, need_dw13, need_dw2, need_drw):
    _check_bwd(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights)
    return (x.new_empty(x.shape if need_dx else (0,)), w13.new_empty(w13.shape if need_dw13 else (0,)),
            w2.new_empty(w2.shape if need_dw2 else (0,)),
            x.new_empty((h.shape[0],) if need_drw else (0,), dtype=_acc(x.dtype)))


def launch_fwd(C, device: int, stream: int, x: Tensor, row_map: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor,
               rw: Tensor | None, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out [T, H], row_token [R] int32, h [R, 2F]) from the extension; rw fp32 or None. Shared by the registered
    op and the layer's fused region."""
    T, H = x.shape
    k = row_map.shape[1]
    E, F2, _ = w13.shape
    F, R = F2 // 2, num_rows
    row_token = torch.empty((R,), dtype=torch.int32, device=x.device)
    h = x.new_empty((R, F2))
    if R == 0 or E == 0 or H == 0:
        # No rows: every token's output is an empty sum. An empty reduction (H == 0) gives h = 0.
        if R:
            row_token.copy_(rows_to_tokens_reference(row_map, R))
            h.zero_()
        return x.new_zeros((T, H)), row_token, h
    out = x.new_empty((T, H))
    a = x.new_empty((R, F))
    y = x.new_empty((R, H))
    dt = _ext.dtype_code(x.dtype)
    _ext.with_workspace(("expert_mlp_fwd", device, T, k, R, H, F, E, dt), C.expert_mlp_fwd, x, _ext.ptr(x),
                        _ext.ptr(row_map), _ext.ptr(group_sizes), _ext.ptr(w13), _ext.ptr(w2), _ext.ptr(rw),
                        _ext.ptr(row_token), _ext.ptr(h), _ext.ptr(a), _ext.ptr(y), _ext.ptr(out), T, k, R, H, F, E, dt,
                        device, stream)
    return out, row_token, h


def launch_bwd(C, device: int, stream: int, dout: Tensor, x: Tensor, row_token: Tensor, row_map: Tensor, h: Tensor,
               w13: Tensor, w2: Tensor, group_sizes: Tensor, rw: Tensor | None, need_dx: bool, need_dw13: bool,
               need_dw2: bool, need_drw: bool):
    """(dx, dw13, dw2, drw fp32) from the extension, None where not asked for."""
    T, H = x.shape
    k = row_map.shape[1]
    E, F2, _ = w13.shape
    F, R = F2 // 2, h.shape[0]
    need_drw = need_drw and rw is not None
    if R == 0 or E == 0 or H == 0:
        return (x.new_zeros((T, H)) if need_dx else None, torch.zeros_like(w13) if need_dw13 else None,
                torch.zeros_like(w2) if need_dw2 else None,
                torch.zeros((R,), dtype=torch.float32, device=x.device) if need_drw else None)
    dx = x.new_empty((T, H)) if need_dx else None
    dw13 = torch.empty_like(w13) if need_dw13 else None
    dw2 = torch.empty_like(w2) if need_dw2 else None
    drw = torch.empty((R,), dtype=torch.float32, device=x.device) if need_drw else None
    a = x.new_empty((R, F)) if need_dw2 else None
    da = x.new_empty((R, F))
    dh = x.new_empty((R, F2))
    dxp = x.new_empty((R, H)) if need_dx else None
    dt = _ext.dtype_code(x.dtype)
    _ext.with_workspace(("expert_mlp_bwd", device, T, k, R, H, F, E, dt), C.expert_mlp_bwd, x, _ext.ptr(dout),
                        _ext.ptr(x), _ext.ptr(row_token), _ext.ptr(row_map), _ext.ptr(h), _ext.ptr(w13), _ext.ptr(w2),
                        _ext.ptr(group_sizes), _ext.ptr(rw), _ext.ptr(a), _ext.ptr(da), _ext.ptr(dh), _ext.ptr(dxp),
                        _ext.ptr(dx), _ext.ptr(dw13), _ext.ptr(dw2), _ext.ptr(drw), T, k, R, H, F, E, dt, device, stream)
    return dx, dw13, dw2, drw


def _kernels(x: Tensor, row_map: Tensor, group_sizes: Tensor, num_rows: int):
    check_cuda_dtype(_OP, "x", x, CUDA_FLOAT_DTYPES)
    C = _ext.kernels(_OP, x)
    if C is None or _ext.checks_enabled():
        _check_values(row_map, group_sizes, num_rows)
    if C is not None and group_sizes.shape[0] > C.grouped_mm_max_groups:
        raise ValueError(f"{_OP}: the CUDA kernels take at most {C.grouped_mm_max_groups} experts")
    return C


@_ext.cuda_impl(_expert_mlp)
def _expert_mlp_cuda(x, row_map, group_sizes, w13, w2, row_weights, num_rows):
    _check(x, row_map, group_sizes, w13, w2, row_weights, num_rows)
    C = _kernels(x, row_map, group_sizes, num_rows)
    if C is None:
        return _forward_reference(x, row_map, group_sizes, w13, w2, row_weights, num_rows)
    rw = None if row_weights is None else row_weights.float().contiguous()
    launch = _ext.launch_args(x)
    return launch_fwd(C, launch["device"], launch["stream"], x, row_map, group_sizes, w13, w2, rw, num_rows)


@_ext.cuda_impl(_expert_mlp_bwd)
def _expert_mlp_bwd_cuda(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights, need_dx, need_dw13,
                         need_dw2, need_drw):
    _check_bwd(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights)
    C = _ext.kernels(_OP, x)
    if C is None:
        return _filled(*expert_mlp_bwd_reference(dout, x, row_token, row_map, h, w13, w2, group_sizes, row_weights,
                                                 need_dx, need_dw13, need_dw2, need_drw), x)
    rw = None if row_weights is None else row_weights.float().contiguous()
    launch = _ext.launch_args(x)
    grads = launch_bwd(C, launch["device"], launch["stream"], dout.contiguous(), x, row_token, row_map, h, w13, w2,
                       group_sizes, rw, need_dx, need_dw13, need_dw2, need_drw)
    return _filled(*grads, x)


def _setup(ctx, inputs, output):
    x, row_map, group_sizes, w13, w2, row_weights, _ = inputs
    _, row_token, h = output
    ctx.save_for_backward(x, row_token, row_map, h, w13, w2, group_sizes, row_weights)
    ctx.mark_non_differentiable(row_token, h)
    ctx.rw_dtype = None if row_weights is None else row_weights.dtype


def _backward(ctx, dout, _g_row_token, _g_h):
    x, row_token, row_map, h, w13, w2, group_sizes, row_weights = ctx.saved_tensors
    need_dx, _, _, need_dw13, need_dw2, need_drw, _ = ctx.needs_input_grad
    need_drw = need_drw and row_weights is not None
    dx, dw13, dw2, drw = torch.ops.moe_kernels.expert_mlp_bwd(dout.contiguous(), x, row_token, row_map, h, w13, w2,
                                                              group_sizes, row_weights, need_dx, need_dw13, need_dw2,
                                                              need_drw)
    return (dx if need_dx else None, None, None, dw13 if need_dw13 else None, dw2 if need_dw2 else None,
            drw.to(ctx.rw_dtype) if need_drw else None, None)


_expert_mlp.register_autograd(_backward, setup_context=_setup)


def expert_mlp(x: Tensor, row_map: Tensor, group_sizes: Tensor, w13: Tensor, w2: Tensor,
               row_weights: Tensor | None = None, *, num_rows: int) -> Tensor:
    """out [T, H]: each token's sum over its routed experts of the SwiGLU MLP (module docstring), read from x.

    Args:
        x: [T, H] tokens (bf16, fp16, fp32; fp64 on the CPU).
        row_map, group_sizes: permute's routing ([T, k] and [E] int32); `num_rows` is its row count R
            (`permuted_rows(T, k, E, align)`). `permute(x[:, :0], indices, E, align=...)` gives them
            without copying any token.
        w13: [E, 2F, H] (gate rows, then up rows); w2: [E, H, F]; x's dtype.
        row_weights: [R] routing weight per permuted row (`permuted_row_values(weights, row_map, R)`), applied in
            the activation; None: unweighted.
    """
    return torch.ops.moe_kernels.expert_mlp(x, row_map, group_sizes, w13, w2, row_weights, num_rows)[0]
