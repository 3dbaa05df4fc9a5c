// The unpermute backward that writes dy in FP8 only, in both layouts, from one read of dout: the tile loop of
// quant/fp8_dual_tiles.cuh (H % 8 == 0, its blocks' codes zero-padded to a multiple of 128) around a gather.
// Each row gathers its slot's token row of dout (slot_of_row), times the routing weight, rounded to the
// element type as unpermute_bwd rounds it. Rows no slot maps to are zeros.
#include <stdexcept>

#include "common/check.h"
#include "common/vec.cuh"
#include "permute/permute.h"
#include "quant/fp8_dual_tiles.cuh"

namespace moe::permute {
namespace {

using quant::kDualItems;
using quant::kDualThreads;
using quant::kFp8Block;

template <typename T>
__global__ void __launch_bounds__(kDualThreads) unpermute_bwd_fp8_kernel(UnpermuteBwdFp8Params p) {
  using P = Pack<T, kDualItems>;
  __shared__ quant::DualTileSmem<T> smem;
  const T* dout = static_cast<const T*>(p.dout);
  auto value = [&](int64_t row, int64_t c) {
    const int64_t slot = p.slot_of_row[row];
    P g;
    // A slot outside [0, T*k) would read past dout: such a row is taken as unmapped.
    if (slot >= 0 && slot < p.num_tokens * p.k) {
      const P d = *reinterpret_cast<const P*>(dout + (slot / p.k) * p.hidden + c);
      const float w = p.weights != nullptr ? p.weights[slot] : 1.f;
#pragma unroll
      for (int j = 0; j < kDualItems; ++j) g.v[j] = from_float<T>(__fmul_rn(w, to_float(d.v[j])));
    } else {
#pragma unroll
      for (int j = 0; j < kDualItems; ++j) g.v[j] = from_float<T>(0.f);  // unmapped rows: code 0
    }
    return g;
  };
  quant::dual_fp8_tiles<T>(smem, p.num_rows, p.hidden, p.q, p.scale, p.q_t, p.scale_t, p.pow2, value);
}

}  // namespace

void unpermute_bwd_fp8(const UnpermuteBwdFp8Params& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.hidden < 0 || p.num_tokens < 0 || p.k < 0) {  // k = 0: no slot, dy all zeros
    throw std::invalid_argument("unpermute_bwd_quantize_fp8: bad size");
  }
  if (p.hidden % kDualItems) throw std::invalid_argument("unpermute_bwd_quantize_fp8: H must be a multiple of 8");
  if (reinterpret_cast<uintptr_t>(p.dout) % 16) {
    throw std::invalid_argument("unpermute_bwd_quantize_fp8: dout must be 16-byte aligned");
  }
  quant::check_code_alignment("unpermute_bwd_quantize_fp8", p.q, p.q_t);
  if (quant::dual_tiles(p.num_rows, p.hidden) == 0) return;
  const unsigned grid = quant::dual_grid(p.num_rows, p.hidden);
  switch (p.dtype) {
    case DType::kFloat16: unpermute_bwd_fp8_kernel<__half><<<grid, kDualThreads, 0, stream>>>(p); break;
    case DType::kBFloat16:
      unpermute_bwd_fp8_kernel<__nv_bfloat16><<<grid, kDualThreads, 0, stream>>>(p);
      break;
    default: throw std::invalid_argument("unpermute_bwd_quantize_fp8: dout must be float16 or bfloat16");
  }
  check_launch("unpermute_bwd_fp8_kernel");
}

}  // namespace moe::permute
