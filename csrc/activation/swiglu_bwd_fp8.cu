// The SwiGLU backward that writes dh = [d(gate) | d(up)] in FP8 only, in both layouts, from one read of dout
// and h: a block per tile of 128 rows x 128 columns of F. Each row's 128 values of d(gate) and of d(up) are
// two forward blocks of dh (16 lanes, 8 values each, amax by shuffles, 8 codes stored at once); the d(gate)
// tile, rounded to h's dtype, is staged in shared memory for its token-major blocks (quant/fp8_tokens.cuh)
// while d(up) waits in registers, then d(up) takes the same shared memory. Where F is no multiple of 128 (but
// of 8) a block of dh may hold values of both halves: the tile loop of quant/fp8_dual_tiles.cuh over the 2F
// columns of dh instead, its codes zero-padded to a multiple of 128, each lane computing the half its columns
// fall in (so gate, up and dout are read twice, the second time mostly from L2).
#include <stdexcept>

#include "activation/swiglu.h"
#include "activation/swiglu_math.cuh"
#include "common/check.h"
#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_dual_tiles.cuh"
#include "quant/fp8_math.cuh"
#include "quant/fp8_tokens.cuh"

namespace moe::activation {
namespace {

using quant::kFp8Block;
constexpr int kThreads = 256;
constexpr int kLanes = 16;                      // lanes per row block
constexpr int kItems = kFp8Block / kLanes;      // 8 values per lane: one 16-byte load of dout, gate and up
constexpr int kRowStep = kThreads / kLanes;     // rows per pass
constexpr int kPasses = kFp8Block / kRowStep;   // 8 passes over the tile's 128 rows
static_assert(kThreads == quant::kDualThreads && kItems == quant::kDualItems, "one block shape for both kernels");

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_fp8_kernel(SwigluBwdFp8Params p, int64_t col_tiles,
                                                                  int64_t tiles) {
  using P = Pack<T, kItems>;
  __shared__ __align__(16) T tile[kFp8Block * kFp8Block];
  __shared__ float red[kThreads];
  const T* dout = static_cast<const T*>(p.dout);
  const T* h = static_cast<const T*>(p.h);
  const int64_t width = 2 * p.ffn;
  const int64_t padded = (p.rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const int64_t blocks_per_row = width / kFp8Block;
  const int lane = threadIdx.x % kLanes;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m_tile = t / col_tiles, c0 = (t % col_tiles) * kFp8Block;
    const int64_t c = c0 + lane * kItems;
    P up_grad[kPasses];  // d(up) of this thread's rows, staged after d(gate)'s token-major blocks
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {  // the same trip count in every lane: the shuffles below
      const int r = threadIdx.x / kLanes + i * kRowStep;
      const int64_t row = m_tile * kFp8Block + r;
      const bool live = row < p.rows;
      P dg, du;
      float mg = 0.f, mu = 0.f;
      if (live) {
        const P g = *reinterpret_cast<const P*>(h + row * width + c);
        const P u = *reinterpret_cast<const P*>(h + row * width + p.ffn + c);
        const P d = *reinterpret_cast<const P*>(dout + row * p.ffn + c);
        const float w = p.row_weights != nullptr ? p.row_weights[row] : 1.f;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const SwigluGrad gr = swiglu_grad(to_float(g.v[j]), to_float(u.v[j]), to_float(d.v[j]), w);
          dg.v[j] = from_float<T>(gr.dgate);
          du.v[j] = from_float<T>(gr.dup);
          mg = quant::nan_max(mg, fabsf(to_float(dg.v[j])));
          mu = quant::nan_max(mu, fabsf(to_float(du.v[j])));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j) dg.v[j] = du.v[j] = from_float<T>(0.f);  // padding rows: code 0
      }
      *reinterpret_cast<P*>(tile + r * kFp8Block + lane * kItems) = dg;
      up_grad[i] = du;
      quant::quantize_row_block<kLanes>(dg, mg, live, p.q + row * width + c,
                                        p.scale + row * blocks_per_row + c0 / kFp8Block, lane, p.pow2);
      quant::quantize_row_block<kLanes>(du, mu, live, p.q + row * width + p.ffn + c,
                                        p.scale + row * blocks_per_row + (p.ffn + c0) / kFp8Block, lane, p.pow2);
    }
    __syncthreads();
    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, c0, width, padded, p.q_t, p.scale_t,
                                                         false, p.pow2);  // ends with a barrier
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = threadIdx.x / kLanes + i * kRowStep;
      *reinterpret_cast<P*>(tile + r * kFp8Block + lane * kItems) = up_grad[i];
    }
    __syncthreads();
    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, p.ffn + c0, width, padded, p.q_t,
                                                         p.scale_t, false, p.pow2);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_fp8_any_kernel(SwigluBwdFp8Params p) {
  using P = Pack<T, kItems>;
  __shared__ quant::DualTileSmem<T> smem;
  const T* dout = static_cast<const T*>(p.dout);
  const T* h = static_cast<const T*>(p.h);
  auto value = [&](int64_t row, int64_t c) {  // column c of dh = [d(gate) | d(up)]: F % 8 == 0, one half per lane
    const bool up = c >= p.ffn;
    const int64_t f = up ? c - p.ffn : c;
    const P g = *reinterpret_cast<const P*>(h + row * 2 * p.ffn + f);
    const P u = *reinterpret_cast<const P*>(h + row * 2 * p.ffn + p.ffn + f);
    const P d = *reinterpret_cast<const P*>(dout + row * p.ffn + f);
    const float w = p.row_weights != nullptr ? p.row_weights[row] : 1.f;
    P v;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const SwigluGrad gr = swiglu_grad(to_float(g.v[j]), to_float(u.v[j]), to_float(d.v[j]), w);
      v.v[j] = from_float<T>(up ? gr.dup : gr.dgate);
    }
    return v;
  };
  quant::dual_fp8_tiles<T>(smem, p.rows, 2 * p.ffn, p.q, p.scale, p.q_t, p.scale_t, p.pow2, value);
}

}  // namespace

void swiglu_bwd_fp8(const SwigluBwdFp8Params& p, cudaStream_t stream) {
  if (p.rows < 0 || p.ffn < 0) throw std::invalid_argument("swiglu_bwd_quantize_fp8: negative size");
  if (p.ffn % kItems) throw std::invalid_argument("swiglu_bwd_quantize_fp8: F must be a multiple of 8");
  if (reinterpret_cast<uintptr_t>(p.h) % 16 || reinterpret_cast<uintptr_t>(p.dout) % 16) {
    throw std::invalid_argument("swiglu_bwd_quantize_fp8: dout and h must be 16-byte aligned");
  }
  quant::check_code_alignment("swiglu_bwd_quantize_fp8", p.q, p.q_t);
  if (p.ffn % kFp8Block) {  // blocks of dh straddling d(gate) and d(up)
    if (quant::dual_tiles(p.rows, 2 * p.ffn) == 0) return;
    const unsigned grid = quant::dual_grid(p.rows, 2 * p.ffn);
    switch (p.dtype) {
      case DType::kFloat16: swiglu_bwd_fp8_any_kernel<__half><<<grid, kThreads, 0, stream>>>(p); break;
      case DType::kBFloat16: swiglu_bwd_fp8_any_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p); break;
      default: throw std::invalid_argument("swiglu_bwd_quantize_fp8: h must be float16 or bfloat16");
    }
    check_launch("swiglu_bwd_fp8_any_kernel");
    return;
  }
  const int64_t col_tiles = p.ffn / kFp8Block;
  const int64_t tiles = (p.rows + kFp8Block - 1) / kFp8Block * col_tiles;
  if (tiles == 0) return;
  const unsigned grid = unsigned(tiles < 65536 ? tiles : 65536);
  switch (p.dtype) {
    case DType::kFloat16: swiglu_bwd_fp8_kernel<__half><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles); break;
    case DType::kBFloat16:
      swiglu_bwd_fp8_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
      break;
    default: throw std::invalid_argument("swiglu_bwd_quantize_fp8: h must be float16 or bfloat16");
  }
  check_launch("swiglu_bwd_fp8_kernel");
}

}  // namespace moe::activation
