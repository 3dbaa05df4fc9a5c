"""NVFP4 grouped GEMM (specs/lowprec.md, "NVFP4").

    x_q, x_s, x_g = quantize_nvfp4(x)                       # [M, K/2] codes, [M, K/16] E4M3, fp32 []
    w_q, w_s, w_g = quantize_nvfp4_experts(w)               # [E, N, K/2], [E, N, K/16], one global scale
    out = grouped_mm_nvfp4(x_q, x_s, x_g, w_q, w_s, w_g, group_sizes)   # [M, N]

out[rows of e] = (q_x s_x) @ (q_w[e] s_w[e])^T / (g_x g_w): the block-scaled values (q * s_block, exact in
bf16 and fp32) multiplied with fp32 accumulation, the two global scales applied once at the end. Hopper
has no FP4 tensor cores: this runs the dequantize kernel and the fp32 grouped GEMM, so it is the
faithful numerics of an NVFP4 GEMM (recipe development, checkpoints meant for Blackwell), not a speed-up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels.ops._checks import check_tensor
from moe_kernels.ops.quant import NVFP4_BLOCK, dequantize_nvfp4, quantize_nvfp4

_E4M3 = torch.float8_e4m3fn


def quantize_nvfp4_experts(w: Tensor, *, tile_2d: bool = True, rng: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Expert weights [E, N, K] -> (codes [E, N, K/2], block scales [E, N, K/16], global scale []): one
    global scale for the stacked experts, 16x16 tiles by default (N % 16 == 0, so no tile straddles two
    experts, and the transposed weight quantizes to the same values)."""
    check_tensor("quantize_nvfp4_experts", "w", w, ndim=3)
    E, N, K = w.shape
    if tile_2d and N % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4_experts: 16x16 tiles need N % 16 == 0, got N={N}")
    q, s, g = quantize_nvfp4(w.reshape(E * N, K), tile_2d=tile_2d, rng=rng)
    return q.view(E, N, K // 2), s.view(E, N, K // NVFP4_BLOCK), g


def _block_scaled(q: Tensor, s: Tensor) -> Tensor:
    """q * s_block in fp32: exact (E2M1 x E4M3 has at most 6 significant bits)."""
    return dequantize_nvfp4(q, s, torch.ones((), dtype=torch.float32, device=q.device), dtype=torch.float32)


def grouped_mm_nvfp4(x_q: Tensor, x_scale: Tensor, x_global: Tensor, w_q: Tensor, w_scale: Tensor,
                     w_global: Tensor, group_sizes: Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """[M, N] in out_dtype: group e's rows of dequant(x) @ dequant(w[e])^T (module docstring)."""
    op = "grouped_mm_nvfp4"
    check_tensor(op, "x_q", x_q, ndim=2, dtypes=(torch.uint8,))
    check_tensor(op, "w_q", w_q, ndim=3, dtypes=(torch.uint8,), device=x_q.device)
    M, K2 = x_q.shape
    E, N, Kw2 = w_q.shape
    if Kw2 != K2:
        raise ValueError(f"{op}: `w_q` has K={2 * Kw2}, `x_q` has K={2 * K2}")
    check_tensor(op, "x_scale", x_scale, ndim=2, dtypes=(_E4M3,), device=x_q.device)
    check_tensor(op, "w_scale", w_scale, ndim=3, dtypes=(_E4M3,), device=x_q.device)
    if tuple(x_scale.shape) != (M, 2 * K2 // NVFP4_BLOCK) or tuple(w_scale.shape) != (E, N, 2 * K2 // NVFP4_BLOCK):
        raise ValueError(f"{op}: block scales must be [M, K/16] and [E, N, K/16], got {tuple(x_scale.shape)} and "
                         f"{tuple(w_scale.shape)}")
    for name, g in (("x_global", x_global), ("w_global", w_global)):
        check_tensor(op, name, g, dtypes=(torch.float32,), device=x_q.device)
        if g.numel() != 1:
            raise ValueError(f"{op}: `{name}` must be one fp32 value, got shape {tuple(g.shape)}")
    x = _block_scaled(x_q, x_scale)  # [M, K]
    w = _block_scaled(w_q.reshape(E * N, K2), w_scale.reshape(E * N, -1)).view(E, N, 2 * K2)
    with torch.autocast(x.device.type, enabled=False):  # fp32 even under autocast (the CPU path has matmuls)
        out = torch.ops.moe_kernels.grouped_mm(x, w, group_sizes)
    # Two divisions: 1 / (g_x * g_w) would overflow for tiny amaxes (the scales reach 2688 / 1e-38).
    return (out / x_global.reshape(()) / w_global.reshape(())).to(out_dtype)


def grouped_mm_nvfp4_reference(x_q, x_scale, x_global, w_q, w_scale, w_global, group_sizes) -> Tensor:
    """Dequantize both operands (q * s_block / s_global) in fp64 and multiply per expert: the exact value."""
    E, N, K2 = w_q.shape
    x = dequantize_nvfp4(x_q, x_scale, x_global, dtype=torch.float32).double()
    w = dequantize_nvfp4(w_q.reshape(E * N, K2), w_scale.reshape(E * N, -1), w_global, dtype=torch.float32)
    w = w.double().view(E, N, 2 * K2)
    out = x.new_zeros((x.shape[0], N))
    start = 0
    for e, n in enumerate(group_sizes.tolist()):
        out[start : start + n] = x[start : start + n] @ w[e].T
        start += n
    return out
