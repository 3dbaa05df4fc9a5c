// Fused squared ReLU: elementwise over a contiguous tensor in the widest vectors that divide its length and
// every pointer's alignment (no tail), a grid-stride loop over 64-bit indices (tensors past 2^31 elements).
#include <algorithm>

#include "activation/squared_relu.h"
#include "activation/squared_relu_math.cuh"
#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/vec.cuh"

namespace moe::activation {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // a grid-stride loop past this: enough blocks to fill any GPU

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    squared_relu_fwd_kernel(const T* __restrict__ h, T* __restrict__ out, int64_t n) {
  using P = Pack<T, N>;
  const int64_t vecs = n / N;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < vecs; v += stride) {
    const P x = reinterpret_cast<const P*>(h)[v];
    P y;
#pragma unroll
    for (int i = 0; i < N; ++i) y.v[i] = from_float<T>(squared_relu_value(to_float(x.v[i])));
    reinterpret_cast<P*>(out)[v] = y;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    squared_relu_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ h, T* __restrict__ dh,
                            T* __restrict__ act, int64_t n) {
  using P = Pack<T, N>;
  const int64_t vecs = n / N;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < vecs; v += stride) {
    const P x = reinterpret_cast<const P*>(h)[v], d = reinterpret_cast<const P*>(dout)[v];
    P g;
#pragma unroll
    for (int i = 0; i < N; ++i) g.v[i] = from_float<T>(squared_relu_grad<T>(to_float(x.v[i]), to_float(d.v[i])));
    reinterpret_cast<P*>(dh)[v] = g;
    if (act != nullptr) {  // the forward's output, recomputed
      P y;
#pragma unroll
      for (int i = 0; i < N; ++i) y.v[i] = from_float<T>(squared_relu_value(to_float(x.v[i])));
      reinterpret_cast<P*>(act)[v] = y;
    }
  }
}

unsigned blocks_for(int64_t vecs) { return unsigned(std::min<int64_t>((vecs + kThreads - 1) / kThreads, kMaxBlocks)); }

}  // namespace

void squared_relu_fwd(const SquaredReluParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const void* ptrs[] = {p.h, p.out};
  by_float_vector(p.dtype, p.n, ptrs, 2, "squared_relu", [&]<typename T, int N>() {
    squared_relu_fwd_kernel<T, N><<<blocks_for(p.n / N), kThreads, 0, stream>>>(static_cast<const T*>(p.h),
                                                                                 static_cast<T*>(p.out), p.n);
  });
  check_launch("squared_relu_fwd_kernel");
}

void squared_relu_bwd(const SquaredReluBwdParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const void* ptrs[] = {p.dout, p.h, p.dh, p.act};
  by_float_vector(p.dtype, p.n, ptrs, 4, "squared_relu_bwd", [&]<typename T, int N>() {
    squared_relu_bwd_kernel<T, N><<<blocks_for(p.n / N), kThreads, 0, stream>>>(
        static_cast<const T*>(p.dout), static_cast<const T*>(p.h), static_cast<T*>(p.dh), static_cast<T*>(p.act),
        p.n);
  });
  check_launch("squared_relu_bwd_kernel");
}

}  // namespace moe::activation
