// The tile loop of the producers that write a value in E4M3 only, in both layouts the FP8 recipe's GEMMs read,
// from one read of their inputs (rows_fp8, swiglu_fp8, unpermute_fp8, and swiglu_bwd_fp8 where F is no multiple
// of 128): a block per tile of 128 rows x 128 columns of the value [R, C]. Each row's 128 values are one 1x128
// block (16 lanes, 8 values each, amax by shuffles, 8 codes stored at once); the last tile's columns past C are
// zeros and stored as zero codes (the padding of C to Cp = ceil(C / 128) * 128, which the GEMM contracts over);
// the tile, rounded to the element type, is staged in shared memory for the token-major blocks
// (quant/fp8_tokens.cuh), which cover the columns below C only. Rows past R are zeros (codes 0 in the
// token-major copy, nothing stored in the row-major one).
#pragma once

#include <cstdint>

#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"
#include "quant/fp8_tokens.cuh"

namespace moe::quant {

constexpr int kDualThreads = 256;                         // threads per block
constexpr int kDualLanes = 16;                            // lanes per row block
constexpr int kDualItems = kFp8Block / kDualLanes;        // 8 values per lane: one 16-byte load of a 16-bit row
constexpr int kDualRowStep = kDualThreads / kDualLanes;   // rows per pass

// A dual-layout producer's static shared memory: the tile staged for the token-major blocks, and the scratch of
// their column reductions.
template <typename T>
struct DualTileSmem {
  __align__(16) T tile[kFp8Block * kFp8Block];
  float red[kDualThreads];
};

// Tiles of a [rows, cols] value (cols % 8 == 0).
__host__ __device__ inline int64_t dual_col_tiles(int64_t cols) { return (cols + kFp8Block - 1) / kFp8Block; }
__host__ __device__ inline int64_t dual_tiles(int64_t rows, int64_t cols) {
  return (rows + kFp8Block - 1) / kFp8Block * dual_col_tiles(cols);
}

// Every tile of the value, the blocks of the grid striding over them. `value(row, c)` gives the 8 values at
// columns c .. c + 7 of a row below `rows` (c < cols), rounded to T; it is called for those only. q [rows, Cp]
// and scale [rows, Cp / 128] take the 1x128 blocks along the columns, q_t [cols, Rp] and scale_t [cols, Rp / 128]
// (Rp = rows rounded up to 128) the token-major ones. `smem`: the kernel's static shared memory. The same trip
// counts in every lane (the shuffles).
template <typename T, typename Value>
__device__ __forceinline__ void dual_fp8_tiles(DualTileSmem<T>& smem, int64_t rows, int64_t cols, uint8_t* q,
                                               float* scale, uint8_t* q_t, float* scale_t, bool pow2, Value value) {
  using P = Pack<T, kDualItems>;
  T* tile = smem.tile;
  const int64_t col_tiles = dual_col_tiles(cols), tiles = dual_tiles(rows, cols);
  const int64_t q_cols = col_tiles * kFp8Block;
  const int64_t padded = (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const int lane = threadIdx.x % kDualLanes;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m_tile = t / col_tiles, c0 = (t % col_tiles) * kFp8Block;
    const int64_t c = c0 + lane * kDualItems;
    for (int r = threadIdx.x / kDualLanes; r < kFp8Block; r += kDualRowStep) {
      const int64_t row = m_tile * kFp8Block + r;
      const bool live = row < rows;
      P v;
      float m = 0.f;
      if (live && c < cols) {  // cols % 8 == 0: a lane's 8 values are all in or all out
        v = value(row, c);
#pragma unroll
        for (int j = 0; j < kDualItems; ++j) m = nan_max(m, fabsf(to_float(v.v[j])));
      } else {
#pragma unroll
        for (int j = 0; j < kDualItems; ++j) v.v[j] = from_float<T>(0.f);  // padding rows and columns: code 0
      }
      *reinterpret_cast<P*>(tile + r * kFp8Block + lane * kDualItems) = v;
      quantize_row_block<kDualLanes>(v, m, live, q + row * q_cols + c, scale + row * col_tiles + c0 / kFp8Block,
                                     lane, pow2);
    }
    __syncthreads();
    quantize_tile_columns<T, kFp8Block, kDualThreads>(tile, smem.red, m_tile, c0, cols, padded, q_t, scale_t, false,
                                                      pow2);
  }
}

// The grid of a dual-layout producer's launch: a block per tile, at most 65536 (the blocks stride).
inline unsigned dual_grid(int64_t rows, int64_t cols) {
  const int64_t tiles = dual_tiles(rows, cols);
  return unsigned(tiles < 65536 ? tiles : 65536);
}

}  // namespace moe::quant
