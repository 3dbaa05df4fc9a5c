// The SwiGLU forward that writes the down projection's input in FP8 only, in both layouts, from one read
// of h: a block per tile of 128 rows x 128 columns of the activation. Each row's 128 values are one
// forward block (16 lanes, 8 values each, amax by shuffles, 8 codes stored at once); the tile, rounded
// to h's dtype, is staged in shared memory for the token-major blocks (quant/fp8_tokens.cuh).
#include <stdexcept>

#include "activation/swiglu.h"
#include "activation/swiglu_math.cuh"
#include "common/check.h"
#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"
#include "quant/fp8_tokens.cuh"

namespace moe::activation {
namespace {

using quant::kFp8Block;
constexpr int kThreads = 256;
constexpr int kLanes = 16;                      // lanes per row block
constexpr int kItems = kFp8Block / kLanes;      // 8 values per lane: one 16-byte load of gate and of up
constexpr int kRowStep = kThreads / kLanes;     // rows per pass

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_fp8_kernel(SwigluFp8Params p, int64_t col_tiles, int64_t tiles) {
  using P = Pack<T, kItems>;
  __shared__ __align__(16) T tile[kFp8Block * kFp8Block];
  __shared__ float red[kThreads];
  const T* h = static_cast<const T*>(p.h);
  const int64_t padded = (p.rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const int64_t blocks_per_row = p.ffn / kFp8Block;
  const int lane = threadIdx.x % kLanes;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m_tile = t / col_tiles, c0 = (t % col_tiles) * kFp8Block;
    const int64_t c = c0 + lane * kItems;
    for (int r = threadIdx.x / kLanes; r < kFp8Block; r += kRowStep) {  // the same trip count in every lane
      const int64_t row = m_tile * kFp8Block + r;
      const bool live = row < p.rows;
      P a;
      float m = 0.f;
      if (live) {
        const P g = *reinterpret_cast<const P*>(h + row * 2 * p.ffn + c);
        const P u = *reinterpret_cast<const P*>(h + row * 2 * p.ffn + p.ffn + c);
        const float w = p.row_weights != nullptr ? p.row_weights[row] : 1.f;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          a.v[j] = from_float<T>(swiglu_value(to_float(g.v[j]), to_float(u.v[j]), w));
          m = quant::nan_max(m, fabsf(to_float(a.v[j])));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j) a.v[j] = from_float<T>(0.f);  // padding rows: code 0, no effect on amax
      }
      *reinterpret_cast<P*>(tile + r * kFp8Block + lane * kItems) = a;
      quant::quantize_row_block<kLanes>(a, m, live, p.q + row * p.ffn + c,
                                        p.scale + row * blocks_per_row + c0 / kFp8Block, lane, p.pow2);
    }
    __syncthreads();
    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, c0, p.ffn, padded, p.q_t, p.scale_t,
                                                         false, p.pow2);
  }
}

}  // namespace

void swiglu_fwd_fp8(const SwigluFp8Params& p, cudaStream_t stream) {
  if (p.rows < 0 || p.ffn < 0) throw std::invalid_argument("swiglu_quantize_fp8: negative size");
  if (p.ffn % kFp8Block) throw std::invalid_argument("swiglu_quantize_fp8: F must be a multiple of 128");
  if (reinterpret_cast<uintptr_t>(p.h) % 16) throw std::invalid_argument("swiglu_quantize_fp8: h must be 16-byte aligned");
  quant::check_code_alignment("swiglu_quantize_fp8", p.q, p.q_t);
  const int64_t col_tiles = p.ffn / kFp8Block;
  const int64_t tiles = (p.rows + kFp8Block - 1) / kFp8Block * col_tiles;
  if (tiles == 0) return;
  const unsigned grid = unsigned(tiles < 65536 ? tiles : 65536);
  switch (p.dtype) {
    case DType::kFloat16: swiglu_fp8_kernel<__half><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles); break;
    case DType::kBFloat16:
      swiglu_fp8_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
      break;
    default: throw std::invalid_argument("swiglu_quantize_fp8: h must be float16 or bfloat16");
  }
  check_launch("swiglu_fp8_kernel");
}

}  // namespace moe::activation
