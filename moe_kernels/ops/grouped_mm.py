"""Grouped GEMM (specs/ops.md, "Grouped GEMM").

Shapes: M rows (all groups, padded permute output), K in-features, N out-features, E groups (experts).
Group e is rows [off_e, off_e + group_sizes[e]) of x, off = exclusive prefix sum; out rows of group e
= x rows @ w[e]^T (w stored like nn.Linear weights, [N, K] per expert). fp32 accumulation, output in
the input dtype. Rows at or past sum(group_sizes) are unspecified in `out` and zero in dx.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels import onnx as _onnx
from moe_kernels.ops._checks import CUDA_FLOAT_DTYPES, FLOAT_DTYPES, check_cuda_dtype, check_shape, check_tensor

_OPS = {"fwd": 0, "dgrad": 1, "wgrad": 2}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_group_sizes(op: str, group_sizes: Tensor, E: int, device: torch.device) -> None:
    check_tensor(op, "group_sizes", group_sizes, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape(op, "group_sizes", group_sizes, (E,), "one size per expert, E from w")


def _check_fwd(x: Tensor, w: Tensor, group_sizes: Tensor) -> None:
    op = "grouped_mm"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "w", w, ndim=3, dtypes=(x.dtype,), device=x.device)
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: `w` has K={w.shape[2]} in-features but `x` has K={x.shape[1]}; w is [E, N, K]")
    _check_group_sizes(op, group_sizes, w.shape[0], x.device)


def _check_dgrad(dout: Tensor, w: Tensor, group_sizes: Tensor) -> None:
    op = "grouped_mm_dgrad"
    check_tensor(op, "grad_output", dout, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "w", w, ndim=3, dtypes=(dout.dtype,), device=dout.device)
    if w.shape[1] != dout.shape[1]:
        raise ValueError(f"{op}: `w` has N={w.shape[1]} but `grad_output` has N={dout.shape[1]}")
    _check_group_sizes(op, group_sizes, w.shape[0], dout.device)


def _check_wgrad(dout: Tensor, x: Tensor, group_sizes: Tensor) -> None:
    op = "grouped_mm_wgrad"
    check_tensor(op, "grad_output", dout, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "x", x, ndim=2, dtypes=(dout.dtype,), device=dout.device)
    if x.shape[0] != dout.shape[0]:
        raise ValueError(f"{op}: `x` has {x.shape[0]} rows but `grad_output` has {dout.shape[0]}")
    check_tensor(op, "group_sizes", group_sizes, ndim=1, dtypes=(torch.int32,), device=dout.device)


def _check_sizes_values(group_sizes: Tensor, M: int, op: str) -> None:
    """Raises ValueError for negative sizes or a sum past M. Syncs on a GPU."""
    if group_sizes.numel() == 0:
        return
    if bool((group_sizes < 0).any()):
        raise ValueError(f"{op}: `group_sizes` holds a negative size")
    total = int(group_sizes.sum())
    if total > M:
        raise ValueError(f"{op}: `group_sizes` sums to {total} rows but there are only {M}")


def _row_ranges(group_sizes: Tensor) -> list[tuple[int, int]]:
    sizes = group_sizes.tolist()
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    return list(zip(starts, sizes))


# ---------------------------------------------------------------------------------------------------
# References: the per-expert loop


def grouped_mm_reference(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    acc = _acc(x.dtype)
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for e, (start, n) in enumerate(_row_ranges(group_sizes)):
        out[start : start + n] = (x[start : start + n].to(acc) @ w[e].to(acc).t()).to(x.dtype)
    return out


def grouped_mm_dgrad_reference(dout: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    acc = _acc(dout.dtype)
    dx = dout.new_zeros((dout.shape[0], w.shape[2]))
    for e, (start, n) in enumerate(_row_ranges(group_sizes)):
        dx[start : start + n] = (dout[start : start + n].to(acc) @ w[e].to(acc)).to(dout.dtype)
    return dx


def grouped_mm_wgrad_reference(dout: Tensor, x: Tensor, group_sizes: Tensor) -> Tensor:
    acc = _acc(dout.dtype)
    E = group_sizes.shape[0]
    dw = dout.new_zeros((E, dout.shape[1], x.shape[1]))
    for e, (start, n) in enumerate(_row_ranges(group_sizes)):
        dw[e] = (dout[start : start + n].to(acc).t() @ x[start : start + n].to(acc)).to(dout.dtype)
    return dw


# ---------------------------------------------------------------------------------------------------
# Registered ops (the bodies are the CPU implementations)


@torch.library.custom_op("moe_kernels::grouped_mm", mutates_args=())
def _grouped_mm(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    _check_fwd(x, w, group_sizes)
    _check_sizes_values(group_sizes, x.shape[0], "grouped_mm")
    return grouped_mm_reference(x, w, group_sizes)


@torch.library.custom_op("moe_kernels::grouped_mm_dgrad", mutates_args=())
def _grouped_mm_dgrad(dout: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    _check_dgrad(dout, w, group_sizes)
    _check_sizes_values(group_sizes, dout.shape[0], "grouped_mm_dgrad")
    return grouped_mm_dgrad_reference(dout, w, group_sizes)


@torch.library.custom_op("moe_kernels::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad(dout: Tensor, x: Tensor, group_sizes: Tensor) -> Tensor:
    _check_wgrad(dout, x, group_sizes)
    _check_sizes_values(group_sizes, dout.shape[0], "grouped_mm_wgrad")
    return grouped_mm_wgrad_reference(dout, x, group_sizes)


@_grouped_mm.register_fake
def _(x, w, group_sizes):
    _check_fwd(x, w, group_sizes)
    return x.new_empty((x.shape[0], w.shape[1]))


@_grouped_mm_dgrad.register_fake
def _(dout, w, group_sizes):
    _check_dgrad(dout, w, group_sizes)
    return dout.new_empty((dout.shape[0], w.shape[2]))


@_grouped_mm_wgrad.register_fake
def _(dout, x, group_sizes):
    _check_wgrad(dout, x, group_sizes)
    return dout.new_empty((group_sizes.shape[0], dout.shape[1], x.shape[1]))


def _setup(ctx, inputs, output):
    x, w, group_sizes = inputs
    ctx.save_for_backward(x, w, group_sizes)


def _backward(ctx, grad_out):
    x, w, group_sizes = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    dx = torch.ops.moe_kernels.grouped_mm_dgrad(grad_out, w, group_sizes) if ctx.needs_input_grad[0] else None
    dw = torch.ops.moe_kernels.grouped_mm_wgrad(grad_out, x, group_sizes) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------------
# CUDA: one launcher for the three products; it picks the sm_90a CUTLASS kernel or the portable one.


def _launch(op: str, a: Tensor, b: Tensor, out: Tensor, group_sizes: Tensor, M: int, N: int, K: int, C,
            group_align: int = 0) -> None:
    """group_align (wgrad): groups whose rows do not start and end on multiples of it come out NaN."""
    E = group_sizes.shape[0]
    # One pointer rule (0 for an empty tensor) for sizing and launching: the path, and so the workspace it
    # needs, follows the pointers' alignment.
    ptrs = dict(a=_ext.ptr(a), b=_ext.ptr(b), d=_ext.ptr(out))
    nbytes = C.grouped_mm_workspace_bytes(op=_OPS[op], dtype=_ext.dtype_code(a.dtype), num_groups=E, M=M, N=N, K=K,
                                          **ptrs, device=_ext.launch_args(a)["device"])
    ws, ws_ptr = _ext.workspace(nbytes, a)
    C.grouped_mm(
        op=_OPS[op], **ptrs, group_sizes=_ext.ptr(group_sizes), num_groups=E,
        M=M, N=N, K=K, dtype=_ext.dtype_code(a.dtype), workspace=ws_ptr, workspace_bytes=nbytes,
        group_align=group_align, **_ext.launch_args(a),
    )


def _cuda_common(op: str, t: Tensor, group_sizes: Tensor, M: int):
    check_cuda_dtype(op, "inputs", t, CUDA_FLOAT_DTYPES)
    C = _ext.kernels(op, t)
    if C is None or _ext.checks_enabled():
        _check_sizes_values(group_sizes, M, op)
    if C is not None and group_sizes.shape[0] > C.grouped_mm_max_groups:
        raise ValueError(f"{op}: the CUDA kernel takes at most {C.grouped_mm_max_groups} groups")
    return C


@_ext.cuda_impl(_grouped_mm)
def _grouped_mm_cuda(x, w, group_sizes):
    _check_fwd(x, w, group_sizes)
    M, K = x.shape
    E, N, _ = w.shape
    C = _cuda_common("grouped_mm", x, group_sizes, M)
    if C is None:
        return grouped_mm_reference(x, w, group_sizes)
    if E == 0 or K == 0:  # no groups, or an empty reduction: zeros (rows past the groups are unspecified)
        return x.new_zeros((M, N))
    out = x.new_empty((M, N))
    if M and N:
        _launch("fwd", x, w, out, group_sizes, M, N, K, C)
    return out


@_ext.cuda_impl(_grouped_mm_dgrad)
def _grouped_mm_dgrad_cuda(dout, w, group_sizes):
    _check_dgrad(dout, w, group_sizes)
    M, N = dout.shape
    K = w.shape[2]
    C = _cuda_common("grouped_mm_dgrad", dout, group_sizes, M)
    if C is None:
        return grouped_mm_dgrad_reference(dout, w, group_sizes)
    if w.shape[0] == 0 or N == 0:
        return dout.new_zeros((M, K))
    dx = dout.new_empty((M, K))
    if M and K:
        _launch("dgrad", dout, w, dx, group_sizes, M, N, K, C)
    return dx


@_ext.cuda_impl(_grouped_mm_wgrad)
def _grouped_mm_wgrad_cuda(dout, x, group_sizes):
    _check_wgrad(dout, x, group_sizes)
    M, N = dout.shape
    K = x.shape[1]
    E = group_sizes.shape[0]
    C = _cuda_common("grouped_mm_wgrad", dout, group_sizes, M)
    if C is None:
        return grouped_mm_wgrad_reference(dout, x, group_sizes)
    if M == 0:  # no rows: every group is empty
        return dout.new_zeros((E, N, K))
    dw = dout.new_empty((E, N, K))
    if E and N and K:
        _launch("wgrad", dout, x, dw, group_sizes, M, N, K, C)
    return dw


# ---------------------------------------------------------------------------------------------------
# Public API


def grouped_mm(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """out[M, N]: rows of group e = x[rows of e] @ w[e]^T, groups consecutive in x by `group_sizes`.

    Args:
        x: [M, K] (bf16, fp16, fp32; fp64 on the CPU).
        w: [E, N, K] expert weights, same dtype as x.
        group_sizes: [E] int32 on the device (permute's output); no host sync. Empty groups are fine.

    Under torch.autocast, x and w are cast to the autocast dtype first.
    """
    if _onnx.exporting():
        return _onnx.grouped_mm_traceable(autocast_input(x), autocast_input(w), group_sizes)
    return torch.ops.moe_kernels.grouped_mm(autocast_input(x), autocast_input(w), group_sizes)


def autocast_input(t: Tensor) -> Tensor:
    """Under torch.autocast, floating inputs take the autocast dtype, as nn.Linear's would (custom ops
    are not autocast by torch itself). Gradients flow back to the original dtype."""
    device_type = t.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type) and t.is_floating_point():
        dtype = torch.get_autocast_dtype(device_type)
        if t.dtype != dtype and t.dtype != torch.float64:
            return t.to(dtype)
    return t
