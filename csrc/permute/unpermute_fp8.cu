// The unpermute backward that writes dy in FP8 only, in both layouts, from one read of dout: a block per
// tile of 128 rows x 128 columns of dy. Each row gathers its slot's token row of dout (slot_of_row), times
// the routing weight, rounded to the element type as unpermute_bwd rounds it; each row's 128 values are one
// forward block (16 lanes, 8 values each, amax by shuffles, 8 codes stored at once); the tile is staged in
// shared memory for the token-major blocks (quant/fp8_tokens.cuh). Rows no slot maps to are zeros.
#include <stdexcept>

#include "common/check.h"
#include "common/vec.cuh"
#include "permute/permute.h"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"
#include "quant/fp8_tokens.cuh"

namespace moe::permute {
namespace {

using quant::kFp8Block;
constexpr int kThreads = 256;
constexpr int kLanes = 16;                      // lanes per row block
constexpr int kItems = kFp8Block / kLanes;      // 8 values per lane: one 16-byte load of dout
constexpr int kRowStep = kThreads / kLanes;     // rows per pass

template <typename T>
__global__ void __launch_bounds__(kThreads) unpermute_bwd_fp8_kernel(UnpermuteBwdFp8Params p, int64_t col_tiles,
                                                                     int64_t tiles) {
  using P = Pack<T, kItems>;
  __shared__ __align__(16) T tile[kFp8Block * kFp8Block];
  __shared__ float red[kThreads];
  const T* dout = static_cast<const T*>(p.dout);
  const int64_t padded = (p.num_rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const int64_t blocks_per_row = p.hidden / kFp8Block;
  const int lane = threadIdx.x % kLanes;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m_tile = t / col_tiles, c0 = (t % col_tiles) * kFp8Block;
    const int64_t c = c0 + lane * kItems;
    for (int r = threadIdx.x / kLanes; r < kFp8Block; r += kRowStep) {  // the same trip count in every lane
      const int64_t row = m_tile * kFp8Block + r;
      const bool live = row < p.num_rows;
      const int64_t slot = live ? p.slot_of_row[row] : -1;
      // A slot outside [0, T*k) would read past dout: such a row is taken as unmapped.
      const bool mapped = slot >= 0 && slot < p.num_tokens * p.k;
      P g;
      float m = 0.f;
      if (mapped) {
        const P d = *reinterpret_cast<const P*>(dout + (slot / p.k) * p.hidden + c);
        const float w = p.weights != nullptr ? p.weights[slot] : 1.f;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          g.v[j] = from_float<T>(__fmul_rn(w, to_float(d.v[j])));
          m = quant::nan_max(m, fabsf(to_float(g.v[j])));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j) g.v[j] = from_float<T>(0.f);  // unmapped and padding rows: code 0
      }
      *reinterpret_cast<P*>(tile + r * kFp8Block + lane * kItems) = g;
      quant::quantize_row_block<kLanes>(g, m, live, p.q + row * p.hidden + c,
                                        p.scale + row * blocks_per_row + c0 / kFp8Block, lane, p.pow2);
    }
    __syncthreads();
    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, c0, p.hidden, padded, p.q_t, p.scale_t,
                                                         false, p.pow2);
  }
}

}  // namespace

void unpermute_bwd_fp8(const UnpermuteBwdFp8Params& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.hidden < 0 || p.num_tokens < 0 || p.k < 0) {  // k = 0: no slot, dy all zeros
    throw std::invalid_argument("unpermute_bwd_quantize_fp8: bad size");
  }
  if (p.hidden % kFp8Block) throw std::invalid_argument("unpermute_bwd_quantize_fp8: H must be a multiple of 128");
  if (reinterpret_cast<uintptr_t>(p.dout) % 16) {
    throw std::invalid_argument("unpermute_bwd_quantize_fp8: dout must be 16-byte aligned");
  }
  quant::check_code_alignment("unpermute_bwd_quantize_fp8", p.q, p.q_t);
  const int64_t col_tiles = p.hidden / kFp8Block;
  const int64_t tiles = (p.num_rows + kFp8Block - 1) / kFp8Block * col_tiles;
  if (tiles == 0) return;
  const unsigned grid = unsigned(tiles < 65536 ? tiles : 65536);
  switch (p.dtype) {
    case DType::kFloat16: unpermute_bwd_fp8_kernel<__half><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles); break;
    case DType::kBFloat16:
      unpermute_bwd_fp8_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
      break;
    default: throw std::invalid_argument("unpermute_bwd_quantize_fp8: dout must be float16 or bfloat16");
  }
  check_launch("unpermute_bwd_fp8_kernel");
}

}  // namespace moe::permute
