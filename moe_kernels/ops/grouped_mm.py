"""Grouped GEMM (specs/ops.md, "Grouped GEMM").

Shapes: M rows (all groups, padded permute output), K in-features, N out-features, E groups (experts).
Group e is rows [off_e, off_e + group_sizes[e]) of x, off = exclusive prefix sum; out rows of group e
= x rows @ w[e]^T (w stored like nn.Linear weights, [N, K] per expert). fp32 accumulation, output in
the input dtype. Rows at or past sum(group_sizes) are unspecified in `out` and zero in dx.
"""

from __future__ import annotations

import contextlib

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


def _without_autocast(t: Tensor):
    """The references multiply in their accumulation dtype even under torch.autocast (which would round the
    operands of `@` to its dtype): autocast off for t's device."""
    if t.device.type in ("cuda", "cpu"):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def grouped_mm_reference(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    acc = _acc(x.dtype)
    out = x.new_zeros((x.shape[0], w.shape[1]))
    with _without_autocast(x):
        for e, (start, n) in enumerate(_row_ranges(group_sizes)):
            out[start : start + n] = (x[start : start + n].to(acc) @ w[e].to(acc).t()).to(x.dtype)
    return out


def grouped_mm_dgrad_reference(dout: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    acc = _acc(dout.dtype)
    dx = dout.new_zeros((dout.shape[0], w.shape[2]))
    with _without_autocast(dout):
        for e, (start, n) in enumerate(_row_ranges(group_sizes)):
            dx[start : start + n] = (dout[start : start + n].to(acc) @ w[e].to(acc)).to(dout.dtype)
    return dx


def grouped_mm_wgrad_reference(dout: Tensor, x: Tensor, group_sizes: Tensor) -> Tensor:
    acc = _acc(dout.dtype)
    E = group_sizes.shape[0]
    dw = dout.new_zeros((E, dout.shape[1], x.shape[1]))
    with _without_autocast(dout):
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
# Which implementation runs on a GPU
#
# torch._grouped_mm (aten/src/ATen/native/cuda/GroupedBlas.cpp, `_grouped_mm_cuda`; GroupMM.cu,
# GroupMMCommon.cuh, GroupedMMUtils.h; https://github.com/pytorch/pytorch, main as of torch 2.13):
#   bool use_fast_path = _scaled_mm_allowed_device(/*sm90_only*/true, /*sm100_only*/true) && a_b_and_out_are_bf16;
# with `_scaled_mm_allowed_device(true, true)` = `dprops->major == 9 || dprops->major == 10`. The fast path is
# a CUTLASS ptr-array grouped GEMM (sm_90a, sm_100a; newer wheels add 103a) whose per-group problems are
# written on the device from `offs`: no host sync. Everywhere else (8.x, 12.x, fp16, fp32) it runs
# `_grouped_mm_fallback`, which reads `offs.cpu()` and loops over the groups with mm_out: a host sync per
# call, so it breaks our no-sync / CUDA-graph contract and we never call torch there. Its sm_100 instances
# are compiled arch-specific (sm_100a, sm_103a), so torch's fast path runs only where its wheel lists that
# exact architecture (torch.cuda.get_arch_list()). The fast path takes at most 1023 groups, 16-byte aligned
# base pointers and 16-byte strides (bf16: N and K multiples of 8), reads rows [offs[e-1], offs[e]) with no
# bound by M (so we clamp the offsets on the device), and leaves the output rows past offs[-1] unwritten.
#
# The choice per (GPU, dtype), from what the host knows (no sync), cached per device:
#   "cutlass_sm90"      our sm_90a CUTLASS kernels: a 9.x GPU, bf16 / fp16 / E4M3, the extension built with them;
#   "cutlass_sm100"     our sm_100f CUTLASS kernels: bf16 / E4M3 on a 10.x GPU, the extension built with them, and
#                       MOE_KERNELS_SM100_CUTLASS=1 (opt-in: they have not run on a Blackwell GPU yet);
#   "torch_grouped_mm"  torch's CUTLASS fast path: bf16 on 9.x (without our CUTLASS build) or 10.x;
#   "portable"          our portable kernel (tiled SIMT, fp32 FMA): every other GPU and dtype the extension runs on;
#   "reference"         the per-expert PyTorch loop: no extension for this GPU (it syncs; after one warning).
# A call whose shape torch's kernel does not take (alignment, group count, empty sizes) runs ours instead.

CUTLASS_SM90, TORCH_GROUPED_MM, PORTABLE, REFERENCE = "cutlass_sm90", "torch_grouped_mm", "portable", "reference"
CUTLASS_SM100 = "cutlass_sm100"
SM100_OPT_IN = "MOE_KERNELS_SM100_CUTLASS"  # =1: a 10.0 / 10.3 GPU runs our sm_100f kernels (read once, in C++)
# =1: the portable kernel runs bf16 and fp16 on tensor cores (csrc/gemm/portable_mma.cuh, sm_80+; read once, in C++)
PORTABLE_MMA_OPT_IN = "MOE_KERNELS_PORTABLE_MMA"
_TORCH_MAX_GROUPS = 1023  # GroupMM.cu: TORCH_CHECK(group_count < 1024)
_CUTLASS_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def torch_grouped_mm_fast(capability: tuple[int, int], dtype: torch.dtype, torch_archs) -> bool:
    """Whether torch._grouped_mm runs its CUTLASS kernel (no host sync) on a GPU of `capability` for `dtype`:
    bf16, a 9.x or 10.x GPU, and torch built for that exact architecture (`torch_archs`: its arch list)."""
    major, minor = capability
    return dtype == torch.bfloat16 and major in (9, 10) and f"sm_{major}{minor}" in torch_archs


def sm100_opted_in() -> bool:
    """Whether the extension runs its sm_100f instances on a 10.0 / 10.3 GPU: the C++ dispatch's own answer (it
    reads MOE_KERNELS_SM100_CUTLASS once), so the two layers never disagree."""
    C = _ext._C
    return bool(getattr(C, "grouped_mm_has_sm100", False)) and bool(C.grouped_mm_sm100_enabled())


def portable_mma_opted_in() -> bool:
    """Whether the portable kernel runs bf16 and fp16 on tensor cores: the C++ dispatch's own answer (it reads
    MOE_KERNELS_PORTABLE_MMA once per process), so what is reported is what runs."""
    enabled = getattr(_ext._C, "grouped_mm_portable_mma_enabled", None)
    return enabled is not None and bool(enabled())


def choose_backend(capability: tuple[int, int], dtype: torch.dtype, *, extension_runs: bool, cutlass_sm90: bool,
                   torch_archs, cutlass_sm100: bool = False, sm100_opt_in: bool = False) -> str:
    """The grouped GEMM implementation for a GPU of `capability` and inputs of `dtype` (see the table above).
    extension_runs: our kernels run on this GPU; cutlass_sm90 / cutlass_sm100: the extension holds the sm_90a /
    sm_100f CUTLASS kernels; sm100_opt_in: MOE_KERNELS_SM100_CUTLASS=1."""
    if extension_runs and cutlass_sm90 and capability[0] == 9 and dtype in _CUTLASS_DTYPES:
        return CUTLASS_SM90  # grouped_mm.cu choose_path: bf16, fp16 or E4M3 (blockwise), sm90::compiled(), major 9
    if (extension_runs and cutlass_sm100 and sm100_opt_in and tuple(capability) in ((10, 0), (10, 3))
            and dtype in (torch.bfloat16, torch.float8_e4m3fn)):
        return CUTLASS_SM100  # grouped_mm.cu choose_path: bf16 or E4M3 (blockwise), sm100::enabled(), major 10
    if torch_grouped_mm_fast(capability, dtype, torch_archs):
        return TORCH_GROUPED_MM
    return PORTABLE if extension_runs else REFERENCE


_device_facts: dict[int, tuple] = {}  # device index -> (capability, extension runs, sm_90a CUTLASS built, torch archs,
#                                                         sm_100f CUTLASS built, sm_100f on)
_backends: dict[tuple[int, torch.dtype], str] = {}


def _facts(index: int) -> tuple:
    facts = _device_facts.get(index)
    if facts is None:
        C = _ext._C
        facts = _device_facts[index] = (
            tuple(torch.cuda.get_device_capability(index)),
            _ext.extension_runs_on(torch.device("cuda", index)),
            bool(getattr(C, "grouped_mm_has_sm90", False)),
            tuple(torch.cuda.get_arch_list()),
            bool(getattr(C, "grouped_mm_has_sm100", False)),
            sm100_opted_in(),
        )
    return facts


def grouped_mm_backend(device: torch.device | str | int, dtype: torch.dtype) -> str:
    """Which implementation grouped_mm (and its dgrad and wgrad) runs for `dtype` inputs on `device`:
    "cutlass_sm90", "torch_grouped_mm", "portable" or "reference". Host-side facts only, remembered per
    device. CPU tensors: "portable" under emulation (the CUDA kernels on the CPU), else "reference"."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return PORTABLE if device.type == "cpu" and _ext.emulation() and not _ext._reference_mode else REFERENCE
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, dtype)
    backend = _backends.get(key)
    if backend is None:
        capability, runs, sm90, archs, sm100, sm100_on = _facts(index)
        backend = _backends[key] = choose_backend(capability, dtype, extension_runs=runs, cutlass_sm90=sm90,
                                                  torch_archs=archs, cutlass_sm100=sm100, sm100_opt_in=sm100_on)
    return backend


def describe_backend(device: torch.device | str | int) -> str:
    """What grouped_mm runs on a GPU, per dtype, and why, for `python -m moe_kernels`, e.g.
    "bf16: torch._grouped_mm (no sm_100 CUTLASS build); fp16, fp32: portable CUDA kernel (torch._grouped_mm's
    fast path is bf16 only)"."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability, _, _, archs, sm100, _ = _facts(index)
    arch = f"sm_{capability[0]}{capability[1]}"
    tensor_cores = capability[0] >= 8 and portable_mma_opted_in()
    lines: dict[str, list[str]] = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        backend = grouped_mm_backend(index, dtype)
        if backend == CUTLASS_SM90:
            line = "CUTLASS sm_90a kernel"
        elif backend == CUTLASS_SM100:
            line = f"CUTLASS sm_100f kernel ({SM100_OPT_IN}=1; not yet run on a Blackwell GPU by this project)"
        elif backend == TORCH_GROUPED_MM:
            if capability[0] == 10 and sm100:
                why = f"the sm_100f CUTLASS kernels are opt-in: {SM100_OPT_IN}=1"
            elif capability[0] != 9:
                why = f"no {arch} CUTLASS build"
            else:
                why = "the extension has no sm_90a CUTLASS kernels"
            line = f"torch._grouped_mm ({why})"
        elif backend == REFERENCE:
            line = "PyTorch reference"
        elif dtype != torch.float32 and tensor_cores:
            line = f"portable kernel on tensor cores ({PORTABLE_MMA_OPT_IN}=1; not yet run on a GPU by this project)"
        else:
            line = "portable CUDA kernel"
            if capability[0] not in (9, 10):
                line += f" (torch._grouped_mm syncs the host on {arch})"
            elif dtype != torch.bfloat16:
                line += " (torch._grouped_mm's fast path is bf16 only)"
            elif f"sm_{capability[0]}{capability[1]}" not in archs:
                line += f" (this torch has no {arch} grouped GEMM)"
        lines.setdefault(line, []).append(name)
    return "; ".join(f"{', '.join(names)}: {line}" for line, names in lines.items())


# ---------------------------------------------------------------------------------------------------
# torch._grouped_mm with our contract: offsets cumsum(group_sizes) on the device, clamped to the rows there
# are (a sum past M never reads or writes outside x and out), dgrad's rows past the groups zeroed, wgrad's
# empty groups zeroed (a zero-length reduction in CUTLASS leaves its accumulators unwritten). No host sync.


def _torch_offsets(group_sizes: Tensor, M: int) -> Tensor:
    """[E] int32 end row of each group: cumsum of the sizes (negative ones as 0), at most M."""
    return group_sizes.clamp(min=0).cumsum(0).clamp_(max=M).to(torch.int32)


def grouped_mm_torch(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """grouped_mm through torch._grouped_mm: x [M, K] @ w[e]^T per group; rows past the groups unspecified."""
    return torch._grouped_mm(x, w.transpose(-2, -1), _torch_offsets(group_sizes, x.shape[0]))


def grouped_mm_dgrad_torch(dout: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """dx [M, K] = dout rows of e @ w[e] through torch._grouped_mm; rows past the groups zero."""
    M = dout.shape[0]
    offs = _torch_offsets(group_sizes, M)
    dx = torch._grouped_mm(dout, w, offs)
    rows = torch.arange(M, device=dout.device).unsqueeze(1)  # [M, 1]
    return dx.masked_fill_(rows >= offs[-1], 0)


def grouped_mm_wgrad_torch(dout: Tensor, x: Tensor, group_sizes: Tensor) -> Tensor:
    """dw [E, N, K] = dout_e^T @ x_e through torch._grouped_mm (the groups split the reduction); empty groups
    zero."""
    offs = _torch_offsets(group_sizes, dout.shape[0])
    dw = torch._grouped_mm(dout.t(), x, offs)
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0  # [E]
    return dw.masked_fill_(empty[:, None, None], 0)


def _takes_torch(op: str, t: Tensor, operands: tuple[Tensor, ...], group_sizes: Tensor, M: int, N: int,
                 K: int) -> bool:
    """True when torch._grouped_mm runs this call: the chooser picks it for t's GPU and dtype and its kernel
    takes the problem (non-empty, at most 1023 groups, 16-byte strides and base pointers). In the checking
    mode the sizes are validated first (a sync)."""
    E = group_sizes.shape[0]
    if not (M and N and K and 0 < E <= _TORCH_MAX_GROUPS):
        return False
    if grouped_mm_backend(t.device, t.dtype) != TORCH_GROUPED_MM:
        return False
    align = 16 // t.element_size()
    if N % align or K % align or any(o.data_ptr() % 16 for o in operands):
        return False
    if _ext.checks_enabled():
        _check_sizes_values(group_sizes, M, op)
    return True


# ---------------------------------------------------------------------------------------------------
# CUDA: one launcher for the three products; it picks the sm_90a CUTLASS kernel or the portable one.


def _launch(op: str, a: Tensor, b: Tensor, out: Tensor, group_sizes: Tensor, M: int, N: int, K: int, C,
            group_align: int = 0, kernel: int = -1, raster: int = -1, accumulate: bool = False,
            group_order: int = -1, portable: int = -1) -> None:
    """group_align (wgrad): groups whose rows do not start and end on multiples of it come out NaN.
    kernel, raster: an sm_90a instance (an index into C.grouped_mm_sm90_kernels()) and raster order to run
    instead of the tuning table's choice (bench tune_grouped_mm and the per-instance GPU tests).
    accumulate (wgrad, float32): out += the product; empty groups keep out. group_order: the order the
    CUTLASS scheduler visits the groups, 1 largest first, 0 expert order, -1 the default (largest first for
    wgrad); the output is the same (bench grouped_mm's group-order cases). portable: 1 runs the tensor-core
    portable kernel (bf16, fp16, sm_80+), 0 the CUDA-core one, in place of whatever would run (tests and the
    bench compare them); -1 the default choice."""
    E = group_sizes.shape[0]
    # One pointer rule (0 for an empty tensor) for sizing and launching: the path, and so the workspace it
    # needs, follows the pointers' alignment.
    ptrs = dict(a=_ext.ptr(a), b=_ext.ptr(b), d=_ext.ptr(out))
    forced = {"portable": portable} if portable != -1 else {}
    nbytes = C.grouped_mm_workspace_bytes(op=_OPS[op], dtype=_ext.dtype_code(a.dtype), num_groups=E, M=M, N=N, K=K,
                                          **ptrs, device=_ext.launch_args(a)["device"], kernel=kernel, raster=raster,
                                          **forced)
    ws, ws_ptr = _ext.workspace(nbytes, a)
    C.grouped_mm(
        op=_OPS[op], **ptrs, group_sizes=_ext.ptr(group_sizes), num_groups=E,
        M=M, N=N, K=K, dtype=_ext.dtype_code(a.dtype), workspace=ws_ptr, workspace_bytes=nbytes,
        group_align=group_align, kernel=kernel, raster=raster, **_ext.launch_args(a),
        **({"accumulate": True} if accumulate else {}), **({"group_order": group_order} if group_order != -1 else {}),
        **forced,
    )


def visit_order(op: str, group_sizes: Tensor, M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16,
                group_order: int = -1) -> Tensor:
    """The order in which grouped_mm's CUTLASS schedulers visit the groups of this problem (int32 [E] on
    group_sizes' device, order[s] = the group visited s-th), as the op's own prepare kernel writes it on the
    device: for wgrad (or group_order=1) the groups by their rows (clamped to M) largest first, ties in expert
    order; expert order for fwd and dgrad, with group_order=0, or past C.grouped_mm_max_ordered_groups groups.
    For tests and the bench; the CPU-executed build computes it too."""
    C = _ext.kernels(op, group_sizes)
    if C is None:
        raise RuntimeError("visit_order needs the extension's kernels on this device")
    E = group_sizes.shape[0]
    code = _ext.dtype_code(dtype)
    dev = _ext.launch_args(group_sizes)
    nbytes = C.grouped_mm_workspace_bytes(op=_OPS[op], dtype=code, num_groups=E, M=M, N=N, K=K, a=0, b=0, d=0,
                                          device=dev["device"])
    ws, ws_ptr = _ext.workspace(nbytes, group_sizes)
    order = torch.empty(E, dtype=torch.int32, device=group_sizes.device)
    C.grouped_mm_visit_order(op=_OPS[op], group_sizes=group_sizes.data_ptr(), num_groups=E, M=M, N=N, K=K,
                             dtype=code, workspace=ws_ptr, workspace_bytes=nbytes, order=order.data_ptr(),
                             group_order=group_order, **dev)
    return order


def visit_order_reference(op: str, group_sizes: Tensor, M: int, group_order: int = -1,
                          max_ordered: int = 512) -> Tensor:
    """visit_order's definition on any device: the rows each group holds inside [0, M), sorted descending
    (stable), where the order applies; else 0..E-1."""
    E = group_sizes.shape[0]
    sizes = group_sizes.to(torch.int64).clamp(min=0)
    ends = sizes.cumsum(0).clamp(max=M)
    rows = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    if group_order == 0 or (group_order == -1 and op != "wgrad") or E > max_ordered:
        return torch.arange(E, dtype=torch.int32, device=group_sizes.device)
    return torch.sort(-rows, stable=True).indices.to(torch.int32)


def _cuda_common(op: str, t: Tensor, group_sizes: Tensor, M: int):
    check_cuda_dtype(op, "inputs", t, CUDA_FLOAT_DTYPES)
    C = _ext.kernels(op, t)
    if C is None or _ext.checks_enabled():
        _check_sizes_values(group_sizes, M, op)
    if C is not None and group_sizes.shape[0] > C.grouped_mm_max_groups:
        raise ValueError(f"{op}: the CUDA kernel takes at most {C.grouped_mm_max_groups} groups (`group_sizes`), "
                         f"got {group_sizes.shape[0]}")
    return C


@_ext.cuda_impl(_grouped_mm)
def _grouped_mm_cuda(x, w, group_sizes):
    _check_fwd(x, w, group_sizes)
    M, K = x.shape
    E, N, _ = w.shape
    if _takes_torch("grouped_mm", x, (x, w), group_sizes, M, N, K):
        return grouped_mm_torch(x, w, group_sizes)
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
    if _takes_torch("grouped_mm_dgrad", dout, (dout, w), group_sizes, M, N, K):
        return grouped_mm_dgrad_torch(dout, w, group_sizes)
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
    if _takes_torch("grouped_mm_wgrad", dout, (dout, x), group_sizes, M, N, K):
        return grouped_mm_wgrad_torch(dout, x, group_sizes)
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
    are not autocast by torch itself). Gradients flow back to the original dtype. Anything else passes through
    (the op's own checks name it)."""
    if not isinstance(t, Tensor):
        return t
    device_type = t.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type) and t.is_floating_point():
        dtype = torch.get_autocast_dtype(device_type)
        if t.dtype != dtype and t.dtype != torch.float64:
            return t.to(dtype)
    return t
