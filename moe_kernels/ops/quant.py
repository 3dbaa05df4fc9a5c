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
  x'    = q / scale; a scale of 0 (never produced here: permute's zero-filled padding rows) marks a block of
          zeros, x' = 0 whatever its codes, not 0 / 0 = NaN; grouped_mm_fp8 takes the same rule for the
          zero codes permute writes (its sm_90a kernel multiplies by 1 / scale := 0, so a NaN code there
          would still give NaN)
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


def _check_quant(x: Tensor, granularity: str, fp8_dtype: torch.dtype, pad_to_block: bool = False) -> None:
    op = "quantize_fp8"
    check_tensor(op, "x", x, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    _check_granularity(op, granularity)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: `fp8_dtype` must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if pad_to_block and granularity != "block":
        raise ValueError(f"{op}: `pad_to_block` pads 1x128 blocks' codes (granularity 'block'), got {granularity!r}")


def _q_cols(cols: int, pad_to_block: bool) -> int:
    return -(-cols // BLOCK) * BLOCK if pad_to_block else cols


def fp8_layouts_empty(like: Tensor, R: int, C: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised E4M3 layouts of an [R, C] value, as a dual-layout producer writes them: codes [R, Cp] and
    scales [R, Cp / 128] (Cp = C rounded up to 128), token-major codes [C, Rp] and scales [C, Rp / 128] (Rp = R
    rounded up to 128)."""
    Rp, nb = -(-R // BLOCK) * BLOCK, -(-C // BLOCK)
    return (like.new_empty((R, nb * BLOCK), dtype=torch.float8_e4m3fn), like.new_empty((R, nb), dtype=torch.float32),
            like.new_empty((C, Rp), dtype=torch.float8_e4m3fn), like.new_empty((C, Rp // BLOCK), dtype=torch.float32))


def pad_codes_to_block(q: Tensor) -> Tensor:
    """FP8 codes [..., K] -> [..., ceil(K / 128) * 128], zero codes past K (a copy; q itself where K % 128 == 0)."""
    K = q.shape[-1]
    if K % BLOCK == 0:
        return q
    return torch.nn.functional.pad(q.view(torch.uint8), (0, _q_cols(K, True) - K)).view(q.dtype)


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
    x: Tensor, granularity: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
    pad_to_block: bool = False,
) -> tuple[Tensor, Tensor]:
    M, K = x.shape
    scale = scale_from_amax(_amax(x, granularity), fp8_dtype, pow2_scale)
    fmax = FP8_MAX[fp8_dtype]
    v = x.float() * _expand(scale, granularity, M, K)
    q = v.clamp(-fmax, fmax).to(fp8_dtype)
    q = torch.where(torch.isnan(v), _NAN_FP8, q.view(torch.uint8)).view(fp8_dtype)  # one NaN code
    return (pad_codes_to_block(q) if pad_to_block else q), scale


def quantize_fp8_tokens_reference(t: Tensor, pow2_scale: bool = False) -> tuple[Tensor, Tensor]:
    """[M, C] -> (E4M3 [C, Mp], fp32 [C, Mp / 128]): the transpose zero-padded to Mp = M rounded up to 128, then
    1x128 blocks (along the tokens)."""
    M, C = t.shape
    tt = t.new_zeros((C, -(-M // BLOCK) * BLOCK))
    tt[:, :M] = t.t()
    return quantize_fp8_reference(tt, "block", torch.float8_e4m3fn, pow2_scale)


def fp8_layouts_reference(v: Tensor, pow2_scale: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both E4M3 layouts of v [R, C], as a dual-layout producer writes them (`fp8_layouts_empty`): 1x128 blocks along
    C, the codes zero-padded to a multiple of 128, and 1x128 blocks along the rows, transposed."""
    return (*quantize_fp8_reference(v, "block", torch.float8_e4m3fn, pow2_scale, pad_to_block=True),
            *quantize_fp8_tokens_reference(v, pow2_scale))


def dequantize_fp8_reference(q: Tensor, scale: Tensor, granularity: str, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    M, K = q.shape
    s = _expand(scale, granularity, M, K)
    return torch.where(s == 0, 0.0, q.float() / s).to(dtype)  # scale 0: a block of zeros


# ---------------------------------------------------------------------------------------------------
# Ops


@torch.library.custom_op("moe_kernels::quantize_fp8", mutates_args=())
def _quantize_fp8(x: Tensor, granularity: str, fp8_dtype: torch.dtype, pow2_scale: bool,
                  pad_to_block: bool = False) -> tuple[Tensor, Tensor]:
    _check_quant(x, granularity, fp8_dtype, pad_to_block)
    return quantize_fp8_reference(x, granularity, fp8_dtype, pow2_scale, pad_to_block)


@_quantize_fp8.register_fake
def _(x, granularity, fp8_dtype, pow2_scale, pad_to_block=False):
    _check_quant(x, granularity, fp8_dtype, pad_to_block)
    M, K = x.shape
    return (x.new_empty((M, _q_cols(K, pad_to_block)), dtype=fp8_dtype),
            x.new_empty(scale_shape(granularity, M, K), dtype=torch.float32))


@torch.library.custom_op("moe_kernels::quantize_fp8_tokens", mutates_args=())
def _quantize_fp8_tokens(t: Tensor, pow2_scale: bool) -> tuple[Tensor, Tensor]:
    check_tensor("quantize_fp8_tokens", "t", t, ndim=2, dtypes=CUDA_FLOAT_DTYPES, contiguous=False)
    return quantize_fp8_tokens_reference(t, pow2_scale)


@_quantize_fp8_tokens.register_fake
def _(t, pow2_scale):
    check_tensor("quantize_fp8_tokens", "t", t, ndim=2, dtypes=CUDA_FLOAT_DTYPES, contiguous=False)
    M, C = t.shape
    Mp = -(-M // BLOCK) * BLOCK
    return t.new_empty((C, Mp), dtype=torch.float8_e4m3fn), t.new_empty((C, Mp // BLOCK), dtype=torch.float32)


@torch.library.custom_op("moe_kernels::dequantize_fp8", mutates_args=())
def _dequantize_fp8(q: Tensor, scale: Tensor, granularity: str, dtype: torch.dtype) -> Tensor:
    _check_dequant(q, scale, granularity, dtype)
    return dequantize_fp8_reference(q, scale, granularity, dtype)


@_dequantize_fp8.register_fake
def _(q, scale, granularity, dtype):
    _check_dequant(q, scale, granularity, dtype)
    return torch.empty_like(q, dtype=dtype)


@_ext.cuda_impl(_quantize_fp8)
def _quantize_fp8_cuda(x, granularity, fp8_dtype, pow2_scale, pad_to_block=False):
    _check_quant(x, granularity, fp8_dtype, pad_to_block)
    C = _ext.kernels("quantize_fp8", x)
    if C is None:
        return quantize_fp8_reference(x, granularity, fp8_dtype, pow2_scale, pad_to_block)
    M, K = x.shape
    Kq = _q_cols(K, pad_to_block)
    q = torch.empty((M, Kq), dtype=fp8_dtype, device=x.device)
    scale = torch.empty(scale_shape(granularity, M, K), dtype=torch.float32, device=x.device)
    amax = torch.empty((1,), dtype=torch.int32, device=x.device) if granularity == "tensor" else None
    C.fp8_quantize(
        x=_ext.ptr(x), q=_ext.ptr(q), scale=scale.data_ptr(), amax=_ext.ptr(amax), rows=M, cols=K,
        granularity=_GRANULARITY_CODES[granularity], e5m2=fp8_dtype == torch.float8_e5m2, pow2=pow2_scale,
        dtype=_ext.dtype_code(x.dtype), **_ext.launch_args(x), q_cols=Kq,
    )
    return q, scale


@_ext.cuda_impl(_quantize_fp8_tokens)
def _quantize_fp8_tokens_cuda(t, pow2_scale):
    check_tensor("quantize_fp8_tokens", "t", t, ndim=2, dtypes=CUDA_FLOAT_DTYPES, contiguous=False)
    C = _ext.kernels("quantize_fp8_tokens", t)
    if C is None:
        return quantize_fp8_tokens_reference(t, pow2_scale)
    t = t.contiguous()
    M, K = t.shape
    Mp = -(-M // BLOCK) * BLOCK
    q = torch.empty((K, Mp), dtype=torch.float8_e4m3fn, device=t.device)  # 16-byte aligned rows: Mp % 128 == 0
    scale = torch.empty((K, Mp // BLOCK), dtype=torch.float32, device=t.device)
    C.fp8_quantize_tokens(x=_ext.ptr(t), q=_ext.ptr(q), scale=_ext.ptr(scale), rows=M, cols=K, e5m2=False,
                          pow2=pow2_scale, dtype=_ext.dtype_code(t.dtype), **_ext.launch_args(t))
    return q, scale


@_ext.cuda_impl(_dequantize_fp8)
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
    x: Tensor, granularity: str = "block", *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
    pad_to_block: bool = False,
) -> tuple[Tensor, Tensor]:
    """FP8 with current scaling. x: [M, K] fp32/bf16/fp16. Returns (q [M, K] fp8, scale fp32) with the scale
    shape of `granularity` ("tensor", "row", "block" = 1x128 along K, "tile" = 128x128); q = fp8(x * scale).

    pad_to_block ("block" only): q is [M, ceil(K / 128) * 128], its codes past K zeros (the scales as without
    it, [M, ceil(K / 128)]), written in the same pass: the operand of grouped_mm_fp8 where K is no multiple of
    128, zero-padded as that op requires."""
    return _ext.direct(_quantize_fp8, x, x, granularity, fp8_dtype, bool(pow2_scale), bool(pad_to_block))


def dequantize_fp8(q: Tensor, scale: Tensor, granularity: str = "block", *, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """q / scale in `dtype`, the inverse of quantize_fp8 up to the FP8 rounding; 0 where the scale is 0 (a block
    of zeros, e.g. permute's padding rows)."""
    return torch.ops.moe_kernels.dequantize_fp8(q, scale, granularity, dtype)


# ===================================================================================================
# NVFP4 (specs/lowprec.md, "NVFP4")
#
#   packed, block_scale, global_scale = quantize_nvfp4(x)                      # activations: 1x16 blocks
#   packed, block_scale, global_scale = quantize_nvfp4(w, tile_2d=True)        # weights: 16x16 tiles
#   g = quantize_nvfp4(grad, rng=torch.tensor([seed, offset], device=...))     # stochastic rounding
#
# x [M, K] with K % 16 == 0 -> packed [M, K / 2] uint8 (two E2M1 codes per byte, the first element in the
# low nibble), block_scale [M, K / 16] float8_e4m3fn (2-D tiles: each tile's scale repeated on its 16
# rows), global_scale [] fp32. Order of operations (the kernels match it bit for bit):
#   s_global = 2688 / amax (amax of x unless `global_amax` is given; 1 when 0 or not finite; clamped to
#              the largest float)
#   s_block  = e4m3(block_amax / 6 * s_global), saturated at 448
#   r        = s_global / float(s_block); a block whose s_block is 0 encodes as all zeros
#   q        = e2m1(x * r): round-to-nearest-even on {0, .5, 1, 1.5, 2, 3, 4, 6} saturating at 6, or
#              stochastic (with `rng`): the grid point above |v| with probability (|v| - lo) / (hi - lo),
#              decided by 24 bits of Philox4x32-10 keyed by the seed, counter (element index // 4, offset),
#              word element index % 4; the caller advances the offset (a device tensor, so a CUDA graph
#              replays with the offset it finds)
#   x'       = q * float(s_block) / s_global: the block scale multiplies, so a zero one (permute's padding
#              rows) gives zeros, as FP8's zero-scale rule does
# A NaN makes its block's (or 2-D tile's) scale NaN (0x7f) and every code there 0: the whole block
# dequantizes to NaN. On Hopper there is no FP4 tensor-core
# math: the value of NVFP4 there is the numerics (recipe development, checkpoints for Blackwell) and
# 4x smaller tensors, not speed.

NVFP4_BLOCK = 16
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MASK32 = 0xFFFFFFFF


def _check_nvfp4(x: Tensor, global_amax: Tensor | None, tile_2d: bool, rng: Tensor | None) -> None:
    op = "quantize_nvfp4"
    check_tensor(op, "x", x, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    if x.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"{op}: `x` needs a multiple of {NVFP4_BLOCK} columns (blocks along K), got {x.shape[1]}")
    if global_amax is not None:
        check_tensor(op, "global_amax", global_amax, dtypes=(torch.float32,), device=x.device)
        if global_amax.numel() != 1:
            raise ValueError(f"{op}: `global_amax` must hold one value, got shape {tuple(global_amax.shape)}")
    if rng is not None:
        check_tensor(op, "rng", rng, ndim=1, dtypes=(torch.int64,), device=x.device)
        if rng.shape[0] != 2:
            raise ValueError(f"{op}: `rng` must be [seed, offset], got shape {tuple(rng.shape)}")


def _check_nvfp4_dequant(packed: Tensor, block_scale: Tensor, global_scale: Tensor, dtype: torch.dtype) -> None:
    op = "dequantize_nvfp4"
    check_tensor(op, "packed", packed, ndim=2, dtypes=(torch.uint8,))
    M, half = packed.shape
    check_tensor(op, "block_scale", block_scale, ndim=2, dtypes=(torch.float8_e4m3fn,), device=packed.device)
    if half % (NVFP4_BLOCK // 2) or tuple(block_scale.shape) != (M, half * 2 // NVFP4_BLOCK):
        raise ValueError(f"{op}: `block_scale` must be [{M}, {half * 2 // NVFP4_BLOCK}] for `packed` {tuple(packed.shape)}, "
                         f"got {tuple(block_scale.shape)}")
    check_tensor(op, "global_scale", global_scale, dtypes=(torch.float32,), device=packed.device)
    if global_scale.numel() != 1:
        raise ValueError(f"{op}: `global_scale` must hold one value, got shape {tuple(global_scale.shape)}")
    if dtype not in CUDA_FLOAT_DTYPES:
        raise TypeError(f"{op}: `dtype` must be float32, float16 or bfloat16, got {dtype}")


def _mulhilo32(m: int, a: Tensor) -> tuple[Tensor, Tensor]:
    """(low, high) 32-bit halves of m * a for a in [0, 2^32) held in int64, without overflowing int64."""
    p_lo = (a & 0xFFFF) * m  # < 2^48
    p_hi = (a >> 16) * m  # < 2^48
    mid = p_lo + ((p_hi & 0xFFFF) << 16)
    return mid & _MASK32, ((p_hi >> 16) + (mid >> 32)) & _MASK32


def philox4x32(counter_lo: Tensor, counter_hi: int, offset: int, seed: int) -> Tensor:
    """Philox4x32-10 on counters (counter_lo | counter_hi << 32, offset): [n, 4] words in [0, 2^32) as int64."""
    c0 = counter_lo & _MASK32
    c1 = torch.full_like(c0, counter_hi & _MASK32) if isinstance(counter_hi, int) else counter_hi & _MASK32
    offset &= 0xFFFFFFFFFFFFFFFF
    seed &= 0xFFFFFFFFFFFFFFFF
    c2 = torch.full_like(c0, offset & _MASK32)
    c3 = torch.full_like(c0, offset >> 32)
    k0, k1 = seed & _MASK32, seed >> 32
    for _ in range(10):
        lo0, hi0 = _mulhilo32(0xD2511F53, c0)
        lo1, hi1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return torch.stack([c0, c1, c2, c3], -1)


def _random_bits(M: int, K: int, seed: int, offset: int, device) -> Tensor:
    """[M, K] int64: the 32 random bits of each element (Philox word element % 4 of group element // 4)."""
    groups = torch.arange(M * K // 4, dtype=torch.int64, device=device)
    return philox4x32(groups & _MASK32, groups >> 32, offset, seed).reshape(M, K)


def _e2m1_rne(a: Tensor) -> Tensor:
    t = (a > 0.25).long() + (a >= 0.75).long() + (a > 1.25).long() + (a >= 1.75).long()
    return t + (a > 2.5).long() + (a >= 3.5).long() + (a > 5.0).long()


def _e2m1_stochastic(a: Tensor, bits: Tensor) -> Tensor:
    lo = sum((a >= g).long() for g in _E2M1_GRID[1:])
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=a.device)
    lo_v, hi_v = grid[lo.clamp(max=6)], grid[(lo + 1).clamp(max=7)]
    frac = (a - lo_v) / (hi_v - lo_v)  # exact: the spacing is a power of two
    up = (bits >> 8).float() < frac * 16777216.0
    return torch.where((lo == 7) | torch.isnan(a), lo, lo + up.long())


def quantize_nvfp4_reference(
    x: Tensor, global_amax: Tensor | None = None, tile_2d: bool = False, rng: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    M, K = x.shape
    nb = K // NVFP4_BLOCK
    xf = x.float()
    if global_amax is not None:
        amax = global_amax.float().reshape(())
    else:
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
    ok = torch.isfinite(amax) & (amax > 0)
    sg = torch.where(ok, (torch.full_like(amax, 2688.0) / torch.where(ok, amax, 1.0)).clamp(max=_FLT_MAX), 1.0)
    blocks = xf.view(M, nb, NVFP4_BLOCK)
    if tile_2d:
        mb = -(-M // NVFP4_BLOCK)
        padded = torch.nn.functional.pad(xf.abs(), (0, 0, 0, mb * NVFP4_BLOCK - M))
        tiles = padded.view(mb, NVFP4_BLOCK, nb, NVFP4_BLOCK).amax((1, 3)) if mb and nb else xf.new_zeros((mb, nb))
        bamax = tiles.repeat_interleave(NVFP4_BLOCK, 0)[:M]
    else:
        bamax = blocks.abs().amax(-1) if M and nb else xf.new_zeros((M, nb))
    t = (bamax / torch.full_like(bamax, 6.0)) * sg.expand_as(bamax)
    sb = t.clamp(max=448.0).to(torch.float8_e4m3fn)
    sb = torch.where(torch.isnan(t), _NAN_FP8, sb.view(torch.uint8)).view(torch.float8_e4m3fn)
    sbf = sb.float()
    nonzero = sbf != 0
    rs = torch.where(nonzero, sg.expand_as(sbf) / torch.where(nonzero, sbf, 1.0), 0.0)
    v = blocks * rs[..., None].expand_as(blocks)
    a = v.abs()
    if rng is None:
        mag = _e2m1_rne(a)
    else:
        seed, offset = (int(t) for t in rng.tolist())
        mag = _e2m1_stochastic(a, _random_bits(M, K, seed, offset, x.device).view(M, nb, NVFP4_BLOCK))
    sign = (torch.signbit(v) & ~torch.isnan(v)).long() * 8
    codes = torch.where(nonzero[..., None], mag | sign, 0).view(M, K)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, sb, sg


def dequantize_nvfp4_reference(packed: Tensor, block_scale: Tensor, global_scale: Tensor,
                               dtype: torch.dtype = torch.bfloat16) -> Tensor:
    M, half = packed.shape
    K = half * 2
    p = packed.long()
    codes = torch.stack([p & 0xF, p >> 4], -1).view(M, K)
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=packed.device)
    q = torch.where(codes >= 8, -grid[codes & 7], grid[codes & 7])
    sbf = block_scale.float().repeat_interleave(NVFP4_BLOCK, 1)
    out = (q * sbf) / global_scale.float().reshape(()).expand(M, K)
    return out.to(dtype)


@torch.library.custom_op("moe_kernels::quantize_nvfp4", mutates_args=())
def _quantize_nvfp4(
    x: Tensor, global_amax: Tensor | None, tile_2d: bool, rng: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    _check_nvfp4(x, global_amax, tile_2d, rng)
    return quantize_nvfp4_reference(x, global_amax, tile_2d, rng)


@_quantize_nvfp4.register_fake
def _(x, global_amax, tile_2d, rng):
    _check_nvfp4(x, global_amax, tile_2d, rng)
    M, K = x.shape
    return (x.new_empty((M, K // 2), dtype=torch.uint8),
            x.new_empty((M, K // NVFP4_BLOCK), dtype=torch.float8_e4m3fn),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("moe_kernels::dequantize_nvfp4", mutates_args=())
def _dequantize_nvfp4(packed: Tensor, block_scale: Tensor, global_scale: Tensor, dtype: torch.dtype) -> Tensor:
    _check_nvfp4_dequant(packed, block_scale, global_scale, dtype)
    return dequantize_nvfp4_reference(packed, block_scale, global_scale, dtype)


@_dequantize_nvfp4.register_fake
def _(packed, block_scale, global_scale, dtype):
    _check_nvfp4_dequant(packed, block_scale, global_scale, dtype)
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


@_ext.cuda_impl(_quantize_nvfp4)
def _quantize_nvfp4_cuda(x, global_amax, tile_2d, rng):
    _check_nvfp4(x, global_amax, tile_2d, rng)
    C = _ext.kernels("quantize_nvfp4", x)
    if C is None:
        return quantize_nvfp4_reference(x, global_amax, tile_2d, rng)
    M, K = x.shape
    packed = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    block_scale = torch.empty((M, K // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    global_scale = torch.empty((), dtype=torch.float32, device=x.device)
    scratch = torch.empty((1,), dtype=torch.int32, device=x.device) if global_amax is None else None
    tile_amax = (torch.empty((-(-M // NVFP4_BLOCK), K // NVFP4_BLOCK), dtype=torch.float32, device=x.device)
                 if tile_2d else None)
    C.nvfp4_quantize(
        x=_ext.ptr(x), packed=_ext.ptr(packed), block_scale=_ext.ptr(block_scale), global_scale=global_scale.data_ptr(),
        amax=_ext.ptr(global_amax), amax_scratch=_ext.ptr(scratch), tile_amax=_ext.ptr(tile_amax), rng=_ext.ptr(rng),
        rows=M, cols=K, tile_2d=tile_2d, dtype=_ext.dtype_code(x.dtype), **_ext.launch_args(x),
    )
    return packed, block_scale, global_scale


@_ext.cuda_impl(_dequantize_nvfp4)
def _dequantize_nvfp4_cuda(packed, block_scale, global_scale, dtype):
    _check_nvfp4_dequant(packed, block_scale, global_scale, dtype)
    C = _ext.kernels("dequantize_nvfp4", packed)
    if C is None:
        return dequantize_nvfp4_reference(packed, block_scale, global_scale, dtype)
    if packed.data_ptr() % 8:
        packed = packed.clone()  # the kernel reads 8 bytes (one block) at a time
    M, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((M, K), dtype=dtype, device=packed.device)
    C.nvfp4_dequantize(
        packed=_ext.ptr(packed), block_scale=_ext.ptr(block_scale), global_scale=global_scale.data_ptr(),
        out=_ext.ptr(out), rows=M, cols=K, dtype=_ext.dtype_code(dtype), **_ext.launch_args(packed),
    )
    return out


def quantize_nvfp4(
    x: Tensor, *, global_amax: Tensor | None = None, tile_2d: bool = False, rng: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4: x [M, K] (K % 16 == 0) -> (packed [M, K/2] uint8, block_scale [M, K/16] e4m3, global_scale []).

    global_amax: the tensor's amax if known (skips a pass over x). tile_2d: one scale per 16x16 tile (weights,
    so the row- and column-wise quantized values agree). rng: int64 [seed, offset] on x's device turns on
    stochastic rounding (gradients); advance the offset between calls."""
    return torch.ops.moe_kernels.quantize_nvfp4(x, global_amax, bool(tile_2d), rng)


def dequantize_nvfp4(packed: Tensor, block_scale: Tensor, global_scale: Tensor, *,
                     dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """q * float(block_scale) / global_scale as [M, K] in `dtype`."""
    return torch.ops.moe_kernels.dequantize_nvfp4(packed, block_scale, global_scale, dtype)
