// Amax helpers shared by the quantization kernels: a max that propagates NaN (as torch.amax does),
// warp and block reductions of it, and a grid-wide amax of |x| into one word.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/vec.cuh"

namespace moe::quant {

constexpr int kAmaxThreads = 256;
constexpr uint32_t kNanBits = 0x7fc00000u;  // above the bits of every non-negative float, inf included

// max that propagates NaN (torch.amax does): once NaN, always NaN.
__device__ __forceinline__ float nan_max(float m, float a) { return (a > m || isnan(a)) ? a : m; }

__device__ __forceinline__ float warp_nan_max(float m, int width = 32) {
#pragma unroll
  for (int off = width / 2; off > 0; off /= 2) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, off, width));
  return m;
}

// amax over a block of kAmaxThreads threads, returned to every thread.
__device__ inline float block_nan_max(float m) {
  __shared__ float warp_m[kAmaxThreads / 32];
  __shared__ float result;
  m = warp_nan_max(m);
  if (threadIdx.x % 32 == 0) warp_m[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = 0.f;
    for (int w = 0; w < kAmaxThreads / 32; ++w) r = nan_max(r, warp_m[w]);
    result = r;
  }
  __syncthreads();
  const float r = result;
  __syncthreads();  // `result` and `warp_m` may be reused by the next call
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads) tensor_amax_kernel(const T* __restrict__ x, int64_t n, uint32_t* amax) {
  float m = 0.f;
  const int64_t stride = int64_t(gridDim.x) * kAmaxThreads;
  for (int64_t i = int64_t(blockIdx.x) * kAmaxThreads + threadIdx.x; i < n; i += stride) m = nan_max(m, fabsf(to_float(x[i])));
  m = block_nan_max(m);
  if (threadIdx.x == 0) atomicMax(amax, isnan(m) ? kNanBits : __float_as_uint(m));
}

}  // namespace moe::quant
