// The FP8 blockwise grouped GEMM on tensor cores for the GPUs without a CUTLASS FP8 kernel of ours: warp-level
// mma.sync m16n8k32 on E4M3 (fp32 accumulators), which every GPU from 8.9 on has (L4, L40S, RTX 40/50, and
// B200/B300 where their sm_100f instances are not opted in). The two FP8 products (grouped_mm.h), both with the
// contraction contiguous in memory:
//   fwd:   d bf16 [M, N] = x [M, K] @ w[e]^T, dequantization scales sfa [M, K / 128] and
//          sfb [E, ceil(N / 128), K / 128] (the recipe's dgrad is this product on dgrad's transposed weight tiles);
//   wgrad: d [E, N, K] (fp32, optionally accumulated into, or bf16) = dout^T [N, M] x^T [K, M]^T over group e's
//          tokens, scales sfa [ceil(M / 128), N] and sfb [ceil(M / 128), K] per 128 tokens.
//
// The tile, warps, slices and shared layout are the bf16 kernel's (portable_mma.cuh): a slice is 64 E4M3 values of
// each of 128 rows, the 80-byte rows of the bf16 kernel's [rows][32] slices, so ldmatrix (no .trans: it moves pairs
// of bytes, and a row's four consecutive codes are what m16n8k32's fragments hold) reads the fragments unchanged.
// Each 128-wide block of the contraction (two slices) is summed into `part`; the block's two scales then promote
// it into the result: acc = fma(part, sa * sb, acc), where sa is the row's scale and sb the column's (the forward's
// weight tile scale is one per CTA column). A zero scale is a block of zeros (permute's padding), never 0 * inf.
//
// On the CPU-executed build (CUDA_ON_CPU) the instruction is spelled with warp shuffles that sum the block's
// products in fp32 along k, one rounding each (products of two E4M3 values are exact in fp32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "gemm/portable_mma.cuh"

namespace moe::gemm::mma {

constexpr int kBK8 = 2 * kBK;   // E4M3 values per slice row: the bf16 slice's 64 bytes
constexpr int kFp8Block = 128;  // scale block along the contraction: two slices
static_assert(kFp8Block == 2 * kBK8, "the promotion follows every second slice");
static_assert(kBN == kFp8Block, "the forward's CTA columns share one weight tile scale per block");

#if defined(CUDA_ON_CPU)
inline float e4m3_value(uint32_t v, int e) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t((v >> (8 * e)) & 0xffu), __NV_E4M3);
  return __half2float(__half(h));
}
#endif

// c += A (16x32, row-major fragment a) * B (32x8, column-major fragment b), E4M3. Lane l = 4 g + t:
// a[0] = A[g][4t .. 4t+3], a[1] = A[g+8][4t ..], a[2] = A[g][16+4t ..], a[3] = A[g+8][16+4t ..];
// b[0] = B[4t .. 4t+3][g], b[1] = B[16+4t ..][g]; c as m16n8k16's. The first value in the low byte.
__device__ __forceinline__ void mma_16832_e4m3(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if !defined(CUDA_ON_CPU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
  __trap();  // below 8.9: the path choice never launches this kernel
#elif defined(CUDA_ON_CPU)
  emulated_mma<4>(c, a, b, e4m3_value);
#endif
}

// The FP8 products' scales and output (grouped_mm.h): sfa, sfb dequantization scales; d bf16 (fwd) or TOut
// (wgrad); accumulate: wgrad's d += the product (fp32).
struct Fp8Args {
  const uint8_t* a;
  const uint8_t* b;
  void* d;
  const float* sfa;
  const float* sfb;
  bool vec_a, vec_b, vec_d, accumulate;
};

// Two neighbouring outputs of a row (store_pair), added to what `out` holds when accumulating (one fp32 addition
// each).
template <typename TOut>
__device__ __forceinline__ void store_out_pair(TOut* out, float v0, float v1, bool vec, int64_t left,
                                                 bool accumulate) {
  if constexpr (std::is_same_v<TOut, float>) {
    if (accumulate) {
      v0 = out[0] + v0;
      if (left >= 2) v1 = out[1] + v1;
    }
  }
  store_pair(out, from_float<TOut>(v0), from_float<TOut>(v1), vec, left);
}

// kOp: GemmOp::kFwd or kWgrad; TOut: the output's type (bf16 for fwd; fp32 or bf16 for wgrad).
template <GemmOp kOp, typename TOut>
__global__ void __launch_bounds__(kThreads, 1)
    mma_fp8_kernel(Fp8Args args, int E, int64_t M, int64_t N, int64_t K, const GroupInfo* __restrict__ groups,
                   const int32_t* __restrict__ tiles, int stages) {
  static_assert(kOp == GemmOp::kFwd || kOp == GemmOp::kWgrad, "FP8 has a forward and a wgrad");
  extern __shared__ __align__(16) uint16_t mma_smem[];  // [stage][A, B][kSlice]: 80-byte rows of 64 values
  const int tile = blockIdx.x;
  if (tile >= *tiles) return;
  const int g = group_of_tile(groups, E, tile);
  const GroupInfo info = groups[g];
  Operand A, B;  // E4M3 codes, the contraction contiguous
  int64_t Mg, Ng, block0;  // the output tile's extent in the group; the contraction's first scale block
  if constexpr (kOp == GemmOp::kFwd) {  // x[rows of g] [rows, K] @ w[g] [N, K]^T
    A = {args.a + info.row_start * K, K, info.rows, K, args.vec_a};
    B = {args.b + int64_t(g) * N * K, K, N, K, args.vec_b};
    Mg = info.rows;
    Ng = N;
    block0 = 0;
  } else {  // dout^T [N, tokens of g] @ (x^T [K, tokens of g])^T
    // A group whose tokens do not start and end on whole scale blocks gets NaN (zero_uncovered), an empty one zeros
    // or, accumulating, keeps d: nothing to compute.
    if (info.rows == 0 || info.row_start % kFp8Block || info.rows % kFp8Block) return;
    A = {args.a + info.row_start, M, N, info.rows, args.vec_a};
    B = {args.b + info.row_start, M, K, info.rows, args.vec_b};
    Mg = N;
    Ng = K;
    block0 = info.row_start / kFp8Block;
  }
  const int64_t i0 = int64_t(tile - info.tile_start) * kBM, j0 = int64_t(blockIdx.y) * kBN;
  if (j0 >= Ng) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp % 2) * kWarpM, wn = (warp / 2) * kWarpN;
  const int gr = lane / 4, tc = 2 * (lane % 4);

  float acc[4][4][4], part[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = part[mi][ni][q] = 0.f;

  const SliceLoader<uint8_t, true, false> la, lb;
  slice_pipeline(la, lb, A, B, i0, j0, A.depth, kBK8, mma_smem, stages, [&](int64_t s, bool next,
                                                                            const uint16_t* sa, const uint16_t* sb) {
#pragma unroll
    for (int k = 0; k < kBK; k += 16) {  // in pairs of values: 32 E4M3 per step
      // B's fragments for the step, then A's one row block at a time: the fewest fragment registers live beside
      // the two accumulator sets (on 9.0 and 10.x the instruction unpacks to f16, doubling them).
      uint32_t bf[4][2];
      b_fragments<true>(bf, sb, wn, k);
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        uint32_t af[4];
        ldmatrix_x4<false>(af, fragment_row<true, true>(sa, wm + 16 * mi, k));
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_16832_e4m3(part[mi][ni], af, bf[ni]);
      }
    }
    if (s % 2 == 1 || !next) {  // the end of a scale block: promote
      const int64_t kb = block0 + s / 2;
      float sb_col[4][2];
      if constexpr (kOp == GemmOp::kFwd) {  // one weight tile scale for the CTA's 128 columns
        const int64_t kblocks = K / kFp8Block, nblocks = (N + kFp8Block - 1) / kFp8Block;
        const float sbv = args.sfb[(int64_t(g) * nblocks + j0 / kFp8Block) * kblocks + kb];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) sb_col[ni][0] = sb_col[ni][1] = sbv;
      } else {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = j0 + wn + 8 * ni + tc + e;
            sb_col[ni][e] = j < Ng ? args.sfb[kb * K + j] : 0.f;
          }
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t i = i0 + wm + 16 * mi + gr + 8 * half;
          float sa_row = 0.f;
          if (i < Mg) {
            sa_row = kOp == GemmOp::kFwd ? args.sfa[(info.row_start + i) * (K / kFp8Block) + kb] : args.sfa[kb * N + i];
          }
#pragma unroll
          for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& p = part[mi][ni][2 * half + e];
              acc[mi][ni][2 * half + e] = __fmaf_rn(p, sa_row * sb_col[ni][e], acc[mi][ni][2 * half + e]);
              p = 0.f;
            }
        }
    }
  });

  // Epilogue: fwd rows of the group (bf16), wgrad rows of expert g's [N, K] (TOut).
  TOut* C = kOp == GemmOp::kFwd ? static_cast<TOut*>(args.d) + info.row_start * N
                                : static_cast<TOut*>(args.d) + int64_t(g) * N * K;
  const int64_t ldc = kOp == GemmOp::kFwd ? N : K;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t i = i0 + wm + 16 * mi + gr + 8 * half;
      if (i >= Mg) continue;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int64_t j = j0 + wn + 8 * ni + tc;
        if (j >= Ng) continue;
        store_out_pair(C + i * ldc + j, acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1], args.vec_d, Ng - j,
                         kOp == GemmOp::kWgrad && args.accumulate);
      }
    }
}

}  // namespace moe::gemm::mma
