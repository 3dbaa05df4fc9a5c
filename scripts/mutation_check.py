"""Mutation check of the emulated GPU tier: inject typical kernel bugs one at a time and show that the
GPU tier, run on the CPU-executed kernels (AddressSanitizer + UBSan build), fails for each.

    python scripts/mutation_check.py [--only NAME ...] [--keep] [--markdown FILE]

It copies the repository (tracked and untracked, not ignored files) to a scratch directory, builds
`moe_kernels._C_emu_asan` there (tools/cuda_on_cpu), checks that every mutant's tests pass on the
unmodified sources, then applies each mutant to the copy's csrc/, rebuilds (one translation unit) and
runs that mutant's tests, which must fail. The repository itself is never modified. Outside CI: it
takes several minutes (one ASan rebuild and a test subset per mutant).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    file: str  # under csrc/
    before: str  # text in the file, replaced once by `after`
    after: str
    tests: tuple[str, ...]  # pytest arguments


MUTANTS = (
    Mutant(
        "removed barrier",
        "map_kernel: no __syncwarp between reading a row counter and its leader advancing it",
        "permute/permute.cu",
        "    if (s < end) row_map[s] = e >= 0 ? next_row[e] + __popc(peers & lanes_below) : -1;\n    __syncwarp();\n",
        "    if (s < end) row_map[s] = e >= 0 ? next_row[e] + __popc(peers & lanes_below) : -1;\n",
        ("tests/ops/test_permute_gpu.py", "-k", "test_matches_reference and 7-8-2 and 16"),
    ),
    Mutant(
        "off-by-one bound",
        "tokens_per_expert_kernel: the shared histogram cleared up to e <= E",
        "permute/permute.cu",
        "  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;\n",
        "  for (int e = threadIdx.x; e <= E; e += blockDim.x) hist[e] = 0;\n",
        ("tests/ops/test_permute_gpu.py", "-k", "test_matches_reference and 7-8-2 and 16"),
    ),
    Mutant(
        "per-lane early return before a shuffle",
        "topk_fwd_token: lanes without an expert return before the warp reductions",
        "router/router.cu",
        "  const int k = p.k, lane = row.lane;\n  const float m = load_row<T>(p.logits, t, row);\n",
        "  const int k = p.k, lane = row.lane;\n  if (lane >= p.num_experts) return -1;\n"
        "  const float m = load_row<T>(p.logits, t, row);\n",
        ("tests/ops/test_router_gpu.py", "-k", "test_router_topk_matches_reference"),
    ),
    Mutant(
        "register row not rescanned",
        "row_select_topk: a register row keeps its lane's candidate after it was taken (only shared-memory rows rescan)",
        "router/router.cu",
        "    if (Row::kRegs || (b.e & 31) == lane) mine = row_best(row, 0, row.E);\n",
        "    if (!Row::kRegs && (b.e & 31) == lane) mine = row_best(row, 0, row.E);\n",
        ("tests/ops/test_router_gpu.py", "-k", "test_router_topk_matches_reference and softmax-2048-128-8"),
    ),
    Mutant(
        "softmax bias dropped",
        "topk_fwd_row: the expert bias added to sigmoid and sqrt-softplus scores only, not to softmax probabilities",
        "router/router.cu",
        "    const float s = p.score == Score::kSoftmax ? expf(x - m) / denom : activation(p.score, x);\n"
        "    return p.bias != nullptr ? s + p.bias[e] : s;\n",
        "    const float s = p.score == Score::kSoftmax ? expf(x - m) / denom : activation(p.score, x);\n"
        "    return p.bias != nullptr && p.score != Score::kSoftmax ? s + p.bias[e] : s;\n",
        ("tests/ops/test_router_gpu.py", "-k", "test_router_topk_matches_reference and softmax_pre_bias-2048-128-8"),
    ),
    Mutant(
        "softmax renormalisation ignored",
        "chosen_softmax: softmax weights over the k chosen only without pre_softmax, whatever `normalize` asks",
        "router/router.cu",
        "  return score == Score::kSoftmax && (!pre_softmax || normalize);\n",
        "  return score == Score::kSoftmax && !pre_softmax;\n",
        ("tests/ops/test_router_gpu.py", "-k", "test_router_topk_matches_reference and softmax_pre_bias-300-256-8"),
    ),
    Mutant(
        "group pick counted twice",
        "limit_groups: a 32-expert group scored from registers keeps its best key after picking it",
        "router/router.cu",
        "          if (b.e == lane + 32 * i) mine = kTaken;\n",
        "",
        ("tests/ops/test_router_gpu.py", "-k", "test_router_topk_matches_reference and deepseek-300-256-8"),
    ),
    Mutant(
        "wrong stride",
        "unpermute_fwd_kernel: routing weights read as [k, T] instead of [T, k]",
        "permute/unpermute.cu",
        "        w[b] = live[b] && weights != nullptr ? weights[t * k + j] : 1.f;\n",
        "        w[b] = live[b] && weights != nullptr ? weights[j * num_tokens + t] : 1.f;\n",
        ("tests/ops/test_permute_gpu.py", "-k", "test_matches_reference and 7-8-2 and 16"),
    ),
    Mutant(
        "int32 overflow in an offset",
        "copy_kernel: the destination row offset computed in 32 bits",
        "permute/permute.cu",
        "      V* dst = reinterpret_cast<V*>(x_perm + int64_t(r) * row_bytes);\n",
        "      V* dst = reinterpret_cast<V*>(x_perm + int32_t(r) * int32_t(row_bytes));\n",
        ("tests/ops/test_permute_gpu.py", "-k", "test_rows_past_2_31_bytes_emulated"),
    ),
    Mutant(
        "wrong vector width",
        "permute: rows whose width is a multiple of 8 bytes copied with 16-byte vectors",
        "permute/permute.cu",
        "    case 8: launch_copy<8>(p, ws, stream); break;\n",
        "    case 8: launch_copy<16>(p, ws, stream); break;\n",
        ("tests/ops/test_permute_gpu.py", "-k", "test_matches_reference and 16-1-8-1"),
    ),
    Mutant(
        "missing zeroing of padding rows",
        "copy_kernel: an expert's padding rows left unwritten",
        "permute/permute.cu",
        "      for (int64_t v = threadIdx.x; v < row_vecs; v += blockDim.x) dst[v] = V{};\n",
        "      for (int64_t v = threadIdx.x; v < row_vecs; v += blockDim.x) (void)dst;\n",
        ("tests/ops/test_permute_gpu.py", "-k", "test_matches_reference and 7-8-2 and 16"),
    ),
    Mutant(
        "wrong shuffle mask",
        "warp_max: the butterfly shuffles name only lanes 0-15",
        "common/warp.cuh",
        "  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));\n",
        "  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0x0000ffffu, v, off));\n",
        ("tests/ops/test_router_gpu.py", "-k", "test_router_topk_matches_reference"),
    ),
    Mutant(
        "stale padding scales",
        "quant_copy_kernel: an expert's padding rows get zero codes but their scales are left unwritten",
        "permute/permute.cu",
        "      for (int64_t b = threadIdx.x; b < bpr; b += kQuantThreads) scales[r * bpr + b] = 0.f;\n",
        "",
        ("tests/ops/test_permute_quantize_fp8_gpu.py", "-k", "test_matches_reference and 300 and 128"),
    ),
    Mutant(
        "amax over the wrong lanes",
        "quant_copy_kernel: the 1x128 block's amax reduced over 8 lanes instead of its 16",
        "permute/permute.cu",
        "    const float s = quant::scale_from_amax(quant::warp_nan_max(m, kQuantLanes), false, pow2);\n",
        "    const float s = quant::scale_from_amax(quant::warp_nan_max(m, kQuantLanes / 2), false, pow2);\n",
        ("tests/ops/test_permute_quantize_fp8_gpu.py", "-k", "test_dtypes_routing_and_pow2"),
    ),
    Mutant(
        "missing __syncthreads",
        "portable grouped GEMM: the next K tile loaded while other threads still read the current one",
        "gemm/grouped_mm.cu",
        "acc[half][u][v] = fmaf(av[u], bv[v], acc[half][u][v]);\n      }\n    }\n    __syncthreads();\n",
        "acc[half][u][v] = fmaf(av[u], bv[v], acc[half][u][v]);\n      }\n    }\n",
        ("tests/ops/test_grouped_mm_gpu.py", "-k", "test_portable_path"),
    ),
    Mutant(
        "wrong receive offset",
        "nvlink send_kernel: a rank's rows placed after its own count instead of after the lower ranks' counts",
        "dispatch/nvlink.cu",
        "    for (int s = 0; s < me; ++s) {\n",
        "    for (int s = 0; s <= me; ++s) {\n",
        ("tests/dispatch/test_nvlink.py", "-k", "test_nvlink_virtual_ranks_equal_one_rank and 4"),
    ),
    Mutant(
        "capacity checked on the first row only",
        "nvlink send_kernel: a token whose expert rows straddle the capacity is still delivered",
        "dispatch/nvlink.cu",
        "          delivered = first + m <= p.capacity && row < p.x_rows;\n",
        "          delivered = first < p.capacity && row < p.x_rows;\n",
        ("tests/dispatch/test_nvlink.py", "-k", "test_nvlink_capacity"),
    ),
    Mutant(
        "padding gradient rows left unwritten",
        "nvlink pull (combine backward): the experts' padding rows of the gradient not zeroed",
        "dispatch/nvlink.cu",
        "  if (PULL && p.local_experts > 0) {\n",
        "  if (PULL && p.local_experts < 0) {\n",
        ("tests/dispatch/test_nvlink.py", "-k", "test_nvlink_grouped_experts"),
    ),
    Mutant(
        "transposed index",
        "experts_quant_kernel: dgrad's scales written at the forward layout's index ([E, N/128, K/128], not "
        "[E, K/128, N/128])",
        "quant/fp8_experts.cu",
        "      if constexpr (DUAL) p.scale_t[(e * col_tiles + ct) * row_tiles + rt] = s;\n",
        "      if constexpr (DUAL) p.scale_t[(e * row_tiles + rt) * col_tiles + ct] = s;\n",
        ("tests/ops/test_quantize_experts_gpu.py", "-k", "test_matches_reference and 256-384"),
    ),
    Mutant(
        "a lane group's blocks overlap",
        "block_quant_kernel (quantize_fp8, 1x128 blocks): each of a lane group's U blocks taken U rows of groups "
        "apart in the wrong unit (kGroupItems, not kGroupsPerBlock), so some blocks are never quantized",
        "quant/fp8.cu",
        "      g[u] = base + u * kGroupsPerBlock + threadIdx.x / kGroupLanes;",
        "      g[u] = base + u * kGroupItems + threadIdx.x / kGroupLanes;",
        ("tests/ops/test_quant_gpu.py", "-k", "test_quantize_matches_reference and block and 130-7168"),
    ),
    Mutant(
        "copy alignment unchecked",
        "fp8_quantize_experts with a copy: the copy's 16-byte alignment left out of the vector-path test, so a "
        "misaligned copy takes 16-byte stores",
        "quant/fp8_experts.cu",
        " && reinterpret_cast<uintptr_t>(p.copy) % 16 == 0;",
        ";",
        ("tests/ops/test_quantize_experts_gpu.py", "-k", "test_copy_misaligned"),
    ),
    Mutant(
        "quantized before the rounding",
        "experts_quant_kernel with a copy (master weights): the fp32 master quantized instead of its rounded "
        "compute copy",
        "quant/fp8_experts.cu",
        "            v[i][j] = to_float(ck.v[j]);\n",
        "            v[i][j] = in ? to_float(pk.v[j]) : 0.f;\n",
        ("tests/ops/test_quantize_experts_gpu.py", "-k", "test_copy_matches and 2-256-384"),
    ),
    Mutant(
        "wrong column offset",
        "swiglu_bwd_fp8_kernel: d(up)'s token-major blocks written at d(gate)'s columns (c0, not F + c0)",
        "activation/swiglu_bwd_fp8.cu",
        "    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, p.ffn + c0, width, padded, p.q_t,\n",
        "    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, c0, width, padded, p.q_t,\n",
        ("tests/ops/test_swiglu_fp8_gpu.py", "-k", "test_backward_matches_composition and 256 and 129"),
    ),
    Mutant(
        "one half per block",
        "swiglu_bwd_fp8_any_kernel (F off 128): the half of dh taken per 128-column block, not per lane, so a block "
        "straddling d(gate) and d(up) is all d(gate)",
        "activation/swiglu_bwd_fp8.cu",
        "    const bool up = c >= p.ffn;\n",
        "    const bool up = c / kFp8Block * kFp8Block >= p.ffn;\n",
        ("tests/ops/test_swiglu_fp8_gpu.py", "-k", "test_backward_f_off_128_straddles_the_halves and 200-129"),
    ),
    Mutant(
        "wrong row of a gather",
        "unpermute_bwd_fp8_kernel: a row's token taken as slot % k instead of slot / k",
        "permute/unpermute_fp8.cu",
        "      const P d = *reinterpret_cast<const P*>(dout + (slot / p.k) * p.hidden + c);\n",
        "      const P d = *reinterpret_cast<const P*>(dout + (slot % p.k) * p.hidden + c);\n",
        ("tests/ops/test_permute_quantize_fp8_gpu.py", "-k", "test_unpermute_bwd_fp8_matches_composition and 37-8-2"),
    ),
    Mutant(
        "scale of the first token block",
        "quantize_tile_columns (every token-major producer): each 128-token block's scale written over the first "
        "block's (m_tile dropped from the index)",
        "quant/fp8_tokens.cuh",
        "    if (r0 == 0) scale_t[col * (padded_rows / kFp8Block) + m_tile] = s;\n",
        "    if (r0 == 0) scale_t[col * (padded_rows / kFp8Block)] = s;\n",
        ("tests/ops/test_quantize_tokens_gpu.py", "-k", "test_matches_reference and 300 and 256"),
    ),
    Mutant(
        "half a block's amax",
        "quantize_row_block (the dual-layout producers' row blocks): the block's amax taken over half of its lanes",
        "quant/fp8_tokens.cuh",
        "  const float s = scale_from_amax(warp_nan_max(m, kLanes), false, pow2);\n",
        "  const float s = scale_from_amax(warp_nan_max(m, kLanes / 2), false, pow2);\n",
        ("tests/ops/test_swiglu_fp8_gpu.py", "-k", "test_matches_composition and 129 and 256"),
    ),
    Mutant(
        "accumulate dropped in the store",
        "portable_kernel (the FP8 wgrad's fallback into an fp32 main gradient): the accumulators overwrite the "
        "buffer instead of adding to it",
        "gemm/grouped_mm.cu",
        "          out = from_float<T>(accumulate ? to_float(out) + acc[0][u][v] : acc[0][u][v]);\n",
        "          out = from_float<T>(acc[0][u][v]);\n",
        ("tests/ops/test_grouped_mm_fp8_wgrad_gpu.py", "-k", "test_accumulate_adds and 200-196"),
    ),
    Mutant(
        "empty experts zeroed while accumulating",
        "zero_uncovered: an empty expert's main gradient cleared although the wgrad adds into it",
        "gemm/grouped_mm.cu",
        "      if (!p.accumulate) {  // accumulating, an empty group adds nothing\n",
        "      if (true) {  // accumulating, an empty group adds nothing\n",
        ("tests/ops/test_grouped_mm_fp8_wgrad_gpu.py", "-k", "test_accumulate_adds and 256-384"),
    ),
    Mutant(
        "gather table ignored",
        "portable_kernel (expert_mlp's gathered products): an operand row read at its group position instead of "
        "the token the row table names",
        "gemm/grouped_mm.cu",
        "  const int32_t src = rows[row_start + pos];\n",
        "  const int32_t src = int32_t(row_start + pos);\n",
        ("tests/ops/test_expert_mlp_gpu.py", "-k", "test_matches_composition_and_fp64 and uniform and float32"),
    ),
    Mutant(
        "gate and up swapped in the epilogue",
        "portable_kernel's SwiGLU epilogue: silu applied to the up half",
        "gemm/grouped_mm.cu",
        "              from_float<T>(activation::swiglu_value(to_float(gate), to_float(up), w));\n",
        "              from_float<T>(activation::swiglu_value(to_float(up), to_float(gate), w));\n",
        ("tests/ops/test_expert_mlp_gpu.py", "-k", "test_matches_composition_and_fp64 and uniform and float32"),
    ),
    Mutant(
        "padding rows mapped to token 0",
        "rows_to_tokens: rows no slot maps to start as token 0 instead of -1, so padding rows read a token",
        "permute/permute.cu",
        "  check_cuda(cudaMemsetAsync(row_token, 0xff, sizeof(int32_t) * num_rows, stream), \"rows_to_tokens memset\");  // -1\n",
        "  check_cuda(cudaMemsetAsync(row_token, 0, sizeof(int32_t) * num_rows, stream), \"rows_to_tokens memset\");  // -1\n",
        ("tests/ops/test_expert_mlp_gpu.py", "-k", "test_matches_composition_and_fp64 and padding-rows-unweighted and float32"),
    ),
    Mutant(
        "group order ties broken backwards",
        "prepare_kernel: groups of equal rows ranked by descending index, so the visiting order is not the stated one",
        "gemm/grouped_mm.cu",
        "      rank += (r > key) | ((r == key) & (j < e));\n",
        "      rank += (r > key) | ((r == key) & (j > e));\n",
        ("tests/ops/test_grouped_mm_gpu.py", "-k", "test_visit_order and ties"),
    ),
    Mutant(
        "lane counted twice",
        "chunk_column_sums: the last block adds lane 0's chunk sums to themselves before the other lanes'",
        "common/chunk_sums.cuh",
        "        for (int l = 1; l < J; ++l) {\n",
        "        for (int l = 0; l < J; ++l) {\n",
        ("tests/ops/test_router_losses_gpu.py", "-k", "test_aux_loss and 2048-64-4"),
    ),
    Mutant(
        "one sequence for all",
        "fused_finish: the aux counts and sums over the sequences stop after the first sequence",
        "router/router.cu",
        "        for (int64_t b = 0; b < B; ++b) {\n          const int64_t at = b * L.chunks_per_seq * E + e;\n",
        "        for (int64_t b = 0; b < 1; ++b) {\n          const int64_t at = b * L.chunks_per_seq * E + e;\n",
        ("tests/ops/test_router_fused_gpu.py", "-k", "test_router_fused_matches_reference and sqrtsoftplus-all"),
    ),
    Mutant(
        "few-expert ties to the higher index",
        "small_best: the thread-per-token top-k keeps the last of equal keys, where the warp kernels keep the first",
        "router/router.cu",
        "    if (e >= lo && e < hi && key[e] > b.key) b = {key[e], e};\n",
        "    if (e >= lo && e < hi && key[e] >= b.key) b = {key[e], e};\n",
        ("tests/ops/test_router_gpu.py", "-k", "test_few_experts_match_the_warp_kernels"),
    ),
    Mutant(
        "B fragments crossed",
        "b_fragments (the tensor-core portable GEMMs' B fragments): the second k half of one n8 fragment of B taken "
        "from its neighbour's ldmatrix matrix",
        "gemm/portable_mma.cuh",
        "    bf[2 * nj][1] = r[1];\n    bf[2 * nj + 1][0] = r[2];\n",
        "    bf[2 * nj][1] = r[2];\n    bf[2 * nj + 1][0] = r[1];\n",
        ("tests/ops/test_grouped_mm_portable_mma_gpu.py", "-k", "test_matches_fp64 and uniform and bf16"),
    ),
    Mutant(
        "missing barrier between slices",
        "slice_pipeline (the tensor-core portable GEMMs' shared-memory stages): the next slice's copies issued into "
        "the stage of the slice before, with no barrier after every warp read it",
        "gemm/portable_mma.cuh",
        "    __syncthreads();\n    issue(s + stages - 1);\n",
        "    issue(s + stages - 1);\n",
        ("tests/ops/test_grouped_mm_portable_mma_gpu.py", "-k", "test_matches_fp64 and uniform and bf16"),
    ),
    Mutant(
        "cp.async wait one slice short",
        "slice_pipeline: each thread waits for all but the newest stages - 1 groups of copies, so slice s is read "
        "before its own copies have landed",
        "gemm/portable_mma.cuh",
        "    cp_async_wait(stages - 2);",
        "    cp_async_wait(stages - 1);",
        ("tests/ops/test_grouped_mm_portable_mma_gpu.py", "-k", "test_matches_fp64 and uniform and bf16"),
    ),
    Mutant(
        "contraction read past the group",
        "mma_kernel (the tensor-core portable GEMM): wgrad's row-contiguous slices read whole where the group's "
        "rows end inside them, so the next group's tokens enter the sum",
        "gemm/portable_mma.cuh",
        "(r < op.depth ? op.rows - i : 0);\n",
        "(op.rows - i);\n",
        ("tests/ops/test_grouped_mm_portable_mma_gpu.py", "-k", "test_matches_fp64 and skewed and bf16"),
    ),
    Mutant(
        "gate and up rows crossed",
        "mma_kernel's SwiGLU forward: each warp's 16 gate columns read from w13's up rows and its up columns from "
        "the gate rows",
        "gemm/portable_mma.cuh",
        "        up = (t / 16) % 2 != 0;\n",
        "        up = (t / 16) % 2 == 0;\n",
        ("tests/ops/test_grouped_mm_portable_mma_gpu.py", "-k", "test_gathered_products_and_swiglu_epilogue"),
    ),
    Mutant(
        "gathered rows from the first group",
        "mma_kernel's gathered products: a group's row indices read from the start of a_rows, not from the group's "
        "first row",
        "gemm/portable_mma.cuh",
        "fu.a_rows != nullptr ? fu.a_rows + info.row_start : nullptr;\n",
        "fu.a_rows != nullptr ? fu.a_rows : nullptr;\n",
        ("tests/ops/test_grouped_mm_portable_mma_gpu.py", "-k", "test_gathered_products_and_swiglu_epilogue"),
    ),
    # The FP8 tensor-core portable GEMM: its tests run in a child process that reports an 8.9 GPU.
    Mutant(
        "FP8 A fragment of the first step",
        "mma_fp8_kernel: both 32-deep steps of a slice multiply the first step's A fragment",
        "gemm/portable_mma_fp8.cuh",
        "fragment_row<true, true>(sa, wm + 16 * mi, k));",
        "fragment_row<true, true>(sa, wm + 16 * mi, 0));",
        ("tests/ops/test_grouped_mm_fp8_mma_gpu.py", "-k", "test_on_a_gpu_of_8_9"),
    ),
    Mutant(
        "FP8 promotion off the scale blocks",
        "mma_fp8_kernel: the partial sums promoted after every even slice, so a promotion spans two 128-wide scale "
        "blocks and takes one block's scales for both",
        "gemm/portable_mma_fp8.cuh",
        "if (s % 2 == 1 || !next) {",
        "if (s % 2 == 0 || !next) {",
        ("tests/ops/test_grouped_mm_fp8_mma_gpu.py", "-k", "test_on_a_gpu_of_8_9"),
    ),
    Mutant(
        "FP8 wgrad scales from the first tokens",
        "mma_fp8_kernel's wgrad: every group reads the scales of the first 128-token blocks, not its own",
        "gemm/portable_mma_fp8.cuh",
        "    block0 = info.row_start / kFp8Block;\n",
        "    block0 = 0;\n",
        ("tests/ops/test_grouped_mm_fp8_mma_gpu.py", "-k", "test_on_a_gpu_of_8_9"),
    ),
    Mutant(
        "NaN dropped",
        "squared_relu's relu: fmaxf's rule (NaN becomes 0) where torch's relu passes NaN on",
        "activation/squared_relu_math.cuh",
        "__device__ __forceinline__ float relu(float x) { return x > 0.f || x != x ? x : 0.f; }\n",
        "__device__ __forceinline__ float relu(float x) { return x > 0.f ? x : 0.f; }\n",
        ("tests/ops/test_activation_gpu.py", "-k", "test_squared_relu_is_torchs_bit_for_bit and 1000x768"),
    ),
    Mutant(
        "product unrounded",
        "squared_relu_grad: 2 relu(h) kept in fp32, where torch rounds it to the dtype (fp16: inf from 32768)",
        "activation/squared_relu_math.cuh",
        "__fmul_rn(dout, to_float(from_float<T>(__fmul_rn(2.f, r))))",
        "__fmul_rn(dout, __fmul_rn(2.f, r))",
        ("tests/ops/test_activation_gpu.py", "-k", "test_squared_relu_is_torchs_bit_for_bit and 1000x768"),
    ),
    Mutant(
        "one grid-stride round",
        "squared_relu_bwd_kernel: the loop stops after its first round over the grid",
        "activation/squared_relu.cu",
        "    P g;\n",
        "    P g;\n    if (v >= stride) return;\n",
        ("tests/ops/test_activation_gpu.py", "-k", "test_squared_relu_grid_stride"),
    ),
    Mutant(
        "padding left unwritten (vector path)",
        "block_quant_kernel: a lane whose vector lies past cols writes nothing, so q's zero padding to 128 is not",
        "quant/fp8.cu",
        "        if (out[u]) {\n",
        "        if (in[u]) {\n",
        ("tests/ops/test_quant_gpu.py", "-k", "test_block_codes_zero_padded_to_128"),
    ),
    Mutant(
        "padding left unwritten (scalar path)",
        "block_quant_kernel: the scalar path writes codes up to cols only, not q_cols",
        "quant/fp8.cu",
        "if (col[u] + j * kGroupLanes < p.q_cols) p.q[",
        "if (col[u] + j * kGroupLanes < p.cols) p.q[",
        ("tests/ops/test_quant_gpu.py", "-k", "test_block_codes_zero_padded_to_128"),
    ),
    Mutant(
        "padded codes at the unpadded stride",
        "experts_quant_kernel: dgrad's transposed codes written zero-padded but each row placed at the unpadded "
        "row length, so the rows overlap",
        "quant/fp8_experts.cu",
        "        *reinterpret_cast<Pack<uint8_t, kVecT>*>(q_t + col * p.q_t_rows + row) = out;\n",
        "        *reinterpret_cast<Pack<uint8_t, kVecT>*>(q_t + col * p.rows + row) = out;\n",
        ("tests/ops/test_quantize_experts_gpu.py", "-k", "test_padded_layouts and 300-256"),
    ),
    Mutant(
        "padding columns left unwritten",
        "dual_fp8_tiles (every dual-layout producer's tile loop: rows_fp8, swiglu_fp8, unpermute_fp8, the SwiGLU "
        "backward off 128): a live row's codes stored only for the lanes below C, so the forward blocks' zero padding "
        "to 128 is not written",
        "quant/fp8_dual_tiles.cuh",
        "      quantize_row_block<kDualLanes>(v, m, live, q",
        "      quantize_row_block<kDualLanes>(v, m, live && c < cols, q",
        ("tests/ops/test_rows_fp8_gpu.py", "-k", "test_padding_codes_are_zero"),
    ),
    Mutant(
        "the forward's value in the backward",
        "rows_fp8_kernel: the squared ReLU's backward quantizes relu(h)^2 instead of dout * 2 relu(h)",
        "activation/rows_fp8.cu",
        "    if constexpr (kOp == RowsFp8Op::kSquaredReluBwd) {\n",
        "    if constexpr (false) {\n",
        ("tests/ops/test_rows_fp8_gpu.py", "-k", "test_matches_composition and 1856-129"),
    ),
    Mutant(
        "transposed tile read back along its rows",
        "dequant_scales_kernel: wgrad's transposed scales read from the staged tile as tile[r][lane], so each 32x32 "
        "tile is written untransposed",
        "quant/fp8_scales.cu",
        "dst[row * rows + col] = tile[lane][r];",
        "dst[row * rows + col] = tile[r][lane];",
        ("tests/ops/test_fp8_dequant_scales_gpu.py", "-k", "test_matches_reference and 33x65-65x33-t"),
    ),
    Mutant(
        "zero scale inverted",
        "dequant_scales_kernel: 1 / scale for every scale, so a block of zeros (scale 0) dequantizes by inf",
        "quant/fp8_scales.cu",
        "return s == 0.f ? 0.f : 1.f / s;",
        "return 1.f / s;",
        ("tests/ops/test_fp8_dequant_scales_gpu.py", "-k", "test_matches_reference and 300x56"),
    ),
    Mutant(
        "no barrier before the tile is restaged",
        "dequant_scales_kernel: no __syncthreads after the transposed tile is read, so a block striding to its next "
        "tile overwrites the staged one while other threads still read it",
        "quant/fp8_scales.cu",
        "      __syncthreads();  // the tile is rewritten by the next iteration\n",
        "",
        ("tests/ops/test_fp8_dequant_scales_gpu.py", "-k", "test_blocks_striding_over_tiles"),
    ),
    Mutant(
        "activation written again without its weight",
        "swiglu_bwd_kernel: the activation the backward writes again (for the down projection's weight gradient) "
        "leaves out the row's routing weight",
        "activation/swiglu.cu",
        "        if (a != nullptr) ra.v[n] = from_float<T>(swiglu_value(gt, u, scale));\n",
        "        if (a != nullptr) ra.v[n] = from_float<T>(swiglu_value(gt, u, 1.f));\n",
        ("tests/nn/test_fused_regions_gpu.py", "-k",
         "test_fused_regions_equal_registered_ops and weights-in-activation"),
    ),
    Mutant(
        "index clamped instead of masked",
        "rows_to_slot_values_kernel: a dropped slot (row -1) reads row 0's weight gradient instead of getting zero",
        "permute/permute.cu",
        "    values[s] = r >= 0 && r < R ? rows[r] : 0.f;\n",
        "    values[s] = rows[r >= 0 && r < R ? r : 0];\n",
        ("tests/nn/test_moe_weights_in_activation_gpu.py", "-k", "test_region_equals_registered_ops and dropped"),
    ),
)


def _sh(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def _cuda_include() -> str:
    """The CUDA headers, found as the build finds them (nvcc's toolkit, CUDA_HOME, /usr/local/cuda)."""
    cands = [Path(p).resolve().parent.parent / "include" for p in [shutil.which("nvcc")] if p]
    cands += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands.append(Path("/usr/local/cuda/include"))
    for c in cands:
        if (c / "cuda_runtime.h").exists() and (c / "cuda_fp8.h").exists():
            return str(c)
    raise SystemExit("mutation_check: no CUDA headers found")


def _configure(copy: Path, build: Path) -> None:
    import pybind11

    args = ["cmake", f"-S{copy / 'tools' / 'cuda_on_cpu'}", f"-B{build}", "-GNinja", f"-DMOE_KERNELS_ROOT={copy}",
            f"-DCUDA_ON_CPU_INCLUDE={_cuda_include()}", "-DCUDA_ON_CPU_MODULE=_C_emu_asan",
            f"-DCUDA_ON_CPU_OUTPUT_DIR={copy / 'moe_kernels'}", "-DCUDA_ON_CPU_SANITIZE=ON",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}"]
    r = _sh(args, copy)
    if r.returncode:
        raise SystemExit(f"mutation_check: cmake failed\n{r.stdout}\n{r.stderr}")


def _build(build: Path) -> None:
    r = _sh(["cmake", "--build", str(build), "--parallel", str(os.cpu_count() or 1)], build)
    if r.returncode:
        raise SystemExit(f"mutation_check: build failed\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")


def _test_env() -> dict:
    libs = [subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
            for lib in ("libasan.so", "libstdc++.so")]
    env = dict(os.environ, MOE_KERNELS_EMULATE="asan", LD_PRELOAD=" ".join(libs), PYTHONDONTWRITEBYTECODE="1",
               ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    env.pop("PYTHONPATH", None)
    return env


def _run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[bool, str, float]:
    t0 = time.time()
    r = _sh([sys.executable, "-m", "pytest", "-q", "-x", "-s", "-p", "no:cacheprovider", *tests], copy, _test_env())
    out = r.stdout + r.stderr
    if r.returncode == 5:  # a mutant is never "caught" by an empty selection
        raise SystemExit(f"mutation_check: no test selected by {' '.join(tests)}")
    if r.returncode == 0 and not re.search(r"\b[1-9]\d* passed", out):  # nor "missed" by skipped tests alone
        raise SystemExit(f"mutation_check: every test selected by {' '.join(tests)} was skipped")
    return r.returncode == 0, out, time.time() - t0


def _why(out: str) -> str:
    """The first line that says what caught the bug: a sanitizer report, the CPU execution layer's error,
    or pytest's failure message."""
    lines = out.splitlines()
    for line in lines:
        m = re.search(r"ERROR: AddressSanitizer: ([\w-]+)", line)
        if m:
            return f"AddressSanitizer: {m.group(1)}"
        if "runtime error:" in line:
            return "UBSan: " + line.split("runtime error:", 1)[1].strip()[:120]
    for line in lines:
        if line.startswith("cuda_on_cpu: "):
            return re.sub(r" at /\S+/", " at ", line)[:300]
    for line in lines:
        if line.startswith("E ") and "Error" in line:
            return line[1:].strip()[:160]
    return lines[-1][:160] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--markdown", type=Path, help="also write the result table here")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]

    scratch = Path(tempfile.mkdtemp(prefix="moe_mutation_"))
    copy, build = scratch / "repo", scratch / "build"
    try:
        _copy_repo(copy)
        _configure(copy, build)
        print(f"building _C_emu_asan in {build} ...", flush=True)
        _build(build)
        for tests in sorted({m.tests for m in mutants}):
            ok, out, _ = _run_tests(copy, tests)
            if not ok:
                raise SystemExit(f"mutation_check: the unmutated sources fail {' '.join(tests)}:\n{out[-3000:]}")
        rows = []
        for m in mutants:
            path = copy / "csrc" / m.file
            original = path.read_text()
            if original.count(m.before) != 1:
                raise SystemExit(f"mutation_check: {m.name}: the text to mutate occurs {original.count(m.before)} "
                                 f"times in csrc/{m.file}")
            path.write_text(original.replace(m.before, m.after))
            try:
                _build(build)
                ok, out, secs = _run_tests(copy, m.tests)
            finally:
                path.write_text(original)
            caught = not ok
            rows.append((m, caught, _why(out) if caught else "tests passed", secs))
            print(f"{'caught ' if caught else 'MISSED '} {m.name}: {rows[-1][2]}", flush=True)
        _build(build)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    table = ["| mutant | injected bug | caught | by | tests (s) |", "|---|---|---|---|---|"]
    for m, caught, why, secs in rows:
        table.append(f"| {m.name} | `{m.file}`: {m.bug} | {'yes' if caught else '**no**'} | "
                     f"{why.replace('|', '/')} | {secs:.0f} |")
    text = "\n".join(table)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0 if all(caught for _, caught, _, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
