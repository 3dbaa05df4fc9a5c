"""Token permute / unpermute (specs/ops.md, "Permute / unpermute").

Shapes: T tokens, H hidden, E experts, k slots per token, R permuted rows (worst case, see
`permuted_rows`). Each op has a schema in the `moe_kernels` namespace, a CPU reference in plain
PyTorch (also the fallback on any device without kernels), a CUDA implementation calling `_C`, a fake
implementation and autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels import onnx as _onnx
from moe_kernels.ops._checks import CUDA_FLOAT_DTYPES, FLOAT_DTYPES, check_cuda_dtype, check_int, check_shape, check_tensor
from moe_kernels.ops.quant import BLOCK, fp8_layouts_empty, fp8_layouts_reference, quantize_fp8_reference

INDEX_DTYPES = (torch.int32,)
# Permute moves bytes, so low-precision payloads (fp8, packed fp4 as uint8) travel through it too.
PERMUTE_CUDA_DTYPES = (*CUDA_FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
_INT32_MAX = 2**31 - 1
MAX_ALIGN = 2**16  # GEMM tiles need at most 256; a bound keeps padding work per expert small


def permuted_rows(num_tokens: int, k: int, num_experts: int, align: int) -> int:
    """Rows of permute's output: T*k, plus room for each non-empty expert's padding to `align`.

    At most min(E, T*k) experts are non-empty and each adds at most align-1 rows, so this bound is
    known without looking at the routing (no host sync).
    """
    slots = num_tokens * k
    if align == 1:
        return slots
    return slots + torch.sym_min(num_experts, slots) * (align - 1)


# ---------------------------------------------------------------------------------------------------
# Validation (shared by every implementation)


def _check_permute(x: Tensor, indices: Tensor, num_experts: int, align: int) -> None:
    op = "permute"
    check_tensor(op, "x", x, ndim=2)
    check_tensor(op, "indices", indices, ndim=2, dtypes=INDEX_DTYPES, device=x.device)
    check_int(op, "num_experts", num_experts, minimum=1, maximum=_INT32_MAX)
    check_int(op, "align", align, minimum=1, maximum=MAX_ALIGN)
    if indices.shape[0] != x.shape[0]:
        raise ValueError(
            f"{op}: `indices` has {indices.shape[0]} rows but `x` has {x.shape[0]} tokens; expected [T, k]"
        )
    rows = permuted_rows(x.shape[0], indices.shape[1], num_experts, align)
    if rows > _INT32_MAX:
        raise ValueError(f"{op}: {rows} permuted rows do not fit the int32 `row_map`; split the batch")


def _check_permute_quantize(x: Tensor, indices: Tensor, num_experts: int, align: int) -> None:
    op = "permute_quantize_fp8"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.dtype == torch.float64:
        raise ValueError(f"{op}: `x` must be float32, float16 or bfloat16, got torch.float64")
    _check_permute(x, indices, num_experts, align)


def _check_unpermute(y: Tensor, row_map: Tensor, weights: Tensor | None) -> None:
    op = "unpermute"
    check_tensor(op, "y", y, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "row_map", row_map, ndim=2, dtypes=INDEX_DTYPES, device=y.device)
    if weights is not None:
        check_tensor(op, "weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=y.device)
        check_shape(op, "weights", weights, row_map.shape, "same as row_map: [T, k]")


def _check_unpermute_bwd(dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int,
                         op: str = "unpermute backward") -> None:
    check_tensor(op, "grad_output", dout, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "row_map", row_map, ndim=2, dtypes=INDEX_DTYPES, device=dout.device)
    check_shape(op, "grad_output", dout, (row_map.shape[0], dout.shape[1]), "[T, H] with T from row_map")
    check_int(op, "num_rows", num_rows, minimum=0, maximum=_INT32_MAX)
    if weights is not None:
        check_tensor(op, "weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=dout.device)
        check_shape(op, "weights", weights, row_map.shape, "same as row_map: [T, k]")
    if y is not None:
        if weights is None:
            raise ValueError(f"{op}: `y` is only needed (for dweights) when `weights` is given")
        check_tensor(op, "y", y, ndim=2, dtypes=(dout.dtype,), device=dout.device)
        check_shape(op, "y", y, (num_rows, dout.shape[1]), "[R, H]")


def _check_indices_values(indices: Tensor, num_experts: int, op: str) -> None:
    """Raises ValueError for indices outside [-1, E). Syncs when `indices` is on a GPU."""
    bad = (indices < -1) | (indices >= num_experts)
    if bool(bad.any()):
        first = indices[bad][0].item()
        raise ValueError(f"{op}: `indices` holds {first}, outside [-1, {num_experts}) (num_experts={num_experts})")


def _check_row_map_values(row_map: Tensor, num_rows: int, op: str) -> None:
    """Raises ValueError for rows outside [-1, R) or a row named twice. Syncs on a GPU."""
    bad = (row_map < -1) | (row_map >= num_rows)
    if bool(bad.any()):
        first = row_map[bad][0].item()
        raise ValueError(f"{op}: `row_map` holds {first}, outside [-1, {num_rows}) (rows of y)")
    rows = row_map[row_map >= 0].long()
    if rows.numel() and int(torch.bincount(rows, minlength=num_rows).max()) > 1:
        raise ValueError(f"{op}: `row_map` names a row twice; it must come from permute")


# ---------------------------------------------------------------------------------------------------
# References: plain PyTorch, the definition of each op


def permute_reference(x: Tensor, indices: Tensor, num_experts: int, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Every shape follows from the input shapes (no data-dependent sizes), so this also traces for export
    (moe_kernels.onnx)."""
    T, k = indices.shape
    E, S = num_experts, T * k
    device = x.device
    slot = torch.arange(S, device=device)  # slot s = t*k + j
    flat = indices.reshape(-1).long()
    expert = torch.where(flat >= 0, flat, E)  # dropped slots: a last, uncounted expert E
    counts = torch.zeros(E + 1, dtype=torch.long, device=device).scatter_add(0, expert, torch.ones_like(expert))[:E]
    padded = (counts + align - 1) // align * align  # [E]
    starts = torch.cumsum(padded, 0) - padded  # first row of each expert
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    order = torch.sort(expert * S + slot).indices  # distinct keys: (expert, token, slot) order, dropped last
    sorted_expert = expert[order]
    e = sorted_expert.clamp(max=E - 1)
    sorted_rows = torch.where(sorted_expert < E, starts[e] + slot - first[e], -1)
    row_map = torch.empty_like(sorted_rows).scatter(0, order, sorted_rows)  # [S]
    R = permuted_rows(T, k, E, align)
    # Source token of each row; T (a zero row appended to x) for padding. A dropped slot s writes past the R
    # rows kept, at R + s, so no two slots write the same place.
    target = torch.where(row_map >= 0, row_map, R + slot)
    source = torch.full((R + S,), T, dtype=torch.long, device=device).scatter(0, target, slot // k)
    x_perm = torch.cat([x, x.new_zeros((1, x.shape[1]))])[source[:R]]
    return x_perm, row_map.view(T, k).to(torch.int32), padded.to(torch.int32)


def permute_quantize_fp8_reference(
    x: Tensor, indices: Tensor, num_experts: int, align: int = 128, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """quantize_fp8(permute(x), "block") with scale 0 on every row no slot maps to (padding: a block of
    zeros); the fifth output is permute's x_perm."""
    x_perm, row_map, group_sizes = permute_reference(x, indices, num_experts, align)
    q, scale = quantize_fp8_reference(x_perm, "block", torch.float8_e4m3fn, pow2_scale)
    mapped = torch.zeros(x_perm.shape[0], dtype=torch.bool, device=x.device)
    mapped[row_map[row_map >= 0].long()] = True
    return q, torch.where(mapped[:, None], scale, 0.0), row_map, group_sizes, x_perm


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def unpermute_reference(y: Tensor, row_map: Tensor, weights: Tensor | None = None) -> Tensor:
    T, k = row_map.shape
    acc = _acc_dtype(y.dtype)
    out = torch.zeros((T, y.shape[1]), dtype=acc, device=y.device)  # [T, H]
    for j in range(k):  # ascending j, one rounding per multiply and per add: the kernels do the same
        rows = row_map[:, j].long()  # [T]
        valid = (rows >= 0)[:, None]
        contrib = y[rows.clamp(min=0)].to(acc)  # [T, H]
        if weights is not None:
            contrib = weights[:, j, None].to(acc) * contrib
        out = out + torch.where(valid, contrib, 0.0)
    return out.to(y.dtype)


def unpermute_bwd_reference(
    dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int
) -> tuple[Tensor, Tensor]:
    T, k = row_map.shape
    acc = _acc_dtype(dout.dtype)
    flat = row_map.reshape(-1).long()
    valid = flat >= 0
    slots = torch.nonzero(valid).squeeze(1)  # [n] slot ids s = t*k + j
    rows, tokens = flat[slots], slots // k
    grad = dout[tokens].to(acc)  # [n, H]
    if weights is not None:
        grad = weights.reshape(-1)[slots, None].to(acc) * grad
    dy = dout.new_zeros((num_rows, dout.shape[1]))
    dy[rows] = grad.to(dout.dtype)
    if y is None:
        return dy, dout.new_empty((0,), dtype=torch.float32)
    dots = (y[rows].to(acc) * dout[tokens].to(acc)).sum(-1)  # [n]
    dweights = torch.zeros(T * k, dtype=acc, device=dout.device)
    dweights[slots] = dots
    return dy, dweights.view(T, k).to(weights.dtype if weights.dtype == torch.float64 else torch.float32)


def tokens_per_expert_reference(indices: Tensor, num_experts: int) -> Tensor:
    flat = indices.reshape(-1).long()
    expert = torch.where(flat >= 0, flat, num_experts)  # dropped: a last, uncounted bin (static shapes, for export)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=indices.device)
    return counts.scatter_add(0, expert, torch.ones_like(expert))[:num_experts].to(torch.int32)


# ---------------------------------------------------------------------------------------------------
# Registered ops. The decorated body is the CPU (and fallback) implementation.


@torch.library.custom_op("moe_kernels::permute", mutates_args=())
def _permute(x: Tensor, indices: Tensor, num_experts: int, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    _check_permute(x, indices, num_experts, align)
    _check_indices_values(indices, num_experts, "permute")
    return permute_reference(x, indices, num_experts, align)


@torch.library.custom_op("moe_kernels::permute_quantize_fp8", mutates_args=())
def _permute_quantize_fp8(
    x: Tensor, indices: Tensor, num_experts: int, align: int, pow2_scale: bool, keep_rows: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_permute_quantize(x, indices, num_experts, align)
    _check_indices_values(indices, num_experts, "permute_quantize_fp8")
    q, scale, row_map, group_sizes, x_perm = permute_quantize_fp8_reference(x, indices, num_experts, align, pow2_scale)
    return q, scale, row_map, group_sizes, x_perm if keep_rows else x.new_empty((0, x.shape[1]))


@torch.library.custom_op("moe_kernels::unpermute", mutates_args=())
def _unpermute(y: Tensor, row_map: Tensor, weights: Tensor | None = None) -> Tensor:
    _check_unpermute(y, row_map, weights)
    _check_row_map_values(row_map, y.shape[0], "unpermute")
    return unpermute_reference(y, row_map, weights)


@torch.library.custom_op("moe_kernels::unpermute_bwd", mutates_args=())
def _unpermute_bwd(
    dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int
) -> tuple[Tensor, Tensor]:
    """dy [R, H] (zero on unmapped rows) and, when `y` is given, dweights [T, k] fp32 (else empty)."""
    _check_unpermute_bwd(dout, row_map, weights, y, num_rows)
    _check_row_map_values(row_map, num_rows, "unpermute backward")
    return unpermute_bwd_reference(dout, row_map, weights, y, num_rows)


@torch.library.custom_op("moe_kernels::tokens_per_expert", mutates_args=())
def _tokens_per_expert(indices: Tensor, num_experts: int) -> Tensor:
    check_tensor("tokens_per_expert", "indices", indices, ndim=2, dtypes=INDEX_DTYPES)
    check_int("tokens_per_expert", "num_experts", num_experts, minimum=1, maximum=_INT32_MAX)
    _check_indices_values(indices, num_experts, "tokens_per_expert")
    return tokens_per_expert_reference(indices, num_experts)


# ---------------------------------------------------------------------------------------------------
# CUDA implementations


def _check_cuda_experts(op: str, num_experts: int, C) -> None:
    if num_experts > C.permute_max_experts:
        raise ValueError(f"{op}: the CUDA kernel takes `num_experts` <= {C.permute_max_experts}, got {num_experts}")


@_ext.cuda_impl(_permute)
def _permute_cuda(x: Tensor, indices: Tensor, num_experts: int, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    _check_permute(x, indices, num_experts, align)
    check_cuda_dtype("permute", "x", x, PERMUTE_CUDA_DTYPES)
    C = _ext.kernels("permute", x)
    if C is None or _ext.checks_enabled():
        _check_indices_values(indices, num_experts, "permute")
    if C is None:
        return permute_reference(x, indices, num_experts, align)
    _check_cuda_experts("permute", num_experts, C)
    T, H = x.shape
    k = indices.shape[1]
    x_perm = x.new_empty((permuted_rows(T, k, num_experts, align), H))
    row_map = torch.empty((T, k), dtype=torch.int32, device=x.device)
    group_sizes = torch.empty((num_experts,), dtype=torch.int32, device=x.device)
    workspace = torch.empty(C.permute_workspace_bytes(T * k, num_experts), dtype=torch.uint8, device=x.device)
    C.permute_fwd(
        x=_ext.ptr(x), indices=_ext.ptr(indices), x_perm=_ext.ptr(x_perm), row_map=_ext.ptr(row_map),
        group_sizes=group_sizes.data_ptr(), workspace=_ext.ptr(workspace), num_tokens=T, k=k,
        row_bytes=H * x.element_size(), num_experts=num_experts, align=align, **_ext.launch_args(x),
    )
    return x_perm, row_map, group_sizes


@_ext.cuda_impl(_permute_quantize_fp8)
def _permute_quantize_fp8_cuda(
    x: Tensor, indices: Tensor, num_experts: int, align: int, pow2_scale: bool, keep_rows: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    op = "permute_quantize_fp8"
    _check_permute_quantize(x, indices, num_experts, align)
    C = _ext.kernels(op, x)
    if C is None or _ext.checks_enabled():
        _check_indices_values(indices, num_experts, op)
    if C is None:
        q, scale, row_map, group_sizes, x_perm = permute_quantize_fp8_reference(x, indices, num_experts, align, pow2_scale)
        return q, scale, row_map, group_sizes, x_perm if keep_rows else x.new_empty((0, x.shape[1]))
    _check_cuda_experts(op, num_experts, C)
    T, H = x.shape
    k = indices.shape[1]
    R = permuted_rows(T, k, num_experts, align)
    q = torch.empty((R, H), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((R, -(-H // BLOCK)), dtype=torch.float32, device=x.device)
    x_perm = x.new_empty((R, H) if keep_rows else (0, H))
    row_map = torch.empty((T, k), dtype=torch.int32, device=x.device)
    group_sizes = torch.empty((num_experts,), dtype=torch.int32, device=x.device)
    workspace = torch.empty(C.permute_workspace_bytes(T * k, num_experts), dtype=torch.uint8, device=x.device)
    C.permute_quantize_fp8(
        x=_ext.ptr(x), indices=_ext.ptr(indices), x_perm=_ext.ptr(x_perm) if keep_rows else 0, codes=_ext.ptr(q),
        scales=_ext.ptr(scale), row_map=_ext.ptr(row_map), group_sizes=group_sizes.data_ptr(),
        workspace=_ext.ptr(workspace), num_tokens=T, k=k, hidden=H, dtype=_ext.dtype_code(x.dtype),
        num_experts=num_experts, align=align, pow2=pow2_scale, **_ext.launch_args(x),
    )
    return q, scale, row_map, group_sizes, x_perm


@_ext.cuda_impl(_unpermute)
def _unpermute_cuda(y: Tensor, row_map: Tensor, weights: Tensor | None = None) -> Tensor:
    _check_unpermute(y, row_map, weights)
    check_cuda_dtype("unpermute", "y", y)
    C = _ext.kernels("unpermute", y)
    if C is None or _ext.checks_enabled():
        _check_row_map_values(row_map, y.shape[0], "unpermute")
    if C is None:
        return unpermute_reference(y, row_map, weights)
    T, k = row_map.shape
    out = y.new_empty((T, y.shape[1]))
    w = None if weights is None else weights.float().contiguous()
    C.unpermute_fwd(
        y=_ext.ptr(y), row_map=_ext.ptr(row_map), weights=_ext.ptr(w), out=_ext.ptr(out), num_tokens=T, k=k,
        hidden=y.shape[1], num_rows=y.shape[0], dtype=_ext.dtype_code(y.dtype), **_ext.launch_args(y),
    )
    return out


@_ext.cuda_impl(_unpermute_bwd)
def _unpermute_bwd_cuda(
    dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int
) -> tuple[Tensor, Tensor]:
    _check_unpermute_bwd(dout, row_map, weights, y, num_rows)
    check_cuda_dtype("unpermute backward", "grad_output", dout)
    C = _ext.kernels("unpermute", dout)
    if C is None or _ext.checks_enabled():
        _check_row_map_values(row_map, num_rows, "unpermute backward")
    if C is None:
        return unpermute_bwd_reference(dout, row_map, weights, y, num_rows)
    T, k = row_map.shape
    dy = dout.new_empty((num_rows, dout.shape[1]))
    dweights = torch.empty((T, k) if y is not None else (0,), dtype=torch.float32, device=dout.device)
    row_mask = torch.zeros((num_rows,), dtype=torch.uint8, device=dout.device)
    w = None if weights is None else weights.float().contiguous()
    C.unpermute_bwd(
        dout=_ext.ptr(dout), y=_ext.ptr(y), row_map=_ext.ptr(row_map), weights=_ext.ptr(w), dy=_ext.ptr(dy),
        dweights=_ext.ptr(dweights) if y is not None else 0, row_mask=_ext.ptr(row_mask), num_tokens=T, k=k,
        hidden=dout.shape[1], num_rows=num_rows, dtype=_ext.dtype_code(dout.dtype), **_ext.launch_args(dout),
    )
    return dy, dweights


@_ext.cuda_impl(_tokens_per_expert)
def _tokens_per_expert_cuda(indices: Tensor, num_experts: int) -> Tensor:
    check_tensor("tokens_per_expert", "indices", indices, ndim=2, dtypes=INDEX_DTYPES)
    check_int("tokens_per_expert", "num_experts", num_experts, minimum=1, maximum=_INT32_MAX)
    C = _ext.kernels("tokens_per_expert", indices)
    if C is None or _ext.checks_enabled():
        _check_indices_values(indices, num_experts, "tokens_per_expert")
    if C is None:
        return tokens_per_expert_reference(indices, num_experts)
    _check_cuda_experts("tokens_per_expert", num_experts, C)
    counts = torch.empty((num_experts,), dtype=torch.int32, device=indices.device)
    C.tokens_per_expert(
        indices=_ext.ptr(indices), num_slots=indices.numel(), num_experts=num_experts, counts=counts.data_ptr(),
        **_ext.launch_args(indices),
    )
    return counts


# ---------------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes only, for torch.compile and FakeTensor tracing


@_permute.register_fake
def _(x, indices, num_experts, align=1):
    _check_permute(x, indices, num_experts, align)
    T, H = x.shape
    k = indices.shape[1]
    return (
        x.new_empty((permuted_rows(T, k, num_experts, align), H)),
        indices.new_empty((T, k), dtype=torch.int32),
        indices.new_empty((num_experts,), dtype=torch.int32),
    )


@_permute_quantize_fp8.register_fake
def _(x, indices, num_experts, align, pow2_scale, keep_rows):
    _check_permute_quantize(x, indices, num_experts, align)
    T, H = x.shape
    k = indices.shape[1]
    R = permuted_rows(T, k, num_experts, align)
    return (
        x.new_empty((R, H), dtype=torch.float8_e4m3fn),
        x.new_empty((R, -(-H // BLOCK)), dtype=torch.float32),
        indices.new_empty((T, k), dtype=torch.int32),
        indices.new_empty((num_experts,), dtype=torch.int32),
        x.new_empty((R, H) if keep_rows else (0, H)),
    )


@_unpermute.register_fake
def _(y, row_map, weights=None):
    _check_unpermute(y, row_map, weights)
    return y.new_empty((row_map.shape[0], y.shape[1]))


@_unpermute_bwd.register_fake
def _(dout, row_map, weights, y, num_rows):
    dweights_shape = tuple(row_map.shape) if y is not None else (0,)
    dweights_dtype = torch.float64 if dout.dtype == torch.float64 else torch.float32
    return dout.new_empty((num_rows, dout.shape[1])), dout.new_empty(dweights_shape, dtype=dweights_dtype)


@_tokens_per_expert.register_fake
def _(indices, num_experts):
    return indices.new_empty((num_experts,), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------------
# Autograd


def _permute_setup_context(ctx, inputs, output):
    _, row_map, _ = output
    ctx.save_for_backward(row_map)
    ctx.mark_non_differentiable(row_map, output[2])


def _permute_backward(ctx, grad_x_perm, _grad_row_map, _grad_group_sizes):
    (row_map,) = ctx.saved_tensors
    # dx[t] = sum_j dx_perm[row_map[t, j]]: an unweighted unpermute (fp32 accumulation).
    return unpermute(grad_x_perm.contiguous(), row_map, None), None, None, None


_permute.register_autograd(_permute_backward, setup_context=_permute_setup_context)


def _unpermute_setup_context(ctx, inputs, output):
    y, row_map, weights = inputs
    need_dweights = weights is not None and ctx.needs_input_grad[2]
    ctx.num_rows = y.shape[0]
    ctx.weights_dtype = None if weights is None else weights.dtype
    ctx.save_for_backward(row_map, weights, y if need_dweights else None)


def _unpermute_backward(ctx, grad_out):
    row_map, weights, y = ctx.saved_tensors
    dy, dweights = torch.ops.moe_kernels.unpermute_bwd(grad_out.contiguous(), row_map, weights, y, ctx.num_rows)
    return dy, None, (dweights.to(ctx.weights_dtype) if y is not None else None)


_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


# ---------------------------------------------------------------------------------------------------
# Public API


def _as_int32_indices(indices: Tensor) -> Tensor:
    # Hugging Face and torch.topk produce int64; the ops take int32 (half the traffic).
    if isinstance(indices, Tensor) and indices.dtype == torch.int64:
        return indices.to(torch.int32)
    return indices


def permute(x: Tensor, indices: Tensor, num_experts: int, *, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Group token copies by expert.

    Args:
        x: [T, H] tokens.
        indices: [T, k] chosen experts (int32; int64 is converted), -1 for a dropped slot.
        num_experts: E.
        align: pad each expert's row count up to a multiple of this (zero rows), e.g. 16 or 128 for FP8.

    Returns:
        x_perm [R, H] with expert e's rows at [start_e, start_e + group_sizes[e]) in (token, slot)
        order then zero padding (rows past sum(group_sizes) are unspecified); row_map [T, k] int32, the
        row of each copy (-1 for dropped slots); group_sizes [E] int32, padded counts.
    """
    if _onnx.exporting():
        return _onnx.permute_traceable(x, _as_int32_indices(indices), num_experts, align)
    return _ext.direct(_permute, x, x, _as_int32_indices(indices), num_experts, align)


def permute_quantize_fp8(
    x: Tensor, indices: Tensor, num_experts: int, *, align: int = 128, pow2_scale: bool = False, keep_rows: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """permute fused with FP8 quantization: each token is read once and its E4M3 codes and 1x128-block
    scales are written straight into its permuted rows.

    Returns (x_q [R, H] float8_e4m3fn, x_scale [R, ceil(H / 128)] fp32, row_map, group_sizes, x_perm):
    on the groups' rows x_q and x_scale equal quantize_fp8(permute(x, ...)[0], "block") bit for bit;
    padding rows hold zero codes with scale 0 (a block of zeros for grouped_mm_fp8); rows past the
    groups are unspecified. row_map and group_sizes are permute's. With `keep_rows`, x_perm is permute's
    output too, written from the same read (else None). x: float32, float16 or bfloat16. No autograd:
    the FP8 recipe (moe_kernels.quant) wraps it.
    """
    q, scale, row_map, group_sizes, x_perm = _ext.direct(
        _permute_quantize_fp8, x, x, _as_int32_indices(indices), num_experts, align, pow2_scale, keep_rows
    )
    return q, scale, row_map, group_sizes, x_perm if keep_rows else None


def unpermute(y: Tensor, row_map: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = sum_j weights[t, j] * y[row_map[t, j]] over j with row_map >= 0, fp32 accumulation in
    ascending j (deterministic). Plain sum when `weights` is None. Output dtype is y's."""
    if _onnx.exporting():
        return _onnx.unpermute_traceable(y, row_map, weights)
    return _ext.direct(_unpermute, y, y, row_map, weights)


def permuted_row_values(values: Tensor, row_map: Tensor, num_rows: int, fill: float = 0) -> Tensor:
    """[num_rows] value of each permuted row (e.g. its routing weight) from per-slot `values` [T, k] and
    permute's `row_map` [T, k]; `fill` for padding rows. No host sync: dropped slots, and entries outside
    [0, num_rows) (taken as dropped, as the kernels take them), land on an extra last row that is cut off.
    Differentiable in `values`."""
    valid = (row_map >= 0) & (row_map < num_rows)
    target = torch.where(valid, row_map, num_rows).flatten().long()
    out = values.new_full((num_rows + 1,), fill)
    return out.scatter(0, target, torch.where(valid, values, fill).flatten())[:num_rows]


def tokens_per_expert(indices: Tensor, num_experts: int) -> Tensor:
    """[E] int32 counts of (token, slot) pairs per expert; -1 entries are ignored. No host sync on GPU."""
    if _onnx.exporting():
        return _onnx.tokens_per_expert_traceable(_as_int32_indices(indices), num_experts)
    indices = _as_int32_indices(indices)
    L = _ext.eager(indices)
    if L is not None and indices.dtype == torch.int32 and type(num_experts) is int and 1 <= num_experts <= L.C.permute_max_experts:
        check_tensor("tokens_per_expert", "indices", indices, ndim=2, dtypes=INDEX_DTYPES)
        counts = torch.empty((num_experts,), dtype=torch.int32, device=indices.device)
        L.C.tokens_per_expert(_ext.ptr(indices), indices.numel(), num_experts, counts.data_ptr(), L.device, L.stream)
        return counts
    return torch.ops.moe_kernels.tokens_per_expert(indices, num_experts)


# ---------------------------------------------------------------------------------------------------
# Unpermute backward writing FP8 (the FP8 recipe's down-projection output gradient)


def _check_unpermute_bwd_fp8(dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None,
                             num_rows: int) -> None:
    op = "unpermute_bwd_quantize_fp8"
    check_tensor(op, "grad_output", dout, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    _check_unpermute_bwd(dout, row_map, weights, y, num_rows, op)
    if dout.shape[1] % 8:
        raise ValueError(f"{op}: `grad_output` is [T, H] with H = {dout.shape[1]}, which must be a multiple of 8 "
                         "(16-byte rows)")


def unpermute_bwd_quantize_fp8_reference(
    dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dy, dweights = unpermute_bwd_reference(dout, row_map, weights, y, num_rows)
    return (*fp8_layouts_reference(dy, pow2_scale), dweights)


@torch.library.custom_op("moe_kernels::unpermute_bwd_quantize_fp8", mutates_args=())
def _unpermute_bwd_quantize_fp8(
    dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int, pow2_scale: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_unpermute_bwd_fp8(dout, row_map, weights, y, num_rows)
    _check_row_map_values(row_map, num_rows, "unpermute_bwd_quantize_fp8")
    return unpermute_bwd_quantize_fp8_reference(dout, row_map, weights, y, num_rows, pow2_scale)


@_unpermute_bwd_quantize_fp8.register_fake
def _(dout, row_map, weights, y, num_rows, pow2_scale):
    _check_unpermute_bwd_fp8(dout, row_map, weights, y, num_rows)
    return (*fp8_layouts_empty(dout, num_rows, dout.shape[1]),
            dout.new_empty(row_map.shape if y is not None else (0,), dtype=torch.float32))


def slot_of_row(row_map: Tensor, num_rows: int) -> Tensor:
    """[num_rows] int32: the slot t * k + j that row_map sends to each row, -1 for rows no slot maps to (the
    inverse of row_map)."""
    slots = torch.arange(row_map.numel(), dtype=torch.int32, device=row_map.device).view(row_map.shape)
    return permuted_row_values(slots, row_map, num_rows, fill=-1)


@_ext.cuda_impl(_unpermute_bwd_quantize_fp8)
def _unpermute_bwd_quantize_fp8_cuda(dout, row_map, weights, y, num_rows, pow2_scale):
    _check_unpermute_bwd_fp8(dout, row_map, weights, y, num_rows)
    C = _ext.kernels("unpermute_bwd_quantize_fp8", dout)
    if C is None or _ext.checks_enabled():
        _check_row_map_values(row_map, num_rows, "unpermute_bwd_quantize_fp8")
    if C is None:
        return unpermute_bwd_quantize_fp8_reference(dout, row_map, weights, y, num_rows, pow2_scale)
    if dout.dtype == torch.float32:  # a 128 x 128 fp32 tile does not fit the kernel's shared memory: the composition
        dy, dweights = torch.ops.moe_kernels.unpermute_bwd(dout, row_map, weights, y, num_rows)
        return (*torch.ops.moe_kernels.quantize_fp8_dual(dy, pow2_scale), dweights)
    T, k = row_map.shape
    H = dout.shape[1]
    dweights = torch.empty((T, k) if y is not None else (0,), dtype=torch.float32, device=dout.device)
    w = None if weights is None else weights.float().contiguous()
    inv = slot_of_row(row_map, num_rows)  # held until the launch is queued
    launch = _ext.launch_args(dout)
    q, scale, q_t, scale_t = unpermute_bwd_fp8_on(C, tuple(launch.values()), dout, inv, w, k, pow2_scale)
    if y is not None:  # unpermute_bwd's own reduction (bit for bit the composition's), dy not written; its vector
        # width (so its dweights reduction order) follows dout's pointer as given
        C.unpermute_bwd(dout=_ext.ptr(dout), y=_ext.ptr(y), row_map=_ext.ptr(row_map), weights=_ext.ptr(w), dy=0,
                        dweights=_ext.ptr(dweights), row_mask=0, num_tokens=T, k=k, hidden=H,
                        num_rows=num_rows, dtype=_ext.dtype_code(dout.dtype), **launch)
    return q, scale, q_t, scale_t, dweights


def unpermute_bwd_fp8_on(C, launch: tuple[int, int], dout: Tensor, slot: Tensor, w: Tensor | None, k: int,
                         pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """unpermute_bwd_quantize_fp8's kernel on checked 16-bit dout [T, H]: the rows of `slot` [R] (slot_of_row: each
    row's slot t * k + j, -1 for none) gathered, times w [T, k] fp32 (or None), into both E4M3 layouts, on extension
    C at `launch` (device, stream), for the op's implementation (the fused FP8 region launches the same kernel from
    python_api/regions_fp8.cpp, and gathers the tokens into the first GEMM's input with it too)."""
    dout = dout if dout.data_ptr() % 16 == 0 else dout.clone()  # 16-byte loads of dout rows
    (T, H), R = dout.shape, slot.shape[0]
    q, scale, q_t, scale_t = out = fp8_layouts_empty(dout, R, H)
    C.unpermute_bwd_fp8(_ext.ptr(dout), _ext.ptr(slot), _ext.ptr(w), _ext.ptr(q), _ext.ptr(scale), _ext.ptr(q_t),
                        _ext.ptr(scale_t), T, k, H, R, pow2_scale, _ext.dtype_code(dout.dtype), *launch)
    return out


def unpermute_bwd_quantize_fp8(
    dout: Tensor, row_map: Tensor, weights: Tensor | None, y: Tensor | None, num_rows: int, *, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """unpermute's backward with dy [R, H] (H % 8 == 0) written in E4M3 only: (dy_q [R, Hp], dy_scale [R, Hp / 128],
    dy_t_q [H, Rp], dy_t_scale [H, Rp / 128], dweights [T, k] fp32, or [0] without `y`): the down projection's
    dgrad operand (1x128 blocks along H, zero-padded to Hp = ceil(H / 128) * 128 with zero codes) and its wgrad
    operand (1x128 blocks along the rows, Rp = R rounded up to 128, padding codes 0), bit for bit
    quantize_fp8(dy, "block", pad_to_block=True) and quantize_fp8_tokens(dy) for dy, dweights =
    unpermute_bwd(dout, row_map, weights, y, R) (rows no slot maps to: zeros). No autograd (the FP8 recipe's
    function calls it)."""
    _check_unpermute_bwd_fp8(dout, row_map, weights, y, num_rows)
    return _ext.direct(_unpermute_bwd_quantize_fp8, dout, dout, row_map, weights, y, num_rows, bool(pow2_scale))
