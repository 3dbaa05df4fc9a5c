// Unpermute: out[t] = sum_j w[t,j] * y[row_map[t,j]], and its backward.
//
// Accumulation is fp32 in ascending j with explicitly rounded multiply and add (__fmul_rn/__fadd_rn,
// no FMA contraction), which is exactly what the PyTorch reference computes: results are bit-identical
// to it and run to run. One power-of-two thread group per token walks the row in 16-byte vectors.
#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/rows.cuh"
#include "common/vec.cuh"
#include "permute/permute.h"

namespace moe::permute {
namespace {

constexpr int kSlotBatch = 4;

__device__ __forceinline__ int32_t checked_row(const int32_t* row_map, int64_t slot, int64_t R) {
  const int32_t r = row_map[slot];
  return (r >= 0 && r < R) ? r : -1;
}

template <typename T, int N>
__global__ void __launch_bounds__(kRowBlockThreads)
    unpermute_fwd_kernel(const T* __restrict__ y, const int32_t* __restrict__ row_map,
                         const float* __restrict__ weights, T* __restrict__ out, int64_t num_tokens, int64_t k,
                         int64_t hidden, int64_t num_rows, RowGeometry g) {
  using P = Pack<T, N>;
  const int tpr = g.threads_per_row;
  const int lane = threadIdx.x % tpr;
  const int64_t t = int64_t(blockIdx.x) * g.rows_per_block + threadIdx.x / tpr;
  if (t >= num_tokens) return;
  P* dst = reinterpret_cast<P*>(out + t * hidden);
  for (int64_t v = lane; v < g.row_vecs; v += tpr) {
    float acc[N];
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = 0.f;
    // Slots in batches: the batch's loads are all issued before any is used (memory-level
    // parallelism), then accumulated strictly in ascending slot order (the reference's rounding).
    for (int64_t j0 = 0; j0 < k; j0 += kSlotBatch) {
      P src[kSlotBatch];
      float w[kSlotBatch];
      bool live[kSlotBatch];
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b) {
        const int64_t j = j0 + b;
        const int32_t r = j < k ? checked_row(row_map, t * k + j, num_rows) : -1;
        live[b] = r >= 0;
        w[b] = live[b] && weights != nullptr ? weights[t * k + j] : 1.f;
        if (live[b]) src[b] = reinterpret_cast<const P*>(y + int64_t(r) * hidden)[v];
      }
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b) {
        if (!live[b]) continue;
#pragma unroll
        for (int n = 0; n < N; ++n) {
          const float x = to_float(src[b].v[n]);
          acc[n] = __fadd_rn(acc[n], weights != nullptr ? __fmul_rn(w[b], x) : x);
        }
      }
    }
    P res;
#pragma unroll
    for (int n = 0; n < N; ++n) res.v[n] = from_float<T>(acc[n]);
    dst[v] = res;
  }
}

// Backward: dy[row_map[t,j]] = w[t,j] * dout[t] and dweights[t,j] = <y[row_map[t,j]], dout[t]>.
//
// A group of `lanes` threads per token (a power of two, up to the 128-thread block; bwd_lanes). A batch of
// kBwdSlots slots has its rows and weights loaded up front; then each pass over the row loads one dout
// vector and the batch's y vectors together (kBwdSlots + 1 independent 16-byte loads in flight per thread),
// stores the batch's dy vectors and accumulates one fp32 dot product per slot in registers. dout is read
// once for up to kBwdSlots slots. The dot products are reduced once per batch with butterfly shuffles
// (fixed order: deterministic), not once per slot with block barriers; groups wider than a warp add one
// shared-memory step, one barrier per batch. Written rows are marked in row_mask; zero_unmarked_rows_kernel
// then zeroes the rest (padding and tail rows) and touches no row a slot wrote.
constexpr int kBwdThreads = kRowBlockThreads;
constexpr int kBwdSlots = 8;        // slots whose y rows are read in one pass
constexpr int kBwdItems = 4;      // vectors per thread a row is spread to (fewer passes, shorter load chains)
constexpr int kBwdWarps = kBwdThreads / 32;
// 4 blocks (16 warps) per SM caps registers at 128: the bf16 16-byte variant with dweights needs 124 and
// does not spill; 16 warps x 9 loads of 16 B in flight per thread is about 4x what the copy bandwidth needs.
constexpr int kBwdMinBlocks = 4;

// Sum of a[n] * b[n] over one vector: the products, then a balanced tree (a short rounding chain).
template <typename T, int N>
__device__ __forceinline__ float vec_dot(const Pack<T, N>& a, const float (&b)[N]) {
  float p[N];
#pragma unroll
  for (int n = 0; n < N; ++n) p[n] = __fmul_rn(to_float(a.v[n]), b[n]);
#pragma unroll
  for (int w = N / 2; w > 0; w /= 2) {
#pragma unroll
    for (int n = 0; n < w; ++n) p[n] = __fadd_rn(p[n], p[n + w]);
  }
  return p[0];
}

// DW: dweights wanted (y is read). DY: dy written (false: dweights only, for the FP8 backward that writes dy
// itself; a template flag, not a test per store, so the dy-writing variants keep their registers).
// U: vectors per thread per pass (more loads in flight where no y is read).
template <typename T, int N, bool DW, bool DY = true>
__global__ void __launch_bounds__(kBwdThreads, kBwdMinBlocks)
    unpermute_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ y, const int32_t* __restrict__ row_map,
                         const float* __restrict__ weights, T* __restrict__ dy, float* __restrict__ dweights,
                         uint8_t* __restrict__ row_mask, int64_t num_tokens, int64_t k, int64_t hidden,
                         int64_t num_rows, int lanes) {
  using P = Pack<T, N>;
  constexpr int U = DW ? 1 : 4;
  __shared__ float partial[2][kBwdWarps][kBwdSlots];  // groups wider than a warp: per-warp sums, by batch parity
  const int64_t row_vecs = hidden / N;
  const int lane = threadIdx.x % lanes;
  const int64_t t = int64_t(blockIdx.x) * (kBwdThreads / lanes) + threadIdx.x / lanes;
  const bool live = t < num_tokens;  // threads past the last token stay for the shuffles and barriers
  const P* src = reinterpret_cast<const P*>(dout) + (live ? t : 0) * row_vecs;
  const P* ys = reinterpret_cast<const P*>(y);
  P* dys = reinterpret_cast<P*>(dy);
  for (int64_t j0 = 0, batch = 0; j0 < k; j0 += kBwdSlots, ++batch) {
    int32_t r[kBwdSlots];
    float w[kBwdSlots];
#pragma unroll
    for (int b = 0; b < kBwdSlots; ++b) {
      const int64_t s = t * k + j0 + b;
      r[b] = live && j0 + b < k ? checked_row(row_map, s, num_rows) : -1;
      w[b] = r[b] >= 0 && weights != nullptr ? weights[s] : 1.f;
      if constexpr (DY) {  // the marks feed the zero pass over dy; without dy there is none (row_mask may be null)
        if (r[b] >= 0 && lane == 0) row_mask[r[b]] = 1;
      }
    }
    float dot[kBwdSlots];
#pragma unroll
    for (int b = 0; b < kBwdSlots; ++b) dot[b] = 0.f;
#pragma unroll 1
    for (int64_t v0 = lane; v0 < row_vecs; v0 += int64_t(lanes) * U) {
      P d[U];
      P yv[DW ? kBwdSlots : 1];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + int64_t(u) * lanes;
        if (v < row_vecs) d[u] = src[v];
      }
      if constexpr (DW) {
#pragma unroll
        for (int b = 0; b < kBwdSlots; ++b) {
          if (r[b] >= 0) yv[b] = ys[int64_t(r[b]) * row_vecs + v0];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + int64_t(u) * lanes;
        if (v >= row_vecs) break;
        float df[N];
#pragma unroll
        for (int n = 0; n < N; ++n) df[n] = to_float(d[u].v[n]);
#pragma unroll
        for (int b = 0; b < kBwdSlots; ++b) {
          if (r[b] < 0) continue;
          P res;
#pragma unroll
          for (int n = 0; n < N; ++n) res.v[n] = from_float<T>(__fmul_rn(w[b], df[n]));
          if constexpr (DY) dys[int64_t(r[b]) * row_vecs + v] = res;
          if constexpr (DW) dot[b] = __fadd_rn(dot[b], vec_dot(yv[b], df));
        }
      }
    }
    if constexpr (DW) {
      const int width = lanes < 32 ? lanes : 32;
#pragma unroll
      for (int b = 0; b < kBwdSlots; ++b) {
        for (int off = width / 2; off > 0; off /= 2) dot[b] += __shfl_xor_sync(0xffffffffu, dot[b], off, width);
      }
      if (lanes > 32) {
        // One barrier per batch: the next batch writes the other half of `partial`, and the one after that
        // comes after the next barrier, when this batch's reads are done.
        const int warp = threadIdx.x / 32, buf = int(batch & 1);
        if (threadIdx.x % 32 == 0) {
#pragma unroll
          for (int b = 0; b < kBwdSlots; ++b) partial[buf][warp][b] = dot[b];
        }
        __syncthreads();
        const int first = warp / (lanes / 32) * (lanes / 32);
#pragma unroll
        for (int b = 0; b < kBwdSlots; ++b) {
          float sum = 0.f;
          for (int q = 0; q < lanes / 32; ++q) sum += partial[buf][first + q][b];
          dot[b] = sum;
        }
      }
      if (live && lane == 0) {
#pragma unroll
        for (int b = 0; b < kBwdSlots; ++b) {
          if (j0 + b < k) dweights[t * k + j0 + b] = dot[b];
        }
      }
    }
  }
}

// Zeroes the rows no slot wrote: each warp tests 32 rows' marks with one ballot, then zeroes the unmarked
// ones together, one row at a time. Where every row was written (no dropped slot, no padding) it only
// reads the R bytes of marks. A grid of at most kZeroBlocks blocks strides over the rows.
constexpr int kZeroThreads = 128;
constexpr int64_t kZeroBlocks = 1024;

template <int VB>
__global__ void __launch_bounds__(kZeroThreads)
    zero_unmarked_rows_kernel(char* __restrict__ rows, const uint8_t* __restrict__ row_mask, int64_t num_rows,
                              int64_t row_bytes) {
  using V = typename RawVec<VB>::type;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kZeroThreads / 32);
  const int64_t row_vecs = row_bytes / VB;
  for (int64_t base = (int64_t(blockIdx.x) * (kZeroThreads / 32) + threadIdx.x / 32) * 32; base < num_rows;
       base += warps * 32) {
    const int64_t r = base + lane;
    unsigned todo = __ballot_sync(0xffffffffu, r < num_rows && row_mask[r] == 0);
    while (todo != 0u) {
      const int i = __ffs(int(todo)) - 1;
      todo &= todo - 1u;
      V* dst = reinterpret_cast<V*>(rows + (base + i) * row_bytes);
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = V{};
    }
  }
}

template <typename T, int N>
void launch_fwd(const UnpermuteParams& p, cudaStream_t stream) {
  const RowGeometry g = row_geometry(p.hidden * int64_t(sizeof(T)), int(sizeof(T)) * N);
  const int64_t blocks = (p.num_tokens + g.rows_per_block - 1) / g.rows_per_block;
  unpermute_fwd_kernel<T, N><<<unsigned(blocks), kRowBlockThreads, 0, stream>>>(
      static_cast<const T*>(p.y), p.row_map, p.weights, static_cast<T*>(p.out), p.num_tokens, p.k, p.hidden,
      p.num_rows, g);
  check_launch("unpermute_fwd_kernel");
}

// Threads per token in the backward: the fewest (a power of two, at most the block) that leave each about
// kBwdItems vectors. A deepseek-v3 row (H=7168 bf16, 896 vectors) gets the block, 7 passes per thread.
int bwd_lanes(int64_t row_vecs) {
  int lanes = 1;
  while (lanes < kBwdThreads && int64_t(lanes) * kBwdItems < row_vecs) lanes *= 2;
  return lanes;
}

template <typename T, int N>
void launch_bwd(const UnpermuteBwdParams& p, cudaStream_t stream) {
  const int64_t row_bytes = p.hidden * int64_t(sizeof(T));
  if (p.num_tokens > 0) {
    const int lanes = bwd_lanes(p.hidden / N);
    const int64_t per_block = kBwdThreads / lanes;
    const unsigned blocks = unsigned((p.num_tokens + per_block - 1) / per_block);
    const T* dout = static_cast<const T*>(p.dout);
    const T* y = static_cast<const T*>(p.y);
    T* dy = static_cast<T*>(p.dy);
    if (p.dweights != nullptr && p.dy == nullptr) {
      unpermute_bwd_kernel<T, N, true, false><<<blocks, kBwdThreads, 0, stream>>>(
          dout, y, p.row_map, p.weights, nullptr, p.dweights, p.row_mask, p.num_tokens, p.k, p.hidden, p.num_rows,
          lanes);
    } else if (p.dweights != nullptr) {
      unpermute_bwd_kernel<T, N, true><<<blocks, kBwdThreads, 0, stream>>>(
          dout, y, p.row_map, p.weights, dy, p.dweights, p.row_mask, p.num_tokens, p.k, p.hidden, p.num_rows, lanes);
    } else {
      unpermute_bwd_kernel<T, N, false><<<blocks, kBwdThreads, 0, stream>>>(
          dout, y, p.row_map, p.weights, dy, nullptr, p.row_mask, p.num_tokens, p.k, p.hidden, p.num_rows, lanes);
    }
    check_launch("unpermute_bwd_kernel");
  }
  if (p.num_rows == 0 || p.dy == nullptr) return;
  const int64_t want = (p.num_rows + kZeroThreads - 1) / kZeroThreads;  // a warp per 32 rows
  const unsigned zblocks = unsigned(want < kZeroBlocks ? want : kZeroBlocks);
  zero_unmarked_rows_kernel<int(sizeof(T)) * N><<<zblocks, kZeroThreads, 0, stream>>>(
      static_cast<char*>(p.dy), p.row_mask, p.num_rows, row_bytes);
  check_launch("unpermute zero_unmarked_rows_kernel");
}

}  // namespace

void unpermute_fwd(const UnpermuteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const void* ptrs[] = {p.y, p.out};
  by_float_vector(p.dtype, p.hidden, ptrs, 2, "unpermute", [&]<typename T, int N>() { launch_fwd<T, N>(p, stream); });
}

void unpermute_bwd(const UnpermuteBwdParams& p, cudaStream_t stream) {
  if (p.hidden == 0) {
    if (p.dweights != nullptr && p.num_tokens * p.k > 0) {
      check_cuda(cudaMemsetAsync(p.dweights, 0, sizeof(float) * p.num_tokens * p.k, stream), "unpermute_bwd");
    }
    return;
  }
  if (p.dy == nullptr && p.dweights == nullptr) return;  // nothing asked for
  const void* ptrs[] = {p.dout, p.y, p.dy};
  by_float_vector(p.dtype, p.hidden, ptrs, 3, "unpermute_bwd",
                  [&]<typename T, int N>() { launch_bwd<T, N>(p, stream); });
}

}  // namespace moe::permute
