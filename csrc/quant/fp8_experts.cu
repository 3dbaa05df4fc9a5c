// quantize_fp8_experts_dual: expert weights [E, N, K] -> E4M3 128x128 tiles in both layouts the FP8
// recipe reads, from one read of the weight. A block per tile: its 128 x 128 elements are loaded once
// into registers (64 per thread, coalesced rows, all eight 16-byte loads in flight before the first is
// used), the tile's amax reduced over the block, the forward's codes stored from registers along K, and
// the same codes staged in shared memory (16 KB) to be stored transposed, along N, as 16-byte vectors.
// Without q_t the same kernel writes the row-major layout alone: quantize_fp8's 128x128 tile granularity
// (one expert) runs it too. With a copy (fp32 masters, both layouts) each element is first rounded to the
// copy's dtype, stored there from the same registers, and the rounded value quantized. Either layout's rows may
// be written zero-padded to a multiple of 128 (q_cols, q_t_rows): the last tile's codes past the edge are zeros
// (elements read as 0), stored with the rest, so no padding pass over the codes follows.
#include <stdexcept>
#include <type_traits>

#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"

namespace moe::quant {
namespace {

constexpr int kThreads = kAmaxThreads;                 // 256
constexpr int kItems = 8;                              // elements per load
constexpr int kLanesPerRow = kFp8Block / kItems;       // 16 threads cover a tile row
constexpr int kRowsPerPass = kThreads / kLanesPerRow;  // 16 rows per pass
constexpr int kPasses = kFp8Block / kRowsPerPass;      // 8 passes: 64 elements per thread
constexpr int kVecT = 16;                              // transposed codes per store

// VEC: rows of w start 8-element aligned (cols % 8 == 0, aligned w): each thread loads 8 contiguous
// elements; otherwise its 8 elements are strided by 16 (still coalesced across the 16 lanes).
// VEC_T: q_t_rows % 16 == 0 and q_t 16-byte aligned: the transposed codes go out as 16-byte vectors.
// DUAL: q_t is written (else the row-major codes alone, no staging).
// C: the copy's element type (void: no copy); T is float where it is not.
template <typename T, bool VEC, bool VEC_T, bool DUAL, typename C = void>
__global__ void __launch_bounds__(kThreads) experts_quant_kernel(Fp8ExpertsQuantParams p, int64_t row_tiles,
                                                                 int64_t col_tiles, int64_t tiles) {
  constexpr bool kCopy = !std::is_void_v<C>;
  using CopyT = std::conditional_t<kCopy, C, T>;  // (a placeholder where there is no copy)
  __shared__ __align__(16) uint8_t codes[DUAL ? kFp8Block * kFp8Block : kVecT];  // [n][k] of the tile
  const T* w = static_cast<const T*>(p.w);
  const bool e5m2 = DUAL ? false : p.e5m2;  // the dual layouts are the recipe's E4M3 (and keep their registers)
  const int lane = threadIdx.x % kLanesPerRow, row_in_pass = threadIdx.x / kLanesPerRow;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t e = t / (row_tiles * col_tiles);
    const int64_t rt = (t / col_tiles) % row_tiles, ct = t % col_tiles;
    const int64_t row0 = rt * kFp8Block, col0 = ct * kFp8Block;
    const T* src = w + e * p.rows * p.cols;
    CopyT* dst = kCopy ? static_cast<CopyT*>(p.copy) + e * p.rows * p.cols : nullptr;
    float v[kPasses][kItems];
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int64_t row = row0 + i * kRowsPerPass + row_in_pass;
      if constexpr (VEC) {
        const int64_t col = col0 + lane * kItems;
        const bool in = row < p.rows && col < p.cols;  // cols % 8 == 0: a vector is all in or all out
        Pack<T, kItems> pk;
        if (in) pk = *reinterpret_cast<const Pack<T, kItems>*>(src + row * p.cols + col);
        if constexpr (kCopy) {
          Pack<C, kItems> ck;
#pragma unroll
          for (int j = 0; j < kItems; ++j) {
            ck.v[j] = from_float<C>(in ? to_float(pk.v[j]) : 0.f);
            v[i][j] = to_float(ck.v[j]);
          }
          if (in) *reinterpret_cast<Pack<C, kItems>*>(dst + row * p.cols + col) = ck;
        } else {
#pragma unroll
          for (int j = 0; j < kItems; ++j) v[i][j] = in ? to_float(pk.v[j]) : 0.f;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const int64_t col = col0 + lane + j * kLanesPerRow;
          const bool in = row < p.rows && col < p.cols;
          float x = in ? to_float(src[row * p.cols + col]) : 0.f;
          if constexpr (kCopy) {
            const C c = from_float<C>(x);
            if (in) dst[row * p.cols + col] = c;
            x = to_float(c);
          }
          v[i][j] = x;
        }
      }
#pragma unroll
      for (int j = 0; j < kItems; ++j) m = nan_max(m, fabsf(v[i][j]));  // zeros past the edges never raise it
    }
    // The block reduction's barriers also order the previous tile's reads of `codes` before the writes below.
    const float s = scale_from_amax(block_nan_max(m), e5m2, p.pow2);
    if (threadIdx.x == 0) {
      p.scale[(e * row_tiles + rt) * col_tiles + ct] = s;
      if constexpr (DUAL) p.scale_t[(e * col_tiles + ct) * row_tiles + rt] = s;
    }
    uint8_t* q = p.q + e * p.rows * p.q_cols;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = i * kRowsPerPass + row_in_pass;
      const int64_t row = row0 + r;
      Pack<uint8_t, kItems> out;
#pragma unroll
      for (int j = 0; j < kItems; ++j) out.v[j] = to_fp8(__fmul_rn(v[i][j], s), e5m2);
      if constexpr (VEC) {
        if constexpr (DUAL) *reinterpret_cast<Pack<uint8_t, kItems>*>(codes + r * kFp8Block + lane * kItems) = out;
        const int64_t col = col0 + lane * kItems;
        if (row < p.rows && col < p.q_cols) *reinterpret_cast<Pack<uint8_t, kItems>*>(q + row * p.q_cols + col) = out;
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const int c = lane + j * kLanesPerRow;
          if constexpr (DUAL) codes[r * kFp8Block + c] = out.v[j];
          if (row < p.rows && col0 + c < p.q_cols) q[row * p.q_cols + col0 + c] = out.v[j];
        }
      }
    }
    if constexpr (!DUAL) continue;  // the next tile's block reduction orders nothing here: no shared codes
    __syncthreads();
    // Transposed: q_t[e][k][n]. Lanes of a warp take consecutive k of the same 16 rows n: conflict-free reads
    // of `codes` (consecutive bytes of one row).
    uint8_t* q_t = p.q_t + e * p.cols * p.q_t_rows;
    if constexpr (VEC_T) {
      for (int idx = threadIdx.x; idx < kFp8Block * (kFp8Block / kVecT); idx += kThreads) {
        const int k = idx % kFp8Block, n0 = (idx / kFp8Block) * kVecT;
        const int64_t col = col0 + k, row = row0 + n0;
        if (col >= p.cols || row >= p.q_t_rows) continue;  // q_t_rows % 16 == 0: a vector is all in or all out
        Pack<uint8_t, kVecT> out;
#pragma unroll
        for (int j = 0; j < kVecT; ++j) out.v[j] = codes[(n0 + j) * kFp8Block + k];
        *reinterpret_cast<Pack<uint8_t, kVecT>*>(q_t + col * p.q_t_rows + row) = out;
      }
    } else {
      for (int idx = threadIdx.x; idx < kFp8Block * kFp8Block; idx += kThreads) {
        const int k = idx / kFp8Block, n = idx % kFp8Block;
        const int64_t col = col0 + k, row = row0 + n;
        if (col < p.cols && row < p.q_t_rows) q_t[col * p.q_t_rows + row] = codes[n * kFp8Block + k];
      }
    }
  }
}

}  // namespace

void fp8_quantize_experts(const Fp8ExpertsQuantParams& params, cudaStream_t stream) {
  if (params.experts < 0 || params.rows < 0 || params.cols < 0) {
    throw std::invalid_argument("quantize_fp8_experts_dual: negative size");
  }
  Fp8ExpertsQuantParams p = params;
  const int64_t row_tiles = (p.rows + kFp8Block - 1) / kFp8Block, col_tiles = (p.cols + kFp8Block - 1) / kFp8Block;
  if (p.q_cols == 0) p.q_cols = p.cols;
  if (p.q_t_rows == 0) p.q_t_rows = p.rows;
  if ((p.q_cols != p.cols && p.q_cols != col_tiles * kFp8Block) ||
      (p.q_t_rows != p.rows && p.q_t_rows != row_tiles * kFp8Block)) {
    throw std::invalid_argument("quantize_fp8_experts_dual: q_cols (q_t_rows) must be cols (rows) or it rounded up to 128");
  }
  const int64_t tiles = p.experts * row_tiles * col_tiles;
  if (tiles == 0) return;
  // (After the empty-shape return: an empty q_t comes as a null pointer with its padded row length.)
  if (p.q_t == nullptr && p.q_t_rows != p.rows) {
    throw std::invalid_argument("quantize_fp8_experts_dual: q_t_rows without q_t");
  }
  const unsigned grid = unsigned(tiles < 65536 ? tiles : 65536);
  if (p.copy != nullptr) {
    if (p.q_t == nullptr || p.dtype != DType::kFloat32) {
      throw std::invalid_argument("quantize_fp8_experts_dual: a copy takes an fp32 w and both layouts");
    }
    const bool vec = p.cols % kItems == 0 && reinterpret_cast<uintptr_t>(p.w) % alignof(Pack<float, kItems>) == 0 &&
                     reinterpret_cast<uintptr_t>(p.q) % kItems == 0 && reinterpret_cast<uintptr_t>(p.copy) % 16 == 0;
    const bool vec_t = p.q_t_rows % kVecT == 0 && reinterpret_cast<uintptr_t>(p.q_t) % kVecT == 0;
    auto launch = [&]<typename C, bool V, bool VT>() {
      experts_quant_kernel<float, V, VT, true, C><<<grid, kThreads, 0, stream>>>(p, row_tiles, col_tiles, tiles);
    };
    auto by_layout = [&]<typename C>() {
      if (vec && vec_t) {
        launch.template operator()<C, true, true>();
      } else if (vec) {
        launch.template operator()<C, true, false>();
      } else if (vec_t) {
        launch.template operator()<C, false, true>();
      } else {
        launch.template operator()<C, false, false>();
      }
    };
    if (p.copy_dtype == DType::kBFloat16) {
      by_layout.template operator()<__nv_bfloat16>();
    } else if (p.copy_dtype == DType::kFloat16) {
      by_layout.template operator()<__half>();
    } else {
      throw std::invalid_argument("quantize_fp8_experts_dual: the copy is bfloat16 or float16");
    }
    check_launch("fp8 experts_quant_kernel (copy)");
    return;
  }
  by_float_dtype(p.dtype, "quantize_fp8_experts_dual", [&]<typename T>() {
    const bool vec = p.cols % kItems == 0 && reinterpret_cast<uintptr_t>(p.w) % alignof(Pack<T, kItems>) == 0 &&
                     reinterpret_cast<uintptr_t>(p.q) % kItems == 0;
    if (p.q_t == nullptr) {  // the row-major layout alone
      if (vec) {
        experts_quant_kernel<T, true, false, false><<<grid, kThreads, 0, stream>>>(p, row_tiles, col_tiles, tiles);
      } else {
        experts_quant_kernel<T, false, false, false><<<grid, kThreads, 0, stream>>>(p, row_tiles, col_tiles, tiles);
      }
      return;
    }
    const bool vec_t = p.q_t_rows % kVecT == 0 && reinterpret_cast<uintptr_t>(p.q_t) % kVecT == 0;
    auto launch = [&]<bool V, bool VT>() {
      experts_quant_kernel<T, V, VT, true><<<grid, kThreads, 0, stream>>>(p, row_tiles, col_tiles, tiles);
    };
    if (vec && vec_t) {
      launch.template operator()<true, true>();
    } else if (vec) {
      launch.template operator()<true, false>();
    } else if (vec_t) {
      launch.template operator()<false, true>();
    } else {
      launch.template operator()<false, false>();
    }
  });
  check_launch("fp8 experts_quant_kernel");
}

}  // namespace moe::quant
