// FP8 in 1x128 blocks along the tokens, written transposed, from a tile staged in shared memory: the
// second half of every kernel that produces wgrad's operand (quantize_fp8_tokens, the SwiGLU forward's
// FP8 variant). The caller stages 128 token rows x kCols columns in the element type (rows past the
// tensor as zeros, which never raise an amax and encode as code 0); this writes, per column, one scale
// (the column's amax over the 128 rows) and its 128 codes as 16-byte vectors into the token-major copy.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"

namespace moe::quant {

// tile: [128][kCols] in shared memory; red: kThreads floats of shared scratch. q_t [cols, padded_rows],
// scale_t [cols, padded_rows / 128]; the tile covers rows m_tile * 128 + [0, 128), columns c0 + [0, kCols).
// Ends with a barrier, so the caller may restage the tile right after.
template <typename T, int kCols, int kThreads>
__device__ __forceinline__ void quantize_tile_columns(const T* tile, float* red, int64_t m_tile, int64_t c0,
                                                      int64_t cols, int64_t padded_rows, uint8_t* q_t,
                                                      float* scale_t, bool e5m2, bool pow2) {
  static_assert(kThreads % kCols == 0, "whole columns per thread group");
  constexpr int kSplit = kThreads / kCols;    // threads per column
  constexpr int kRows = kFp8Block / kSplit;   // rows per thread
  constexpr int kVec = 16;                    // codes per store
  static_assert(kRows % kVec == 0, "16-byte stores");
  // Lanes of a warp take consecutive columns of one row: conflict-free shared reads.
  const int c = threadIdx.x % kCols, r0 = (threadIdx.x / kCols) * kRows;
  float m = 0.f;
#pragma unroll 8
  for (int r = r0; r < r0 + kRows; ++r) m = nan_max(m, fabsf(to_float(tile[r * kCols + c])));
  red[threadIdx.x] = m;
  __syncthreads();
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kSplit; ++k) amax = nan_max(amax, red[k * kCols + c]);
  const float s = scale_from_amax(amax, e5m2, pow2);
  const int64_t col = c0 + c;
  if (col < cols) {
    if (r0 == 0) scale_t[col * (padded_rows / kFp8Block) + m_tile] = s;
    uint8_t* dst = q_t + col * padded_rows + m_tile * kFp8Block + r0;
#pragma unroll
    for (int r = 0; r < kRows; r += kVec) {
      Pack<uint8_t, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.v[j] = to_fp8(__fmul_rn(to_float(tile[(r0 + r + j) * kCols + c]), s), e5m2);
      *reinterpret_cast<Pack<uint8_t, kVec>*>(dst + r) = out;
    }
  }
  __syncthreads();  // the tile and `red` are free again
}

// The row-major half of a dual-layout producer: one 1x128 block of a row held by kLanes consecutive lanes
// (kItems values `v` each, `m` this lane's amax of them). Every lane of the group takes the block's scale
// (a shuffle: call it from all of them); where `store`, this lane writes its kItems codes at `q` and lane 0
// the scale at `*scale`.
template <int kLanes, typename T, int kItems>
__device__ __forceinline__ void quantize_row_block(const Pack<T, kItems>& v, float m, bool store, uint8_t* q,
                                                   float* scale, int lane, bool pow2) {
  const float s = scale_from_amax(warp_nan_max(m, kLanes), false, pow2);
  if (!store) return;
  if (lane == 0) *scale = s;
  Pack<uint8_t, kItems> out;
#pragma unroll
  for (int j = 0; j < kItems; ++j) out.v[j] = to_fp8(__fmul_rn(to_float(v.v[j]), s), false);
  *reinterpret_cast<Pack<uint8_t, kItems>*>(q) = out;
}

// Host check for the launchers of the dual-layout producers: their stores of 8 codes at once into the row-major
// q and of 16 into the token-major q_t need those alignments (either may be null: not written).
inline void check_code_alignment(const char* op, const uint8_t* q, const uint8_t* q_t) {
  if (reinterpret_cast<uintptr_t>(q) % 8 || reinterpret_cast<uintptr_t>(q_t) % 16) {
    throw std::invalid_argument(std::string(op) + ": codes must be 8-byte (row-major) and 16-byte (token-major) aligned");
  }
}

}  // namespace moe::quant
