// The SwiGLU math, one definition for every kernel that evaluates it (the SwiGLU forward and backward, the
// forward's FP8-writing variant, a GEMM epilogue): fp32, products in this order, so every producer of the
// activation rounds the same value.
#pragma once

#include <cuda_runtime.h>

namespace moe::activation {

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

// silu(gate) * up * weight (weight: the row's routing weight, or 1).
__device__ __forceinline__ float swiglu_value(float gate, float up, float weight) {
  return gate * sigmoidf(gate) * up * weight;
}

}  // namespace moe::activation
