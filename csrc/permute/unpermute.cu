// Unpermute: out[t] = sum_j w[t,j] * y[row_map[t,j]], and its backward.
//
// Accumulation is fp32 in ascending j with explicitly rounded multiply and add (__fmul_rn/__fadd_rn,
// no FMA contraction), which is exactly what the PyTorch reference computes: results are bit-identical
// to it and run to run. One power-of-two thread group per token walks the row in 16-byte vectors.
#include "common/check.h"
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

// dy[row_map[t,j]] = w[t,j] * dout[t] and dweights[t,j] = <y[row_map[t,j]], dout[t]>; marks written rows.
template <typename T, int N>
__global__ void __launch_bounds__(kRowBlockThreads)
    unpermute_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ y, const int32_t* __restrict__ row_map,
                         const float* __restrict__ weights, T* __restrict__ dy, float* __restrict__ dweights,
                         uint8_t* __restrict__ row_mask, int64_t num_tokens, int64_t k, int64_t hidden,
                         int64_t num_rows, RowGeometry g) {
  using P = Pack<T, N>;
  __shared__ float scratch[kRowBlockThreads / 32];
  const int tpr = g.threads_per_row;
  const int lane = threadIdx.x % tpr;
  const int64_t t = int64_t(blockIdx.x) * g.rows_per_block + threadIdx.x / tpr;
  const bool live = t < num_tokens;  // dead threads stay for the shuffles and barriers of row_sum
  const P* src = reinterpret_cast<const P*>(dout + (live ? t : 0) * hidden);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t r = live ? checked_row(row_map, t * k + j, num_rows) : -1;
    float dot = 0.f;
    if (r >= 0) {
      const float w = weights != nullptr ? weights[t * k + j] : 1.f;
      P* out = reinterpret_cast<P*>(dy + int64_t(r) * hidden);
      const P* yrow = reinterpret_cast<const P*>(y + int64_t(r) * hidden);
      for (int64_t v = lane; v < g.row_vecs; v += tpr) {
        const P d = src[v];  // re-read per slot: served from L1 after the first
        P res;
#pragma unroll
        for (int n = 0; n < N; ++n) res.v[n] = from_float<T>(__fmul_rn(w, to_float(d.v[n])));
        out[v] = res;
        if (dweights != nullptr) {
          const P yv = yrow[v];
#pragma unroll
          for (int n = 0; n < N; ++n) dot = __fmaf_rn(to_float(yv.v[n]), to_float(d.v[n]), dot);
        }
      }
      if (lane == 0) row_mask[r] = 1;
    }
    if (dweights != nullptr) {
      dot = row_sum(dot, tpr, scratch);
      if (live && lane == 0) dweights[t * k + j] = dot;
    }
  }
}

template <int VB>
__global__ void __launch_bounds__(kRowBlockThreads)
    zero_unmarked_rows_kernel(char* __restrict__ rows, const uint8_t* __restrict__ row_mask, int64_t num_rows,
                              int64_t row_bytes, RowGeometry g) {
  using V = typename RawVec<VB>::type;
  const int tpr = g.threads_per_row;
  const int64_t r = int64_t(blockIdx.x) * g.rows_per_block + threadIdx.x / tpr;
  if (r >= num_rows || row_mask[r]) return;
  V* dst = reinterpret_cast<V*>(rows + r * row_bytes);
  for (int64_t v = threadIdx.x % tpr; v < g.row_vecs; v += tpr) dst[v] = V{};
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

template <typename T, int N>
void launch_bwd(const UnpermuteBwdParams& p, cudaStream_t stream) {
  const int64_t row_bytes = p.hidden * int64_t(sizeof(T));
  const RowGeometry g = row_geometry(row_bytes, int(sizeof(T)) * N);
  if (p.num_tokens > 0) {
    const int64_t blocks = (p.num_tokens + g.rows_per_block - 1) / g.rows_per_block;
    unpermute_bwd_kernel<T, N><<<unsigned(blocks), kRowBlockThreads, 0, stream>>>(
        static_cast<const T*>(p.dout), static_cast<const T*>(p.y), p.row_map, p.weights, static_cast<T*>(p.dy),
        p.dweights, p.row_mask, p.num_tokens, p.k, p.hidden, p.num_rows, g);
    check_launch("unpermute_bwd_kernel");
  }
  if (p.num_rows == 0) return;
  const int64_t zblocks = (p.num_rows + g.rows_per_block - 1) / g.rows_per_block;
  zero_unmarked_rows_kernel<int(sizeof(T)) * N><<<unsigned(zblocks), kRowBlockThreads, 0, stream>>>(
      static_cast<char*>(p.dy), p.row_mask, p.num_rows, row_bytes, g);
  check_launch("unpermute zero_unmarked_rows_kernel");
}

// Widest vector (in elements of T) that the row length and the base pointers allow.
template <typename T>
int vector_elems(int64_t hidden, const void* const* ptrs, int n) {
  return widest_vector(hidden * int64_t(sizeof(T)), ptrs, n) / int(sizeof(T));
}

template <typename T, typename Params, typename Launch>
void dispatch_vec(const Params& p, int elems, Launch&& launch) {
  constexpr int kMax = 16 / int(sizeof(T));
  if (elems >= kMax) return launch.template operator()<T, kMax>();
  if (kMax >= 4 && elems >= 4) return launch.template operator()<T, (kMax >= 4 ? 4 : 1)>();
  if (kMax >= 2 && elems >= 2) return launch.template operator()<T, (kMax >= 2 ? 2 : 1)>();
  return launch.template operator()<T, 1>();
}

template <typename Params, typename Launch>
void dispatch_dtype(const Params& p, const void* const* ptrs, int n, const char* what, Launch&& launch) {
  switch (p.dtype) {
    case DType::kFloat32:
      return dispatch_vec<float>(p, vector_elems<float>(p.hidden, ptrs, n), launch);
    case DType::kFloat16:
      return dispatch_vec<__half>(p, vector_elems<__half>(p.hidden, ptrs, n), launch);
    case DType::kBFloat16:
      return dispatch_vec<__nv_bfloat16>(p, vector_elems<__nv_bfloat16>(p.hidden, ptrs, n), launch);
    default:
      throw std::invalid_argument(std::string(what) + ": dtype must be float32, float16 or bfloat16");
  }
}

}  // namespace

void unpermute_fwd(const UnpermuteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const void* ptrs[] = {p.y, p.out};
  dispatch_dtype(p, ptrs, 2, "unpermute", [&]<typename T, int N>() { launch_fwd<T, N>(p, stream); });
}

void unpermute_bwd(const UnpermuteBwdParams& p, cudaStream_t stream) {
  if (p.hidden == 0) {
    if (p.dweights != nullptr && p.num_tokens * p.k > 0) {
      check_cuda(cudaMemsetAsync(p.dweights, 0, sizeof(float) * p.num_tokens * p.k, stream), "unpermute_bwd");
    }
    return;
  }
  const void* ptrs[] = {p.dout, p.y, p.dy};
  dispatch_dtype(p, ptrs, 3, "unpermute_bwd", [&]<typename T, int N>() { launch_bwd<T, N>(p, stream); });
}

}  // namespace moe::permute
