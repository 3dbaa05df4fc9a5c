"""NVFP4 grouped GEMM (specs/lowprec.md, "NVFP4").

    x_q, x_s, x_g = quantize_nvfp4(x)                       # [M, K/2] codes, [M, K/16] E4M3, fp32 []
    w_q, w_s, w_g = quantize_nvfp4_experts(w)               # [E, N, K/2], [E, N, K/16], one global scale
    out = grouped_mm_nvfp4(x_q, x_s, x_g, w_q, w_s, w_g, group_sizes)   # [M, N]

out[rows of e] = (q_x s_x) @ (q_w[e] s_w[e])^T / (g_x g_w): the block-scaled values (q * s_block, exact in
bf16 and fp32) multiplied with fp32 accumulation, the two global scales applied once at the end. Hopper
has no FP4 tensor cores: this runs the dequantize kernel and the fp32 grouped GEMM, so it is the
faithful numerics of an NVFP4 GEMM (recipe development, checkpoints meant for Blackwell), not a speed-up.

On a 10.0/10.3 GPU (B200, B300) with the sm_100f instances opted in (MOE_KERNELS_SM100_CUTLASS=1) it runs the
block-scaled NVFP4 kernel instead (tcgen05 MMAs on the E2M1 codes with their E4M3 scales, csrc/gemm/sm100/
nvfp4_sm100.cuh): the same value up to fp32 accumulation order, the scales first converted into CUTLASS's blocked
layout (nvfp4_blocked_scales) and the two global scales applied as one epilogue factor. It has not run on a
Blackwell GPU yet.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels.ops._checks import check_tensor
from moe_kernels.ops.quant import NVFP4_BLOCK, dequantize_nvfp4, quantize_nvfp4

_E4M3 = torch.float8_e4m3fn
_NVFP4 = 6  # the extension's dtype code for E2M1 codes, two a byte (csrc/common/dtype.h)
_FP32 = 0
_FWD = 0
_SM100_NVFP4_PATH = 7


def quantize_nvfp4_experts(w: Tensor, *, tile_2d: bool = True, rng: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Expert weights [E, N, K] -> (codes [E, N, K/2], block scales [E, N, K/16], global scale []): one
    global scale for the stacked experts, 16x16 tiles by default (N % 16 == 0, so no tile straddles two
    experts, and the transposed weight quantizes to the same values)."""
    check_tensor("quantize_nvfp4_experts", "w", w, ndim=3)
    E, N, K = w.shape
    if tile_2d and N % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4_experts: 16x16 tiles need N % 16 == 0 (`w` is [E, N, K]), got N={N}")
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
        raise ValueError(f"{op}: block scales `x_scale` and `w_scale` must be [M, K/16] and [E, N, K/16], got {tuple(x_scale.shape)} and "
                         f"{tuple(w_scale.shape)}")
    for name, g in (("x_global", x_global), ("w_global", w_global)):
        check_tensor(op, name, g, dtypes=(torch.float32,), device=x_q.device)
        if g.numel() != 1:
            raise ValueError(f"{op}: `{name}` must be one fp32 value, got shape {tuple(g.shape)}")
    from moe_kernels.ops.grouped_mm import _check_group_sizes

    _check_group_sizes(op, group_sizes, E, x_q.device)
    if x_q.device.type == "cuda" and out_dtype == torch.bfloat16:
        out = _launch_sm100(x_q, x_scale, x_global, w_q, w_scale, w_global, group_sizes)
        if out is not None:
            return out
    x = _block_scaled(x_q, x_scale)  # [M, K]
    w = _block_scaled(w_q.reshape(E * N, K2), w_scale.reshape(E * N, -1)).view(E, N, 2 * K2)
    with torch.autocast(x.device.type, enabled=False):  # fp32 even under autocast (the CPU path has matmuls)
        out = torch.ops.moe_kernels.grouped_mm(x, w, group_sizes)
    # Two divisions: 1 / (g_x * g_w) would overflow for tiny amaxes (the scales reach 2688 / 1e-38).
    return (out / x_global.reshape(()) / w_global.reshape(())).to(out_dtype)


def _launch_sm100(x_q, x_scale, x_global, w_q, w_scale, w_global, group_sizes) -> Tensor | None:
    """The sm_100f block-scaled kernel's [M, N] bf16 output, or None where it does not run (not a 10.0/10.3 GPU,
    not opted in, or the shape does not fit: K % 32, N % 8, 16-byte aligned codes)."""
    from moe_kernels import _ext

    C = _ext.kernels("grouped_mm_nvfp4", x_q)
    if C is None or not hasattr(C, "grouped_mm_nvfp4_blocked_scales"):
        return None
    M, K = x_q.shape[0], 2 * x_q.shape[1]
    E, N = w_q.shape[0], w_q.shape[1]
    if E > C.grouped_mm_max_groups:
        return None
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x_q.device)
    x_global, w_global = x_global.reshape(1).contiguous(), w_global.reshape(1).contiguous()
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    shape = dict(op=_FWD, dtype=_NVFP4, num_groups=E, M=M, N=N, K=K, a=x_q.data_ptr(), b=w_q.data_ptr(),
                 d=out.data_ptr(), device=_ext.launch_args(x_q)["device"], sfa=x_scale.data_ptr(),
                 sfb=w_scale.data_ptr(), a_global=x_global.data_ptr(), b_global=w_global.data_ptr())
    if M == 0 or N == 0 or C.grouped_mm_path(**shape) != _SM100_NVFP4_PATH:
        return None
    nbytes = C.grouped_mm_workspace_bytes(**shape)
    ws, ws_ptr = _ext.workspace(nbytes, x_q)
    problem = {k: v for k, v in shape.items() if k != "device"}
    C.grouped_mm(**problem, group_sizes=group_sizes.data_ptr(), workspace=ws_ptr, workspace_bytes=nbytes,
                 **_ext.launch_args(x_q))
    return out


def nvfp4_blocked_scales(scale: Tensor, group_sizes: Tensor | None = None, *, K: int | None = None) -> Tensor:
    """NVFP4 block scales (E4M3, row-major [rows, K/16] as quantize_nvfp4 writes them; [E, N, K/16] for expert
    weights) in the blocked layout the sm_100f kernel reads, as the kernel grouped_mm runs writes it (uint8, one
    atom of 512 bytes per 128 rows x 4 scales, atoms K-block-major): with group_sizes, the rows of each group
    padded to 128 (M / 128 + E atom rows allocated; those past the groups' are left unwritten, zeros here);
    for [E, N, K/16], each expert's N rows padded to 128. For tests; nvfp4_blocked_scales_reference defines it."""
    from moe_kernels import _ext

    C = _ext.kernels("grouped_mm_nvfp4", scale)
    if C is None:
        raise RuntimeError("nvfp4_blocked_scales needs the extension's kernels on this device")
    src = scale.contiguous().view(torch.uint8)
    K = K or 16 * scale.shape[-1]
    dev = _ext.launch_args(scale)
    if group_sizes is None:
        E, N = scale.shape[0], scale.shape[1]
        M, rows = 0, E * ((N + 127) // 128)
    else:
        E, N, M = group_sizes.shape[0], 1, scale.shape[0]
        rows = (M + 127) // 128 + E
    dst = torch.zeros(C.grouped_mm_nvfp4_scale_atoms(rows, K) * 512, dtype=torch.uint8, device=scale.device)
    ws_bytes = C.grouped_mm_workspace_bytes(op=_FWD, dtype=_FP32, num_groups=E, M=M, N=N, K=K, a=0, b=0, d=0,
                                            device=dev["device"])
    ws, ws_ptr = _ext.workspace(ws_bytes, scale)
    C.grouped_mm_nvfp4_blocked_scales(src=src.data_ptr(), dst=dst.data_ptr(),
                                      group_sizes=0 if group_sizes is None else group_sizes.data_ptr(), num_groups=E,
                                      M=M, N=N, K=K, workspace=ws_ptr, workspace_bytes=ws_bytes, **dev)
    return dst


def nvfp4_blocked_scales_reference(scale: Tensor, group_sizes: Tensor | None = None) -> Tensor:
    """nvfp4_blocked_scales' definition (CUTLASS's Sm1xxBlockScaledConfig with 16-element vectors): atom (t, j)
    at byte (t * ceil(C / 4) + j) * 512 holds rows 128 t .. of its group and scales 4 j .. 4 j + 3; row i of the
    atom, scale c at (i % 32) * 16 + (i // 32) * 4 + c. Padding rows and scales are 0."""
    src = scale.view(torch.uint8).reshape(-1, scale.shape[-1]).cpu()
    C = src.shape[1]
    kb = (C + 3) // 4
    if group_sizes is None:
        E, N = scale.shape[0], scale.shape[1]
        spans = [(e * N, N) for e in range(E)]
        total_rows = E * ((N + 127) // 128)
    else:
        M = src.shape[0]
        ends = group_sizes.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=M).tolist()
        starts = [0] + ends[:-1]
        spans = [(s, e - s) for s, e in zip(starts, ends)]
        total_rows = (M + 127) // 128 + len(spans)
    out = torch.zeros(total_rows * kb * 512, dtype=torch.uint8)
    t = 0
    for start, rows in spans:
        blocks = (rows + 127) // 128
        if blocks == 0:
            continue
        padded = torch.zeros(blocks * 128, kb * 4, dtype=torch.uint8)
        padded[:rows, :C] = src[start : start + rows]
        # [blocks, r1 (4), r0 (32), kb, c (4)] -> [blocks, kb, r0, r1, c]
        atoms = padded.view(blocks, 4, 32, kb, 4).permute(0, 3, 2, 1, 4).reshape(-1)
        out[t * kb * 512 : (t + blocks) * kb * 512] = atoms
        t += blocks
    return out


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
