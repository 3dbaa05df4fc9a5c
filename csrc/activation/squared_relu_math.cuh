// The squared-ReLU math, one definition for every kernel that evaluates it (the squared ReLU forward and
// backward, their FP8-writing variants): fp32, each product rounded on its own, bit for bit torch's relu then
// square and their backward.
#pragma once

#include <cuda_runtime.h>

#include "common/vec.cuh"

namespace moe::activation {

// relu(x): NaN stays NaN (torch's relu propagates it; fmaxf would not).
__device__ __forceinline__ float relu(float x) { return x > 0.f || x != x ? x : 0.f; }

__device__ __forceinline__ float squared_relu_value(float x) {
  const float r = relu(x);
  return __fmul_rn(r, r);
}

// torch's backward of square(relu(x)): dout * (2 relu(x)), 2 relu(x) rounded to T first as torch rounds it (exact
// but for overflow: fp16 at relu(x) >= 32768), then zero wherever relu(x) <= 0 (even for an inf or NaN dout); a
// NaN x passes NaN.
template <typename T>
__device__ __forceinline__ float squared_relu_grad(float x, float dout) {
  const float r = relu(x);
  return r > 0.f || r != r ? __fmul_rn(dout, to_float(from_float<T>(__fmul_rn(2.f, r)))) : 0.f;
}

}  // namespace moe::activation
