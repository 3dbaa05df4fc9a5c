// Warp-wide reductions. Butterfly (xor) shuffles: every lane ends with the same value, combined in the
// same fixed order, so results are deterministic.
#pragma once

#include <cuda_runtime.h>

namespace moe {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

}  // namespace moe
