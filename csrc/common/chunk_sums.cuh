// Column sums of per-chunk partials by one block, in a fixed order: the finish of a launch whose blocks each
// wrote one row of a [chunks, E] array (the router's and the balancing losses' last block).
//
// Items are VEC adjacent columns of one segment (a run of `per_seg` chunks: a sequence). With fewer items
// than threads, J = min(32, threads / items) lanes split a segment's chunks (lane j takes j, j + J, ...),
// each adding its chunks in order with ACC loads in flight, and lane 0 adds the other lanes in lane order.
// The order depends on (E, segments, per_seg, blockDim) alone, never on scheduling. One thread adding every chunk of a
// column in turn waits on one L2 round trip per few chunks: 64 of them for 256 chunks, where this waits on
// 256 / (J * ACC).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe {

template <typename T>
struct Vec4Of;
template <>
struct Vec4Of<float> {
  using type = float4;
};
template <>
struct Vec4Of<int32_t> {
  using type = int4;
};

// VEC elements at p, from L2 (the partials were written by other blocks of the same launch).
template <int VEC, typename T>
__device__ __forceinline__ void load_cg(const T* p, T* out) {
  if constexpr (VEC == 4) {
    const auto v = __ldcg(reinterpret_cast<const typename Vec4Of<T>::type*>(p));
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else {
    out[0] = __ldcg(p);
  }
}

// True in every thread of the block that is the launch's last to get here, by an atomic ticket on `counter`
// (zero at launch; that block leaves it at zero again, after its finish). Every block's global writes before
// the call are visible to it. Every thread of each block calls it.
__device__ inline bool is_last_block(uint32_t* counter) {
  __shared__ uint32_t last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1 ? 1u : 0u;
  __syncthreads();
  const bool is_last = last != 0u;
  if (is_last) __threadfence();
  return is_last;
}

template <int VEC>
struct ChunkLane {
  float f[VEC];
  int32_t n[VEC];
};

// Shared memory the caller provides: one ChunkLane<VEC> per thread.
template <int VEC>
__host__ __device__ constexpr size_t chunk_lanes_bytes(int threads) {
  return sizeof(ChunkLane<VEC>) * size_t(threads);
}

// For every segment s < segments and column e < E: f = sum of fsum[c * E + e] and n = sum of nsum[c * E + e]
// (either may be null: its sum is 0) over the chunks c of s, [s * per_seg, (s + 1) * per_seg); then emit(s, e, f, n),
// once per (s, e), by one thread. VEC = 4 needs E % 4 == 0 and 16-byte aligned arrays. Every thread of the
// block calls it (it synchronises); `lanes` may be reused after it returns.
template <int VEC, int ACC, typename Emit>
__device__ void chunk_column_sums(const float* fsum, const int32_t* nsum, int64_t E, int64_t segments,
                                  int64_t per_seg, ChunkLane<VEC>* lanes, Emit&& emit) {
  const int threads = blockDim.x;
  const int64_t per_row = E / VEC, items = segments * per_row;
  if (items == 0) return;
  const int J = items >= threads ? 1 : (threads / items < 32 ? int(threads / items) : 32);
  const int64_t step = J == 1 ? threads : items;
  for (int64_t base = 0; base < items; base += step) {
    const int64_t item = base + (J == 1 ? threadIdx.x : threadIdx.x % items);
    const int j = J == 1 ? 0 : int(threadIdx.x / items);
    const bool active = item < items && j < J;
    const int64_t s = item / per_row, e0 = (item % per_row) * VEC;
    ChunkLane<VEC> v{};
    if (active) {
      const float* pf = fsum != nullptr ? fsum + s * per_seg * E + e0 : nullptr;
      const int32_t* pn = nsum != nullptr ? nsum + s * per_seg * E + e0 : nullptr;
      int64_t c = j;
      for (; c + (ACC - 1) * J < per_seg; c += ACC * J) {  // ACC loads in flight, added in chunk order
        float lf[ACC][VEC] = {};
        int32_t ln[ACC][VEC] = {};
#pragma unroll
        for (int u = 0; u < ACC; ++u) {
          if (pf != nullptr) load_cg<VEC>(pf + (c + u * J) * E, lf[u]);
          if (pn != nullptr) load_cg<VEC>(pn + (c + u * J) * E, ln[u]);
        }
#pragma unroll
        for (int u = 0; u < ACC; ++u) {
#pragma unroll
          for (int q = 0; q < VEC; ++q) v.f[q] += lf[u][q], v.n[q] += ln[u][q];
        }
      }
      for (; c < per_seg; c += J) {
        float lf[VEC] = {};
        int32_t ln[VEC] = {};
        if (pf != nullptr) load_cg<VEC>(pf + c * E, lf);
        if (pn != nullptr) load_cg<VEC>(pn + c * E, ln);
#pragma unroll
        for (int q = 0; q < VEC; ++q) v.f[q] += lf[q], v.n[q] += ln[q];
      }
    }
    if (J > 1) {  // one pass: every thread stores its lane, then lane 0 adds the others in order
      lanes[threadIdx.x] = v;
      __syncthreads();
      if (active && j == 0) {
        for (int l = 1; l < J; ++l) {
          const ChunkLane<VEC>& o = lanes[l * items + item];
#pragma unroll
          for (int q = 0; q < VEC; ++q) v.f[q] += o.f[q], v.n[q] += o.n[q];
        }
      }
      __syncthreads();
    }
    if (active && j == 0) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) emit(s, e0 + q, v.f[q], v.n[q]);
    }
  }
}

}  // namespace moe
