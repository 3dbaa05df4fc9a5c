// Row-parallel launch geometry shared by the memory-bound kernels (permute, unpermute, ...).
// A row of `row_bytes` is split into `vec_bytes`-wide vectors; a power-of-two group of threads
// owns one row and walks it in strides of the group size, so small rows pack several per block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe {

constexpr int kRowBlockThreads = 128;
// Vectors held in registers per thread in one pass over a row: enough to cover a 7168-wide bf16
// row (896 x 16 B) with 128 threads in one pass.
constexpr int kRowItems = 8;

struct RowGeometry {
  int vec_bytes;        // 16, 8, 4, 2 or 1
  int64_t row_vecs;     // vectors per row
  int threads_per_row;  // power of two, <= kRowBlockThreads
  int rows_per_block;
};

inline int widest_vector(int64_t row_bytes, const void* const* ptrs, int n_ptrs) {
  for (int vb = 16; vb > 1; vb /= 2) {
    bool ok = (row_bytes % vb) == 0;
    for (int i = 0; i < n_ptrs && ok; ++i) {
      ok = ptrs[i] == nullptr || (reinterpret_cast<uintptr_t>(ptrs[i]) % vb) == 0;
    }
    if (ok) return vb;
  }
  return 1;
}

inline RowGeometry row_geometry(int64_t row_bytes, int vec_bytes) {
  RowGeometry g;
  g.vec_bytes = vec_bytes;
  g.row_vecs = row_bytes / vec_bytes;
  int64_t want = (g.row_vecs + kRowItems - 1) / kRowItems;
  int tpr = 1;
  while (tpr < want && tpr < kRowBlockThreads) tpr *= 2;
  g.threads_per_row = tpr;
  g.rows_per_block = kRowBlockThreads / tpr;
  return g;
}

// Sum across the `tpr` threads that own one row, in a fixed order (bit-identical run to run).
// `scratch` needs kRowBlockThreads / 32 floats of shared memory; every thread of the block must call
// (threads without a row pass 0), because of the full-warp shuffles and the barriers.
__device__ __forceinline__ float row_sum(float v, int tpr, float* scratch) {
  const int lanes = tpr < 32 ? tpr : 32;
  for (int off = lanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off, lanes);
  if (tpr > 32) {
    const int warps = tpr / 32;
    const int warp = threadIdx.x / 32;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[warp] = v;
    __syncthreads();
    const int first = (warp / warps) * warps;
    v = 0.f;
    for (int w = 0; w < warps; ++w) v += scratch[first + w];
  }
  return v;
}

}  // namespace moe
