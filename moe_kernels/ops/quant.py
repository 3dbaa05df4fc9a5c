"""FP8 quantization with current scaling (specs/lowprec.md, "FP8 scaling recipes").

    q, scale = quantize_fp8(x, "block")            # DeepSeek-V3 activations: one scale per 1x128 along K
    w8, ws = quantize_fp8(w, "tile")               # weights: one scale per 128x128 tile
    x2 = dequantize_fp8(q, scale, "block", dtype=torch.bfloat16)

Granularities of `x` [M, K] and the shape of `scale` (fp32):
  "tensor"  []                           one amax over the whole tensor
  "row"     [M]                          one per row (what torch._scaled_grouped_mm takes on Hopper)
  "block"   [M, ceil(K / 128)]           one per 1x128 block along K
  "tile"    [ceil(M / 128), ceil(K / 128)]  one per 128x128 tile

Rules (bit-exact between the reference and the kernels):
  scale = fmax / amax, fmax = 448 (E4M3) or 57344 (E5M2); amax 0, inf or NaN -> 1; a quotient past the fp32
          range is clamped to the largest finite float; with pow2_scale, rounded down to a power of two
  q     = fp8(x * scale), round-to-nearest-even, saturated to +-fmax; NaN -> NaN (0x7f)
  x'    = q / scale
`scale` multiplies on the way in and divides on the way out; a GEMM on the quantized operands takes 1 / scale.
Last blocks and tiles may be partial (K or M not a multiple of 128): their amax covers the elements present.
The ops have no autograd (they are the building blocks of a precision recipe's own autograd function).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext
from moe_kernels.ops._checks import CUDA_FLOAT_DTYPES, check_tensor

BLOCK = 128
GRANULARITIES = ("tensor", "row", "block", "tile")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_GRANULARITY_CODES = {g: i for i, g in enumerate(GRANULARITIES)}
_NAN_FP8 = 0x7F
_FLT_MAX = torch.finfo(torch.float32).max


def scale_shape(granularity: str, rows: int, cols: int) -> tuple[int, ...]:
    nb = -(-cols // BLOCK)
    return {"tensor": (), "row": (rows,), "block": (rows, nb), "tile": (-(-rows // BLOCK), nb)}[granularity]


# ---------------------------------------------------------------------------------------------------
# Validation


def _check_granularity(op: str, granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"{op}: `granularity` must be one of {GRANULARITIES}, got {granularity!r}")


def _check_quant(x: Tensor, granularity: str, fp8_dtype: torch.dtype) -> None:
    op = "quantize_fp8"
    check_tensor(op, "x", x, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    _check_granularity(op, granularity)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: `fp8_dtype` must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")


def _check_dequant(q: Tensor, scale: Tensor, granularity: str, dtype: torch.dtype) -> None:
    op = "dequantize_fp8"
    check_tensor(op, "q", q, ndim=2, dtypes=FP8_DTYPES)
    _check_granularity(op, granularity)
    check_tensor(op, "scale", scale, dtypes=(torch.float32,), device=q.device)
    want = scale_shape(granularity, *q.shape)
    if tuple(scale.shape) != want:
        raise ValueError(f"{op}: `scale` must have shape {want} for granularity {granularity!r}, got {tuple(scale.shape)}")
    if dtype not in CUDA_FLOAT_DTYPES:
        raise TypeError(f"{op}: `dtype` must be float32, float16 or bfloat16, got {dtype}")


# ---------------------------------------------------------------------------------------------------
# Reference


def _amax(x: Tensor, granularity: str) -> Tensor:
    """fp32 amax of |x| per scale, NaN propagating (torch.amax does)."""
    a = x.float().abs()
    M, K = a.shape
    if granularity == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())
    if granularity == "row":
        return a.amax(1) if K else a.new_zeros((M,))
    nb = -(-K // BLOCK)
    padded = torch.nn.functional.pad(a, (0, nb * BLOCK - K))  # zeros never raise an amax
    if granularity == "block":
        return padded.view(M, nb, BLOCK).amax(-1) if M and nb else a.new_zeros((M, nb))
    mb = -(-M // BLOCK)
    padded = torch.nn.functional.pad(padded, (0, 0, 0, mb * BLOCK - M))
    return padded.view(mb, BLOCK, nb, BLOCK).amax((1, 3)) if mb and nb else a.new_zeros((mb, nb))


def scale_from_amax(amax: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool) -> Tensor:
    ok = torch.isfinite(amax) & (amax > 0)
    # tensor / tensor: one correctly rounded division (python_scalar / tensor would be reciprocal * scalar)
    quotient = torch.full_like(amax, FP8_MAX[fp8_dtype]) / torch.where(ok, amax, 1.0)
    s = torch.where(ok, quotient.clamp(max=_FLT_MAX), 1.0)
    if pow2_scale:  # keep the exponent bits: 2^floor(log2(s)) for the positive normal scales used here
        s = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    return s


def _expand(scale: Tensor, granularity: str, rows: int, cols: int) -> Tensor:
    """Each element's scale, [rows, cols]."""
    if granularity == "tensor":
        return scale.expand(rows, cols)
    if granularity == "row":
        return scale[:, None].expand(rows, cols)
    cb = torch.arange(cols, device=scale.device) // BLOCK
    if granularity == "block":
        return scale[:, cb]
    rb = torch.arange(rows, device=scale.device) // BLOCK
    return scale[rb][:, cb]


def quantize_fp8_reference(
    x: Tensor, granularity: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False
) -> tuple[Tensor, Tensor]:
    M, K = x.shape
    scale = scale_from_amax(_amax(x, granularity), fp8_dtype, pow2_scale)
    fmax = FP8_MAX[fp8_dtype]
    v = x.float() * _expand(scale, granularity, M, K)
    q = v.clamp(-fmax, fmax).to(fp8_dtype)
    q = torch.where(torch.isnan(v), _NAN_FP8, q.view(torch.uint8)).view(fp8_dtype)  # one NaN code
    return q, scale


def dequantize_fp8_reference(q: Tensor, scale: Tensor, granularity: str, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    M, K = q.shape
    return (q.float() / _expand(scale, granularity, M, K)).to(dtype)


# ---------------------------------------------------------------------------------------------------
# Ops


@torch.library.custom_op("moe_kernels::quantize_fp8", mutates_args=())
def _quantize_fp8(x: Tensor, granularity: str, fp8_dtype: torch.dtype, pow2_scale: bool) -> tuple[Tensor, Tensor]:
    _check_quant(x, granularity, fp8_dtype)
    return quantize_fp8_reference(x, granularity, fp8_dtype, pow2_scale)


@_quantize_fp8.register_fake
def _(x, granularity, fp8_dtype, pow2_scale):
    _check_quant(x, granularity, fp8_dtype)
    return (torch.empty_like(x, dtype=fp8_dtype),
            x.new_empty(scale_shape(granularity, *x.shape), dtype=torch.float32))


@torch.library.custom_op("moe_kernels::dequantize_fp8", mutates_args=())
def _dequantize_fp8(q: Tensor, scale: Tensor, granularity: str, dtype: torch.dtype) -> Tensor:
    _check_dequant(q, scale, granularity, dtype)
    return dequantize_fp8_reference(q, scale, granularity, dtype)


@_dequantize_fp8.register_fake
def _(q, scale, granularity, dtype):
    _check_dequant(q, scale, granularity, dtype)
    return torch.empty_like(q, dtype=dtype)


@_quantize_fp8.register_kernel("cuda")
def _quantize_fp8_cuda(x, granularity, fp8_dtype, pow2_scale):
    _check_quant(x, granularity, fp8_dtype)
    C = _ext.kernels("quantize_fp8", x)
    if C is None:
        return quantize_fp8_reference(x, granularity, fp8_dtype, pow2_scale)
    M, K = x.shape
    q = torch.empty_like(x, dtype=fp8_dtype)
    scale = torch.empty(scale_shape(granularity, M, K), dtype=torch.float32, device=x.device)
    amax = torch.empty((1,), dtype=torch.int32, device=x.device) if granularity == "tensor" else None
    C.fp8_quantize(
        x=_ext.ptr(x), q=_ext.ptr(q), scale=scale.data_ptr(), amax=_ext.ptr(amax), rows=M, cols=K,
        granularity=_GRANULARITY_CODES[granularity], e5m2=fp8_dtype == torch.float8_e5m2, pow2=pow2_scale,
        dtype=_ext.dtype_code(x.dtype), **_ext.launch_args(x),
    )
    return q, scale


@_dequantize_fp8.register_kernel("cuda")
def _dequantize_fp8_cuda(q, scale, granularity, dtype):
    _check_dequant(q, scale, granularity, dtype)
    C = _ext.kernels("dequantize_fp8", q)
    if C is None:
        return dequantize_fp8_reference(q, scale, granularity, dtype)
    M, K = q.shape
    out = torch.empty_like(q, dtype=dtype)
    C.fp8_dequantize(
        q=_ext.ptr(q), scale=_ext.ptr(scale), out=_ext.ptr(out), rows=M, cols=K,
        granularity=_GRANULARITY_CODES[granularity], e5m2=q.dtype == torch.float8_e5m2,
        dtype=_ext.dtype_code(dtype), **_ext.launch_args(q),
    )
    return out


# ---------------------------------------------------------------------------------------------------
# Public API


def quantize_fp8(
    x: Tensor, granularity: str = "block", *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False
) -> tuple[Tensor, Tensor]:
    """FP8 with current scaling. x: [M, K] fp32/bf16/fp16. Returns (q [M, K] fp8, scale fp32) with the scale
    shape of `granularity` ("tensor", "row", "block" = 1x128 along K, "tile" = 128x128); q = fp8(x * scale)."""
    return torch.ops.moe_kernels.quantize_fp8(x, granularity, fp8_dtype, bool(pow2_scale))


def dequantize_fp8(q: Tensor, scale: Tensor, granularity: str = "block", *, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """q / scale in `dtype`, the inverse of quantize_fp8 up to the FP8 rounding."""
    return torch.ops.moe_kernels.dequantize_fp8(q, scale, granularity, dtype)
