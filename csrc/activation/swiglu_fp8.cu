// The SwiGLU forward that writes the down projection's input in FP8 only, in both layouts, from one read
// of h: the tile loop of quant/fp8_dual_tiles.cuh around the SwiGLU of each row's gate and up values (F % 8
// == 0, its blocks' codes zero-padded to a multiple of 128).
#include <stdexcept>

#include "activation/swiglu.h"
#include "activation/swiglu_math.cuh"
#include "common/check.h"
#include "common/vec.cuh"
#include "quant/fp8_dual_tiles.cuh"

namespace moe::activation {
namespace {

using quant::kDualItems;
using quant::kDualThreads;
using quant::kFp8Block;

template <typename T>
__global__ void __launch_bounds__(kDualThreads) swiglu_fp8_kernel(SwigluFp8Params p) {
  using P = Pack<T, kDualItems>;
  __shared__ quant::DualTileSmem<T> smem;
  const T* h = static_cast<const T*>(p.h);
  auto value = [&](int64_t row, int64_t c) {
    const P g = *reinterpret_cast<const P*>(h + row * 2 * p.ffn + c);
    const P u = *reinterpret_cast<const P*>(h + row * 2 * p.ffn + p.ffn + c);
    const float w = p.row_weights != nullptr ? p.row_weights[row] : 1.f;
    P a;
#pragma unroll
    for (int j = 0; j < kDualItems; ++j) a.v[j] = from_float<T>(swiglu_value(to_float(g.v[j]), to_float(u.v[j]), w));
    return a;
  };
  quant::dual_fp8_tiles<T>(smem, p.rows, p.ffn, p.q, p.scale, p.q_t, p.scale_t, p.pow2, value);
}

}  // namespace

void swiglu_fwd_fp8(const SwigluFp8Params& p, cudaStream_t stream) {
  if (p.rows < 0 || p.ffn < 0) throw std::invalid_argument("swiglu_quantize_fp8: negative size");
  if (p.ffn % kDualItems) throw std::invalid_argument("swiglu_quantize_fp8: F must be a multiple of 8");
  if (reinterpret_cast<uintptr_t>(p.h) % 16) {
    throw std::invalid_argument("swiglu_quantize_fp8: h must be 16-byte aligned");
  }
  quant::check_code_alignment("swiglu_quantize_fp8", p.q, p.q_t);
  if (quant::dual_tiles(p.rows, p.ffn) == 0) return;
  const unsigned grid = quant::dual_grid(p.rows, p.ffn);
  switch (p.dtype) {
    case DType::kFloat16: swiglu_fp8_kernel<__half><<<grid, kDualThreads, 0, stream>>>(p); break;
    case DType::kBFloat16: swiglu_fp8_kernel<__nv_bfloat16><<<grid, kDualThreads, 0, stream>>>(p); break;
    default: throw std::invalid_argument("swiglu_quantize_fp8: h must be float16 or bfloat16");
  }
  check_launch("swiglu_fp8_kernel");
}

}  // namespace moe::activation
