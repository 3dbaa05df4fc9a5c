"""FP8 grouped GEMM with blockwise scaling, forward (specs/lowprec.md, "FP8 scaling recipes").

    x_q, x_scale = quantize_fp8(x_perm, "block")            # [M, K] E4M3 + [M, K / 128]
    w_q, w_scale = quantize_fp8_experts(w)                  # [E, N, K] E4M3 + [E, ceil(N / 128), K / 128]
    out = grouped_mm_fp8(x_q, x_scale, w_q, w_scale, group_sizes)   # [M, N] bf16

out[rows of e] = dequant(x_q)[rows of e] @ dequant(w_q[e])^T with dequant = q / scale (the scales are
quantize_fp8's multipliers); a block whose scale is 0 is a block of zeros (permute's zero-filled padding
rows of codes and scales give zeros, not 0 * inf = NaN). On sm_90a with K % 128 == 0 and N % 8 == 0 this
runs CUTLASS's FP8 blockwise ptr-array kernel: E4M3 WGMMA, fp32 accumulators promoted and scaled by the
two block scales every 128 of K, bf16 output, shapes and scale layouts per group written on the device
(no host sync). On a GPU of 8.9 or later without them (an L4, L40S, RTX 40 or 50, a B200/B300 without its
sm_100f instances opted in, or a shape they do not take) it runs the tensor-core portable kernel where
MOE_KERNELS_PORTABLE_MMA=1 (E4M3 mma.sync, the same per-128 promotion; opt-in until it has run on a GPU).
Elsewhere it dequantizes to fp32 and runs the fp32 grouped GEMM: correct, not fast, and it holds fp32 copies of
both operands.

On an A100 or A10 (no FP8 tensor cores), or on a GPU of 8.9 and later without the switch, both FP8 ops take that
dequantize path, after one RuntimeWarning that says so (and how to take the tensor-core one where it runs).
torch offers no replacement: torch._scaled_grouped_mm (and its v2,
torch.nn.functional.scaled_grouped_mm) takes row-wise fp32 scales or MXFP8 / MXFP4 / NVFP4 block scales,
not 1x128 / 128x128 blockwise ones (GroupedBlas.cpp's `scale_grouped_kernel_dispatch` lists rowwise_rowwise,
mxfp8, mxfp4 and nvfp4 only), and runs only on 9.x and 10.x. Rows past the groups are unspecified, as in grouped_mm. Forward
only: there is no autograd (a training recipe wraps it with its own backward).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.ops._checks import CUDA_FLOAT_DTYPES, check_shape, check_tensor
from moe_kernels.ops.grouped_mm import (
    CUTLASS_SM90,
    CUTLASS_SM100,
    PORTABLE,
    PORTABLE_MMA_OPT_IN,
    REFERENCE,
    _check_sizes_values,
    _launch,
    grouped_mm_backend,
    portable_mma_opted_in,
    grouped_mm_reference,
    grouped_mm_wgrad_reference,
)
from moe_kernels.ops.quant import BLOCK, dequantize_fp8, pad_codes_to_block, quantize_fp8, quantize_fp8_reference
from moe_kernels.ops.quant import _quantize_fp8_tokens

_E4M3 = torch.float8_e4m3fn
# grouped_mm_path: sm_90a, sm_100f (opted in) FP8 blockwise; the tensor-core portable kernel (8.9+, opted in)
_FWD, _FP8_PATH, _SM100_FP8_PATH, _MMA_PATH = 0, 3, 5, 8
_FP8_PATHS = (_FP8_PATH, _SM100_FP8_PATH, _MMA_PATH)
_E4M3_CODE = _ext.dtype_code(torch.float8_e4m3fn)


def quantize_fp8_experts(w: Tensor, *, pow2_scale: bool = False) -> tuple[Tensor, Tensor]:
    """Expert weights [E, N, K] -> (E4M3 [E, N, K], fp32 [E, ceil(N / 128), K / 128]): one scale per 128x128
    tile of each expert (tiles never straddle two experts)."""
    check_tensor("quantize_fp8_experts", "w", w, ndim=3)
    E, N, K = w.shape
    if N % BLOCK == 0:
        q, s = quantize_fp8(w.reshape(E * N, K), "tile", pow2_scale=pow2_scale)
        return q.view(E, N, K), s.view(E, N // BLOCK, -(-K // BLOCK))
    parts = [quantize_fp8(w[e], "tile", pow2_scale=pow2_scale) for e in range(E)]
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    if not parts:
        return w.new_empty((0, N, K), dtype=_E4M3), w.new_empty((0, nb, kb), dtype=torch.float32)
    return _stack([p[0] for p in parts]), _stack([p[1] for p in parts])


def _stack(tensors: list[Tensor]) -> Tensor:
    """torch.stack outside autocast: autocast's stack promotes its inputs to a common dtype, and knows no float8
    (RuntimeError under torch.autocast on a CPU)."""
    device = tensors[0].device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):  # (meta has no autocast)
        return torch.stack(tensors)
    with torch.autocast(device, enabled=False):
        return torch.stack(tensors)


def _check_experts_dual(w: Tensor) -> None:
    check_tensor("quantize_fp8_experts_dual", "w", w, ndim=3, dtypes=CUDA_FLOAT_DTYPES, contiguous=False)


def quantize_fp8_experts_dual_reference(w: Tensor, pow2_scale: bool = False, pad_to_block: bool = False
                                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The composition the one-pass kernel replaces: each expert's 128x128 tiles (quantize_fp8(w[e], "tile")),
    then the codes and scales transposed; with `pad_to_block` both layouts' codes zero-padded along their rows
    (pad_codes_to_block)."""
    E, N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    parts = [quantize_fp8_reference(w[e], "tile", _E4M3, pow2_scale) for e in range(E)]
    q = _stack([p[0] for p in parts]) if parts else w.new_empty((0, N, K), dtype=_E4M3)
    s = _stack([p[1] for p in parts]) if parts else w.new_empty((0, nb, kb), dtype=torch.float32)
    # clone, not contiguous(): a transpose that is already contiguous ([E, 1, 1] scales) must not alias.
    t = dict(memory_format=torch.contiguous_format)
    q_t, s_t = q.transpose(1, 2).clone(**t), s.transpose(1, 2).clone(**t)
    if pad_to_block:
        q, q_t = pad_codes_to_block(q), pad_codes_to_block(q_t)
    return q, s, q_t, s_t


@torch.library.custom_op("moe_kernels::quantize_fp8_experts_dual", mutates_args=())
def _quantize_fp8_experts_dual(w: Tensor, pow2_scale: bool, pad_to_block: bool = False
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_experts_dual(w)
    return quantize_fp8_experts_dual_reference(w, pow2_scale, pad_to_block)


def _dual_outputs_like(w: Tensor, pad_to_block: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    E, N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    q_cols, q_t_rows = (kb * BLOCK, nb * BLOCK) if pad_to_block else (K, N)
    return (w.new_empty((E, N, q_cols), dtype=_E4M3), w.new_empty((E, nb, kb), dtype=torch.float32),
            w.new_empty((E, K, q_t_rows), dtype=_E4M3), w.new_empty((E, kb, nb), dtype=torch.float32))


@_quantize_fp8_experts_dual.register_fake
def _(w, pow2_scale, pad_to_block=False):
    _check_experts_dual(w)
    return _dual_outputs_like(w, pad_to_block)


@_ext.cuda_impl(_quantize_fp8_experts_dual)
def _quantize_fp8_experts_dual_cuda(w, pow2_scale, pad_to_block=False):
    _check_experts_dual(w)
    return _dual_cuda(w, None, pow2_scale, pad_to_block)


def _dual_cuda(w: Tensor, copy: Tensor | None, pow2_scale: bool, pad_to_block: bool
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The one-pass kernel, with the copy where `copy` is given (inputs checked by the caller)."""
    C = _ext.kernels("quantize_fp8_experts_dual", w)
    if C is None:
        if copy is None:
            return quantize_fp8_experts_dual_reference(w, pow2_scale, pad_to_block)
        return quantize_fp8_experts_dual_copy_reference(w, copy, pow2_scale, pad_to_block)
    w = w.contiguous()
    E, N, K = w.shape
    q, scale, q_t, scale_t = _dual_outputs_like(w, pad_to_block)
    with_copy = {} if copy is None else dict(copy=_ext.ptr(copy), copy_dtype=_ext.dtype_code(copy.dtype))
    C.fp8_quantize_experts(w=_ext.ptr(w), q=_ext.ptr(q), scale=_ext.ptr(scale), q_t=_ext.ptr(q_t),
                           scale_t=_ext.ptr(scale_t), experts=E, rows=N, cols=K, pow2=pow2_scale,
                           dtype=_ext.dtype_code(w.dtype), **_ext.launch_args(w), **with_copy,
                           q_cols=q.shape[2], q_t_rows=q_t.shape[2])
    return q, scale, q_t, scale_t


def _check_experts_dual_copy(w: Tensor, copy: Tensor) -> None:
    op = "quantize_fp8_experts_dual"
    check_tensor(op, "w", w, ndim=3, dtypes=(torch.float32,), contiguous=False)
    check_tensor(op, "copy_to", copy, ndim=3, dtypes=(torch.bfloat16, torch.float16), device=w.device)
    check_shape(op, "copy_to", copy, w.shape, "w's")
    if copy.numel() and w.numel() and copy.untyped_storage()._cdata == w.untyped_storage()._cdata:
        raise ValueError(f"{op}: `copy_to` shares its storage with `w`")
    if copy.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{op}: `copy_to` requires grad: write it under torch.no_grad() (as copy_ would ask)")


def quantize_fp8_experts_dual_copy_reference(w: Tensor, copy: Tensor, pow2_scale: bool = False,
                                             pad_to_block: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the copying form of the one-pass kernel is, bit for bit: `copy` <- w rounded to its dtype, then
    the dual tiles of those rounded weights."""
    copy.copy_(w)
    return quantize_fp8_experts_dual_reference(copy, pow2_scale, pad_to_block)


@torch.library.custom_op("moe_kernels::quantize_fp8_experts_dual_copy", mutates_args=("copy",))
def _quantize_fp8_experts_dual_copy(w: Tensor, copy: Tensor, pow2_scale: bool, pad_to_block: bool = False
                                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_experts_dual_copy(w, copy)
    return quantize_fp8_experts_dual_copy_reference(w, copy, pow2_scale, pad_to_block)


@_quantize_fp8_experts_dual_copy.register_fake
def _(w, copy, pow2_scale, pad_to_block=False):
    _check_experts_dual_copy(w, copy)
    return _dual_outputs_like(copy, pad_to_block)


@_ext.cuda_impl(_quantize_fp8_experts_dual_copy)
def _quantize_fp8_experts_dual_copy_cuda(w, copy, pow2_scale, pad_to_block=False):
    _check_experts_dual_copy(w, copy)
    return _dual_cuda(w, copy, pow2_scale, pad_to_block)


def quantize_fp8_experts_dual(w: Tensor, *, pow2_scale: bool = False, copy_to: Tensor | None = None,
                              pad_to_block: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Expert weights [E, N, K] -> (q [E, N, K], scale [E, ceil(N / 128), ceil(K / 128)], q_t [E, K, N],
    scale_t [E, ceil(K / 128), ceil(N / 128)]; with `pad_to_block`, q [E, N, Kp] and q_t [E, K, Np], below),
    E4M3 with fp32 scales: the forward's 128x128 tiles
    (quantize_fp8_experts) and dgrad's transposed tiles (a tile is its own transpose: the same codes and
    scales laid out the other way), from one read of w on the GPU. Bit for bit quantize_fp8_experts(w)
    followed by transpose(1, 2) of codes and scales. No autograd.

    copy_to: a contiguous bf16 or fp16 tensor of w's shape, w fp32 (master weights): w is rounded to
    copy_to's dtype and written there, and the rounded weights are quantized, in the same pass; bit for bit
    copy_to.copy_(w) followed by quantize_fp8_experts_dual(copy_to) (a NaN may keep another payload).

    pad_to_block: each layout's codes written with their rows zero-padded to a multiple of 128 where their length
    is none (q [E, N, ceil(K / 128) * 128], q_t [E, K, ceil(N / 128) * 128], the scales unchanged), in the same
    pass: the weight operand of an FP8 GEMM that contracts over K (the forward) or N (dgrad) when that is no
    multiple of 128, as quantize_fp8(..., pad_to_block=True) pads the other operand; bit for bit
    pad_codes_to_block of each layout's codes."""
    if copy_to is not None:
        _check_experts_dual_copy(w, copy_to)
        return torch.ops.moe_kernels.quantize_fp8_experts_dual_copy(w, copy_to, bool(pow2_scale), bool(pad_to_block))
    _check_experts_dual(w)
    return _ext.direct(_quantize_fp8_experts_dual, w, w, bool(pow2_scale), bool(pad_to_block))


def _check(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes: Tensor) -> None:
    op = "grouped_mm_fp8"
    check_tensor(op, "x_q", x_q, ndim=2, dtypes=(_E4M3,))
    check_tensor(op, "w_q", w_q, ndim=3, dtypes=(_E4M3,), device=x_q.device)
    M, K = x_q.shape
    E, N, Kw = w_q.shape
    if Kw != K:
        raise ValueError(f"{op}: `w_q` has K={Kw}, `x_q` has K={K}")
    if K % BLOCK:
        raise ValueError(f"{op}: K={K} must be a multiple of {BLOCK} (one scale per 128 along K)")
    check_tensor(op, "x_scale", x_scale, ndim=2, dtypes=(torch.float32,), device=x_q.device)
    if tuple(x_scale.shape) != (M, K // BLOCK):
        raise ValueError(f"{op}: `x_scale` must be [{M}, {K // BLOCK}] (quantize_fp8(x, 'block')), "
                         f"got {tuple(x_scale.shape)}")
    check_tensor(op, "w_scale", w_scale, ndim=3, dtypes=(torch.float32,), device=x_q.device)
    if tuple(w_scale.shape) != (E, -(-N // BLOCK), K // BLOCK):
        raise ValueError(f"{op}: `w_scale` must be [{E}, {-(-N // BLOCK)}, {K // BLOCK}] (quantize_fp8_experts), "
                         f"got {tuple(w_scale.shape)}")
    check_tensor(op, "group_sizes", group_sizes, ndim=1, dtypes=(torch.int32,), device=x_q.device)
    if group_sizes.shape[0] != E:
        raise ValueError(f"{op}: `group_sizes` has {group_sizes.shape[0]} entries for {E} experts in `w_q`")


def grouped_mm_fp8_reference(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes: Tensor, acc: torch.dtype = torch.float32
) -> Tensor:
    """Both operands dequantized in `acc` (q / scale, each element's block scale; 0 where the scale is 0),
    per-expert matmul in `acc`; the result in `acc` (the op rounds the fp32 one to bf16; fp64 gives the
    tests' exact value)."""
    M, K = x_q.shape
    E, N, _ = w_q.shape
    sx = x_scale.to(acc).repeat_interleave(BLOCK, 1)[:, :K]
    sw = w_scale.to(acc).repeat_interleave(BLOCK, 1)[:, :N].repeat_interleave(BLOCK, 2)[:, :, :K]
    x = torch.where(sx == 0, 0.0, x_q.to(acc) / sx)
    return grouped_mm_reference(x, torch.where(sw == 0, 0.0, w_q.to(acc) / sw), group_sizes)


def _dequantize_experts(w_q: Tensor, w_scale: Tensor) -> Tensor:
    """fp32 [E, N, K] through the dequantize kernels: one call when 128-row tiles never straddle experts."""
    E, N, K = w_q.shape
    if N % BLOCK == 0 and E:
        flat = dequantize_fp8(w_q.view(E * N, K), w_scale.view(E * N // BLOCK, -1), "tile", dtype=torch.float32)
        return flat.view(E, N, K)
    parts = [dequantize_fp8(w_q[e], w_scale[e], "tile", dtype=torch.float32) for e in range(E)]
    return torch.stack(parts) if parts else w_q.new_empty((0, N, K), dtype=torch.float32)


_warned_no_fp8_kernel = False


def _why_no_fp8_kernel(capability: tuple[int, int]) -> str:
    major, minor = capability
    if (major, minor) < (8, 9):
        return f"this GPU (sm_{major}{minor}) has no FP8 tensor cores"
    if major == 9:
        return "the extension was built without its sm_90a CUTLASS kernels"
    return (f"moe_kernels has no FP8 blockwise kernel for sm_{major}{minor} (its CUTLASS kernels are sm_90a) and "
            "torch._scaled_grouped_mm takes no 1x128 / 128x128 block scales")


def _warn_without_fp8_kernel(t: Tensor) -> None:
    """One RuntimeWarning per process when the FP8 ops dequantize on a GPU for want of the sm_90a kernels."""
    global _warned_no_fp8_kernel
    if _warned_no_fp8_kernel or t.device.type != "cuda" or grouped_mm_backend(t.device, _E4M3) != PORTABLE:
        return
    _warned_no_fp8_kernel = True
    capability = tuple(torch.cuda.get_device_capability(t.device))
    why = _why_no_fp8_kernel(capability)
    hint = ""
    if capability >= (8, 9):
        why_not = tensor_core_refusal(t.device)
        if why_not is not None:
            hint = f"; the tensor-core portable kernel cannot run: {why_not}"
        elif not portable_mma_opted_in():
            hint = (f"; {PORTABLE_MMA_OPT_IN}=1 runs them on this GPU's FP8 tensor cores (the portable kernel, not yet "
                    "run on a GPU by this project)")
    warnings.warn(f"{why}: grouped_mm_fp8 and grouped_mm_fp8_wgrad dequantize to fp32 and run the portable grouped "
                  f"GEMM (correct, slower than bf16, fp32 copies of both operands){hint}", RuntimeWarning, stacklevel=4)


def tensor_core_refusal(device: torch.device | int) -> str | None:
    """Why the tensor-core portable FP8 kernel (E4M3 mma.sync, 8.9 and later) cannot run on `device`, or None when
    it can: below 8.9 a host-side fact, else the C++ dispatch's own answer for a small forward (it also knows
    whether the build holds code for this GPU), so what `python -m moe_kernels` reports is what runs. A CPU
    device asks the CPU-executed kernels (the emulated GPU's capability)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if tuple(torch.cuda.get_device_capability(index)) < (8, 9):
            return "FP8 needs compute capability 8.9 or later (E4M3 tensor cores)"
        C = _ext._C
    else:
        index, C = 0, (_ext.kernels("grouped_mm_fp8", torch.empty(0)) if _ext.emulation() else None)
    path = getattr(C, "grouped_mm_path", None)
    if path is None:
        return "no grouped GEMM kernels for this device"
    try:
        path(op=_FWD, dtype=_ext.dtype_code(_E4M3), num_groups=1, M=128, N=128, K=128, a=256, b=256, d=256,
             device=index, sfa=256, sfb=256, portable=1)
    except ValueError as e:
        return str(e).split(", but ", 1)[-1]
    return None


def describe_backend(device: torch.device | int) -> str:
    """What the FP8 grouped GEMMs run on a GPU, for `python -m moe_kernels`."""
    backend = grouped_mm_backend(device, _E4M3)
    if backend == CUTLASS_SM90:
        return "CUTLASS sm_90a FP8 blockwise kernel"
    if backend == CUTLASS_SM100:
        return "CUTLASS sm_100f FP8 blockwise kernel (opted in; not yet run on a Blackwell GPU by this project)"
    if backend == REFERENCE:
        return "PyTorch reference"
    index = device if isinstance(device, int) else torch.device(device).index or 0
    capability = tuple(torch.cuda.get_device_capability(index))
    why = _why_no_fp8_kernel(capability)
    if capability >= (8, 9):
        why_not = tensor_core_refusal(index)
        if why_not is None and portable_mma_opted_in():
            return (f"portable FP8 kernel on tensor cores (E4M3 mma.sync, {PORTABLE_MMA_OPT_IN}=1; not yet run on a "
                    "GPU by this project)")
        status = f"is opt-in: {PORTABLE_MMA_OPT_IN}=1" if why_not is None else f"cannot run: {why_not}"
        why += f"; its portable tensor-core kernel {status}"
    return f"dequantized to fp32, portable CUDA kernel ({why})"


def _inverse_scale(scale: Tensor) -> Tensor:
    """1 / scale, and 0 where the scale is 0 (a block of zeros)."""
    return torch.where(scale == 0, 0.0, scale.reciprocal())


def _as_matrix(t: Tensor) -> tuple[int, int]:
    """(rows, cols) of t seen as a matrix of its last dimension's rows."""
    return (math.prod(t.shape[:-1]), t.shape[-1]) if t.dim() else (1, 1)


def _dequant_scales(C, a_scale: Tensor, b_scale: Tensor, transpose: bool = False,
                    launch: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Both operands' dequantization scales in one launch (C.fp8_dequant_scales): bit for bit _inverse_scale of
    each, and with `transpose` (wgrad's [N, M/128] and [K, M/128] scales, read token-block-major) its .t() made
    contiguous. Three elementwise passes and a transpose per operand before, each a launch of its own. `launch`:
    (device, stream), else a_scale's device and current stream."""
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    (a_rows, a_cols), (b_rows, b_cols) = _as_matrix(a_scale), _as_matrix(b_scale)
    if transpose:
        a_out = a_scale.new_empty((a_cols, a_rows))
        b_out = b_scale.new_empty((b_cols, b_rows))
    else:
        a_out, b_out = torch.empty_like(a_scale), torch.empty_like(b_scale)
    device, stream = launch if launch is not None else _ext.launch_args(a_scale).values()
    C.fp8_dequant_scales(a_scale.data_ptr(), a_out.data_ptr(), a_rows, a_cols, b_scale.data_ptr(), b_out.data_ptr(),
                         b_rows, b_cols, transpose, device, stream, 0)
    return a_out, b_out


@torch.library.custom_op("moe_kernels::grouped_mm_fp8", mutates_args=())
def _grouped_mm_fp8(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes: Tensor) -> Tensor:
    _check(x_q, x_scale, w_q, w_scale, group_sizes)
    _check_sizes_values(group_sizes, x_q.shape[0], "grouped_mm_fp8")
    return grouped_mm_fp8_reference(x_q, x_scale, w_q, w_scale, group_sizes).to(torch.bfloat16)


@_grouped_mm_fp8.register_fake
def _(x_q, x_scale, w_q, w_scale, group_sizes):
    _check(x_q, x_scale, w_q, w_scale, group_sizes)
    return x_q.new_empty((x_q.shape[0], w_q.shape[1]), dtype=torch.bfloat16)


@_ext.cuda_impl(_grouped_mm_fp8)
def _grouped_mm_fp8_cuda(x_q, x_scale, w_q, w_scale, group_sizes):
    _check(x_q, x_scale, w_q, w_scale, group_sizes)
    M, E = x_q.shape[0], w_q.shape[0]
    C = _ext.kernels("grouped_mm_fp8", x_q)
    if C is None or _ext.checks_enabled():
        _check_sizes_values(group_sizes, M, "grouped_mm_fp8")
    if C is None:
        return grouped_mm_fp8_reference(x_q, x_scale, w_q, w_scale, group_sizes).to(torch.bfloat16)
    if E > C.grouped_mm_max_groups:
        raise ValueError(f"grouped_mm_fp8: the CUDA kernel takes at most {C.grouped_mm_max_groups} groups (`group_sizes`), got {E}")
    return forward_on(C, tuple(_ext.launch_args(x_q).values()), x_q, x_scale, w_q, w_scale, group_sizes)


def forward_on(C, launch: tuple[int, int], x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor,
               group_sizes: Tensor) -> Tensor:
    """grouped_mm_fp8's CUDA path on operands already checked, on extension C at `launch` (device, stream), for the
    op's implementation and the recipe's functions."""
    M, E, N = x_q.shape[0], w_q.shape[0], w_q.shape[1]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x_q.device)
    if M == 0 or N == 0 or E == 0:
        return out.zero_()
    if _run_forward(C, x_q, x_scale, w_q, w_scale, group_sizes, out, launch=launch) is not None:
        return out
    # No FP8 kernel takes it (no sm_90a kernel or N % 8, and no tensor-core portable one): the fp32 path (memory:
    # fp32 copies), through the registered grouped_mm, which autocast leaves alone (the public wrapper would round
    # the dequantized operands to the autocast dtype: not the fp32 product this op promises).
    _warn_without_fp8_kernel(x_q)
    x = dequantize_fp8(x_q, x_scale, "block", dtype=torch.float32)
    return torch.ops.moe_kernels.grouped_mm(x, _dequantize_experts(w_q, w_scale), group_sizes).to(torch.bfloat16)


def _launch_fp8(C, op: int, a: Tensor, b: Tensor, out: Tensor, sfa: Tensor, sfb: Tensor, group_sizes: Tensor,
                M: int, N: int, K: int, kernel: int = -1, raster: int = -1, accumulate: bool = False,
                group_order: int = -1, portable: int = -1, launch: tuple[int, int] | None = None) -> bool:
    """Runs an FP8 blockwise kernel for `op` when one takes this problem (False: none does, nothing ran): the
    sm_90a one, the sm_100f one where opted in, else the tensor-core portable one (8.9 and later, opted in with
    MOE_KERNELS_PORTABLE_MMA=1). sfa / sfb: dequantization scales in the layout grouped_mm.h states for the
    op. wgrad writes `out`'s dtype (fp32 or bf16). kernel, raster: an sm_90a instance and raster order instead of
    the tuning table's choice (bench tune_grouped_mm and the per-instance GPU tests). group_order: the order the
    scheduler visits the groups (1 largest first, 0 expert order, -1 the default: largest first for wgrad).
    portable=1: the tensor-core portable kernel by name, on any GPU of 8.9 or later (its tests; ValueError
    where it cannot take the problem). `launch`: (device, stream), else a's device and current stream. The
    extension is called with positional arguments (python_api/gemm.cpp's order)."""
    E = group_sizes.shape[0]
    device, stream = launch if launch is not None else _ext.launch_args(a).values()
    wgrad_out = _ext.dtype_code(out.dtype) if op == _WGRAD and out.dtype is not torch.float32 else 0
    a_ptr, b_ptr, d_ptr, sfa_ptr, sfb_ptr = a.data_ptr(), b.data_ptr(), out.data_ptr(), sfa.data_ptr(), sfb.data_ptr()
    # op, dtype, num_groups, M, N, K, a, b, d, device, sfa, sfb, fp8_wgrad_out, kernel, raster, a_global, b_global,
    # portable
    shape = (op, _E4M3_CODE, E, M, N, K, a_ptr, b_ptr, d_ptr, device, sfa_ptr, sfb_ptr, wgrad_out, kernel, raster, 0, 0,
             portable)
    if C.grouped_mm_path(*shape, 0, 0, 0) not in _FP8_PATHS:  # (no gathered rows, no epilogue)
        return False
    nbytes = C.grouped_mm_workspace_bytes(*shape)
    ws, ws_ptr = _ext.workspace(nbytes, a)
    # The launch takes the problem the path and the workspace were chosen for (the output dtype included).
    C.grouped_mm(op, a_ptr, b_ptr, d_ptr, group_sizes.data_ptr(), E, M, N, K, _E4M3_CODE, ws_ptr, nbytes, device, stream,
                 sfa_ptr, sfb_ptr, 0, wgrad_out, kernel, raster, accumulate, group_order, 0, 0, portable)
    return True


def _run_forward(C, x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes: Tensor,
                 out: Tensor | None = None, *, portable: int = -1, launch: tuple[int, int] | None = None
                 ) -> Tensor | None:
    """The forward on an FP8 blockwise kernel (the op's choice, or with portable=1 the tensor-core portable one by
    name): bf16 `out` ([M, N], allocated when None), or None where no kernel takes the problem (nothing ran). The
    kernels multiply accumulators by dequantization scales: the reciprocals of quantize_fp8's, 0 for a zero scale
    (permute's padding: zero codes times 0, where 1 / 0 = inf would give 0 * inf = NaN)."""
    M, K = x_q.shape
    N = w_q.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=x_q.device)
    sfa, sfb = _dequant_scales(C, x_scale, w_scale, launch=launch)
    ran = _launch_fp8(C, _FWD, x_q, w_q, out, sfa, sfb, group_sizes, M, N, K, portable=portable, launch=launch)
    return out if ran else None


def _run_wgrad(C, a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, group_sizes: Tensor, out: Tensor, *,
               accumulate: bool = False, portable: int = -1, launch: tuple[int, int] | None = None) -> bool:
    """The weight gradient into `out` ([E, N, K], fp32 or bf16) on an FP8 blockwise kernel (the op's choice, or with
    portable=1 the tensor-core portable one by name); False where no kernel takes the problem (nothing ran). The
    dequantization scales (reciprocals, 0 for a zero scale) go token-block-major, [ceil(M / 128), N] and
    [ceil(M / 128), K]: a group's blocks are one contiguous slice."""
    N, M = a_q.shape
    K = b_q.shape[0]
    inv_a, inv_b = _dequant_scales(C, a_scale, b_scale, transpose=True, launch=launch)
    return _launch_fp8(C, _WGRAD, a_q, b_q, out, inv_a, inv_b, group_sizes, M, N, K, accumulate=accumulate,
                       portable=portable, launch=launch)


def grouped_mm_fp8(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes: Tensor) -> Tensor:
    """[M, N] bf16: group e's rows of dequant(x_q) @ dequant(w_q[e])^T. x_q, x_scale from
    quantize_fp8(x, "block"); w_q, w_scale from quantize_fp8_experts(w); group_sizes [E] int32 on the device.
    A zero scale is a block of zeros (permute's padding rows), so those rows come out 0."""
    return _ext.direct(_grouped_mm_fp8, x_q, x_q, x_scale, w_q, w_scale, group_sizes)


# ---------------------------------------------------------------------------------------------------
# Weight gradient: the groups split the contraction (the tokens)


def quantize_fp8_tokens(t: Tensor, *, pow2_scale: bool = False) -> tuple[Tensor, Tensor]:
    """[M, C] -> (E4M3 [C, Mp], fp32 [C, Mp / 128]): quantize_fp8(t^T, "block"), i.e. 1x128 blocks along
    the tokens, with the tokens zero-padded to Mp = M rounded up to 128 (whole blocks, 16-byte rows).
    The operands of grouped_mm_fp8_wgrad: with every group 128-aligned, no block straddles two experts."""
    # One pass on the GPU (transpose, padding and quantization); the reference is the composition.
    return _ext.direct(_quantize_fp8_tokens, t, t, bool(pow2_scale))


def _check_wgrad(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, group_sizes: Tensor) -> None:
    op = "grouped_mm_fp8_wgrad"
    check_tensor(op, "dout_t_q", a_q, ndim=2, dtypes=(_E4M3,))
    check_tensor(op, "x_t_q", b_q, ndim=2, dtypes=(_E4M3,), device=a_q.device)
    N, M = a_q.shape
    K, Mb = b_q.shape
    if Mb != M:
        raise ValueError(f"{op}: `x_t_q` has {Mb} tokens, `dout_t_q` has {M} (both [*, M]: quantize_fp8_tokens)")
    mb = -(-M // BLOCK)
    for name, scale, rows in (("dout_t_scale", a_scale, N), ("x_t_scale", b_scale, K)):
        check_tensor(op, name, scale, ndim=2, dtypes=(torch.float32,), device=a_q.device)
        if tuple(scale.shape) != (rows, mb):
            raise ValueError(f"{op}: `{name}` must be [{rows}, {mb}] (one scale per 128 tokens), got {tuple(scale.shape)}")
    check_tensor(op, "group_sizes", group_sizes, ndim=1, dtypes=(torch.int32,), device=a_q.device)


def _check_wgrad_sizes(group_sizes: Tensor, M: int) -> None:
    """Sizes as grouped_mm's, and each a multiple of 128. Syncs on a GPU."""
    op = "grouped_mm_fp8_wgrad"
    _check_sizes_values(group_sizes, M, op)
    bad = group_sizes % BLOCK != 0
    if bool(bad.any()):
        e = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"{op}: `group_sizes`: group {e} has {int(group_sizes[e])} rows; every group must be a multiple of {BLOCK} so that no "
            f"scale block straddles two experts (permute(..., align=128))"
        )


def _dequantize_tokens(q: Tensor, scale: Tensor, acc: torch.dtype) -> Tensor:
    """[C, M] codes with [C, ceil(M / 128)] scales -> [M, C] in `acc` (q / scale, 0 where the scale is 0)."""
    s = scale.to(acc).repeat_interleave(BLOCK, 1)[:, : q.shape[1]]
    return torch.where(s == 0, 0.0, q.to(acc) / s).t()


def grouped_mm_fp8_wgrad_reference(
    a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, group_sizes: Tensor, acc: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """dW[e] = dequant(a)[:, rows of e] @ dequant(b)[:, rows of e]^T in `acc`: [E, N, K], rounded once to
    `out_dtype` (default: `acc`)."""
    dw = grouped_mm_wgrad_reference(_dequantize_tokens(a_q, a_scale, acc), _dequantize_tokens(b_q, b_scale, acc),
                                    group_sizes)
    return dw if out_dtype is None else dw.to(out_dtype)


_WGRAD_OUT = (torch.float32, torch.bfloat16)


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _WGRAD_OUT:
        raise ValueError(f"grouped_mm_fp8_wgrad: `out_dtype` must be torch.float32 or torch.bfloat16, got {out_dtype}")


@torch.library.custom_op("moe_kernels::grouped_mm_fp8_wgrad", mutates_args=())
def _grouped_mm_fp8_wgrad(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, group_sizes: Tensor,
                          out_dtype: torch.dtype = torch.float32) -> Tensor:
    _check_wgrad(a_q, a_scale, b_q, b_scale, group_sizes)
    _check_out_dtype(out_dtype)
    _check_wgrad_sizes(group_sizes, a_q.shape[1])
    return grouped_mm_fp8_wgrad_reference(a_q, a_scale, b_q, b_scale, group_sizes, out_dtype=out_dtype)


@_grouped_mm_fp8_wgrad.register_fake
def _(a_q, a_scale, b_q, b_scale, group_sizes, out_dtype=torch.float32):
    _check_wgrad(a_q, a_scale, b_q, b_scale, group_sizes)
    _check_out_dtype(out_dtype)
    return a_q.new_empty((group_sizes.shape[0], a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


_WGRAD = 2


def _wgrad_kernels(a_q: Tensor, group_sizes: Tensor):
    """The extension for the FP8 wgrad on a_q's GPU (None: the reference runs), after the checks every CUDA
    path makes: the group sizes where values are checked, the group count the kernel takes."""
    C = _ext.kernels("grouped_mm_fp8_wgrad", a_q)
    if C is None or _ext.checks_enabled():
        _check_wgrad_sizes(group_sizes, a_q.shape[1])
    if C is not None and group_sizes.shape[0] > C.grouped_mm_max_groups:
        raise ValueError(f"grouped_mm_fp8_wgrad: the CUDA kernel takes at most {C.grouped_mm_max_groups} groups "
                         f"(`group_sizes`), got {group_sizes.shape[0]}")
    return C


@_ext.cuda_impl(_grouped_mm_fp8_wgrad)
def _grouped_mm_fp8_wgrad_cuda(a_q, a_scale, b_q, b_scale, group_sizes, out_dtype=torch.float32):
    _check_wgrad(a_q, a_scale, b_q, b_scale, group_sizes)
    _check_out_dtype(out_dtype)
    C = _wgrad_kernels(a_q, group_sizes)
    if C is None:
        return grouped_mm_fp8_wgrad_reference(a_q, a_scale, b_q, b_scale, group_sizes, out_dtype=out_dtype)
    return wgrad_on(C, tuple(_ext.launch_args(a_q).values()), a_q, a_scale, b_q, b_scale, group_sizes, out_dtype)


def wgrad_on(C, launch: tuple[int, int], a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor,
             group_sizes: Tensor, out_dtype: torch.dtype) -> Tensor:
    """grouped_mm_fp8_wgrad's CUDA path on operands already checked, on extension C at `launch` (device, stream):
    for the op's implementation and the recipe's functions."""
    (N, M), K, E = a_q.shape, b_q.shape[0], group_sizes.shape[0]
    if M == 0 or E == 0 or N == 0 or K == 0:
        return torch.zeros((E, N, K), dtype=out_dtype, device=a_q.device)
    out = torch.empty((E, N, K), dtype=out_dtype, device=a_q.device)
    if _run_wgrad(C, a_q, a_scale, b_q, b_scale, group_sizes, out, launch=launch):
        return out
    # No FP8 kernel takes it (no sm_90a kernel or M % 16, K % 4 (K % 8 for bf16 out), and no tensor-core portable
    # one): the portable fp32 wgrad (memory: fp32 copies), misaligned groups NaN as on the kernels.
    _warn_without_fp8_kernel(a_q)
    a = dequantize_fp8(a_q, a_scale, "block", dtype=torch.float32).t().contiguous()
    b = dequantize_fp8(b_q, b_scale, "block", dtype=torch.float32).t().contiguous()
    dw = out if out_dtype == torch.float32 else torch.empty((E, N, K), dtype=torch.float32, device=a_q.device)
    _launch("wgrad", a, b, dw, group_sizes, M, N, K, C, group_align=BLOCK)
    return dw if dw is out else dw.to(out_dtype)


def _check_into(a_q: Tensor, b_q: Tensor, group_sizes: Tensor, out: Tensor) -> None:
    shape = (group_sizes.shape[0], a_q.shape[0], b_q.shape[0])
    check_tensor("grouped_mm_fp8_wgrad", "out", out, ndim=3, dtypes=(torch.float32,), device=a_q.device)
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"grouped_mm_fp8_wgrad: `out` must be a contiguous float32 [E, N, K] = {list(shape)} tensor, "
                         f"got {list(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")


@torch.library.custom_op("moe_kernels::grouped_mm_fp8_wgrad_into", mutates_args=("out",))
def _grouped_mm_fp8_wgrad_into(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, group_sizes: Tensor,
                               out: Tensor, accumulate: bool) -> None:
    _check_wgrad(a_q, a_scale, b_q, b_scale, group_sizes)
    _check_into(a_q, b_q, group_sizes, out)
    _check_wgrad_sizes(group_sizes, a_q.shape[1])
    dw = grouped_mm_fp8_wgrad_reference(a_q, a_scale, b_q, b_scale, group_sizes)
    out.add_(dw) if accumulate else out.copy_(dw)


@_grouped_mm_fp8_wgrad_into.register_fake
def _(a_q, a_scale, b_q, b_scale, group_sizes, out, accumulate):
    _check_wgrad(a_q, a_scale, b_q, b_scale, group_sizes)
    _check_into(a_q, b_q, group_sizes, out)


@_ext.cuda_impl(_grouped_mm_fp8_wgrad_into)
def _grouped_mm_fp8_wgrad_into_cuda(a_q, a_scale, b_q, b_scale, group_sizes, out, accumulate):
    _check_wgrad(a_q, a_scale, b_q, b_scale, group_sizes)
    _check_into(a_q, b_q, group_sizes, out)
    C = _wgrad_kernels(a_q, group_sizes)
    if C is None:
        dw = grouped_mm_fp8_wgrad_reference(a_q, a_scale, b_q, b_scale, group_sizes)
        out.add_(dw) if accumulate else out.copy_(dw)
        return
    wgrad_into_on(C, tuple(_ext.launch_args(a_q).values()), a_q, a_scale, b_q, b_scale, group_sizes, out, accumulate)


def wgrad_into_on(C, launch: tuple[int, int], a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor,
                  group_sizes: Tensor, out: Tensor, accumulate: bool) -> None:
    """grouped_mm_fp8_wgrad(..., out=out, accumulate=accumulate)'s CUDA path on operands already checked, on
    extension C at `launch` (device, stream), for the op's implementation and the recipe's functions."""
    (N, M), K, E = a_q.shape, b_q.shape[0], group_sizes.shape[0]
    if M == 0 or E == 0 or N == 0 or K == 0:  # no tokens: the product is zero
        if not accumulate:
            out.zero_()
        return
    if _run_wgrad(C, a_q, a_scale, b_q, b_scale, group_sizes, out, accumulate=accumulate, launch=launch):
        return
    # The portable fp32 wgrad, accumulating in its stores as the kernel does in its epilogue.
    _warn_without_fp8_kernel(a_q)
    a = dequantize_fp8(a_q, a_scale, "block", dtype=torch.float32).t().contiguous()
    b = dequantize_fp8(b_q, b_scale, "block", dtype=torch.float32).t().contiguous()
    _launch("wgrad", a, b, out, group_sizes, M, N, K, C, group_align=BLOCK, accumulate=accumulate)


def grouped_mm_fp8_wgrad(
    dout_t_q: Tensor, dout_t_scale: Tensor, x_t_q: Tensor, x_t_scale: Tensor, group_sizes: Tensor,
    out_dtype: torch.dtype = torch.float32, *, out: Tensor | None = None, accumulate: bool = False,
) -> Tensor:
    """The weight gradient in FP8, [E, N, K] in `out_dtype` (float32, or bfloat16: the weight's dtype, the
    fp32 accumulators rounded once, bit for bit a cast of the fp32 result; on the sm_90a kernel in its
    epilogue, with no fp32 copy written, on the fallback by a cast): dW[e] = dout_e^T x_e over group e's
    tokens.

    dout_t_q, dout_t_scale = quantize_fp8_tokens(dout)   # [N, M] E4M3, [N, M / 128]
    x_t_q, x_t_scale = quantize_fp8_tokens(x)            # [K, M] E4M3, [K, M / 128]

    Both operands are quantized along the tokens in 1x128 blocks, so every group's rows must be a
    multiple of 128 (permute(..., align=128)); sizes that are not raise ValueError where they are checked
    (CPU tensors, MOE_KERNELS_CHECK=1), and otherwise give NaN in that expert's gradient on every CUDA path
    (never a silently wrong value). Empty experts give zeros. On sm_90a with M % 16 == 0 and K % 4 == 0
    (K % 8 for bfloat16) this runs CUTLASS's FP8 blockwise ptr-array kernel with the groups splitting K
    (per-group problem shapes, pointers and scale slices written on the device, no host sync), fp32
    accumulators promoted every 128 tokens; on 8.9 and later without it, the tensor-core portable kernel where
    MOE_KERNELS_PORTABLE_MMA=1 (any M and K); elsewhere it dequantizes to fp32 and runs grouped_mm_wgrad.

    out: a contiguous float32 [E, N, K] tensor to write instead (an fp32 main gradient), returned; with
    `accumulate` the product is added into it (out += dW, one fp32 addition per element: bit for bit
    `out + grouped_mm_fp8_wgrad(...)`, on the sm_90a kernel in its epilogue, which reads `out` as its source),
    and empty experts keep their values.
    """
    if out is None:
        if accumulate:
            raise ValueError("grouped_mm_fp8_wgrad: accumulate=True adds into `out`; pass the tensor to add into")
        return _ext.direct(_grouped_mm_fp8_wgrad, dout_t_q, dout_t_q, dout_t_scale, x_t_q, x_t_scale, group_sizes,
                           out_dtype)
    if out_dtype != torch.float32:
        raise ValueError(f"grouped_mm_fp8_wgrad: `out` is float32 (an fp32 main gradient); out_dtype is {out_dtype}")
    torch.ops.moe_kernels.grouped_mm_fp8_wgrad_into(dout_t_q, dout_t_scale, x_t_q, x_t_scale, group_sizes, out,
                                                    bool(accumulate))
    return out
