// The SwiGLU math, one definition for every kernel that evaluates it (the SwiGLU forward and backward, their
// FP8-writing variants, a GEMM epilogue): fp32, products in this order, each step rounded on its own (the _rn
// intrinsics: nvcc would otherwise contract a product and an add into an fma where it sees fit, differently in
// different kernels and unlike the CPU-executed build), so every producer of the activation rounds the same value.
#pragma once

#include <cuda_runtime.h>

namespace moe::activation {

__device__ __forceinline__ float sigmoidf(float x) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-x))); }

// silu(gate) * up * weight (weight: the row's routing weight, or 1).
__device__ __forceinline__ float swiglu_value(float gate, float up, float weight) {
  return __fmul_rn(__fmul_rn(__fmul_rn(gate, sigmoidf(gate)), up), weight);
}

// The backward at one element: d(gate) and d(up) for the output gradient `dout` (weight: the row's routing
// weight, or 1), and silu(gate) for the routing weight's gradient (sum over the row of dout * silu * up).
struct SwigluGrad {
  float dgate;
  float dup;
  float silu;
};
__device__ __forceinline__ SwigluGrad swiglu_grad(float gate, float up, float dout, float weight) {
  const float s = sigmoidf(gate), silu = __fmul_rn(gate, s), scaled = __fmul_rn(dout, weight);
  const float dsilu = __fadd_rn(s, __fmul_rn(silu, __fsub_rn(1.f, s)));  // s + gate * s * (1 - s)
  return {__fmul_rn(__fmul_rn(scaled, up), dsilu), __fmul_rn(scaled, silu), silu};
}

}  // namespace moe::activation
