// The scale and the rounding of FP8 quantization (fp8.h states the formulas), shared by every kernel
// that writes FP8 codes (quantize_fp8, permute_quantize_fp8), so their results agree bit for bit.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace moe::quant {

__device__ __forceinline__ float scale_from_amax(float amax, bool e5m2, bool pow2) {
  float s = 1.f;
  if (isfinite(amax) && amax > 0.f) s = fminf(__fdiv_rn(e5m2 ? 57344.f : 448.f, amax), FLT_MAX);
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0x7f800000u);
  return s;
}

__device__ __forceinline__ uint8_t to_fp8(float v, bool e5m2) {
  if (isnan(v)) return 0x7f;
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3));
}

}  // namespace moe::quant
