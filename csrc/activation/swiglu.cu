// Fused SwiGLU: one pass reads [gate | up] and writes the activation (torch's silu(g) * u * w takes three
// kernels and twice the traffic); the backward reads h and dout once and writes dh, plus the row-weight
// gradient as a fixed-order row reduction, and, where asked, the forward's output again (so the forward's
// callers need not keep it for the down projection's weight gradient).
#include "activation/swiglu.h"
#include "activation/swiglu_math.cuh"
#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/rows.cuh"
#include "common/vec.cuh"

namespace moe::activation {
namespace {

template <typename T, int N>
__global__ void __launch_bounds__(kRowBlockThreads)
    swiglu_fwd_kernel(const T* __restrict__ h, const float* __restrict__ w, T* __restrict__ out, int64_t rows,
                      int64_t ffn, RowGeometry g) {
  using P = Pack<T, N>;
  const int tpr = g.threads_per_row;
  const int64_t r = int64_t(blockIdx.x) * g.rows_per_block + threadIdx.x / tpr;
  if (r >= rows) return;
  const P* gate = reinterpret_cast<const P*>(h + r * 2 * ffn);
  const P* up = reinterpret_cast<const P*>(h + r * 2 * ffn + ffn);
  P* dst = reinterpret_cast<P*>(out + r * ffn);
  const float scale = w != nullptr ? w[r] : 1.f;
  for (int64_t v = threadIdx.x % tpr; v < g.row_vecs; v += tpr) {
    const P gv = gate[v], uv = up[v];
    P res;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      res.v[n] = from_float<T>(swiglu_value(to_float(gv.v[n]), to_float(uv.v[n]), scale));
    }
    dst[v] = res;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kRowBlockThreads)
    swiglu_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ h, const float* __restrict__ w,
                      T* __restrict__ dh, float* __restrict__ dw, T* __restrict__ act, int64_t rows, int64_t ffn,
                      RowGeometry g) {
  using P = Pack<T, N>;
  __shared__ float scratch[kRowBlockThreads / 32];
  const int tpr = g.threads_per_row;
  const int64_t r = int64_t(blockIdx.x) * g.rows_per_block + threadIdx.x / tpr;
  const bool live = r < rows;  // dead threads stay for row_sum's shuffles and barriers
  const int64_t rr = live ? r : 0;
  const P* gate = reinterpret_cast<const P*>(h + rr * 2 * ffn);
  const P* up = reinterpret_cast<const P*>(h + rr * 2 * ffn + ffn);
  const P* d = reinterpret_cast<const P*>(dout + rr * ffn);
  // dh null: only the routing weights' gradient (the FP8 backward writes dh itself).
  P* dgate = dh != nullptr ? reinterpret_cast<P*>(dh + rr * 2 * ffn) : nullptr;
  P* dup = dh != nullptr ? reinterpret_cast<P*>(dh + rr * 2 * ffn + ffn) : nullptr;
  P* a = act != nullptr ? reinterpret_cast<P*>(act + rr * ffn) : nullptr;  // the forward's output, recomputed
  const float scale = w != nullptr && live ? w[rr] : 1.f;
  float dot = 0.f;
  if (live) {
    for (int64_t v = threadIdx.x % tpr; v < g.row_vecs; v += tpr) {
      const P gv = gate[v], uv = up[v], dv = d[v];
      P rg, ru, ra;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const float gt = to_float(gv.v[n]), u = to_float(uv.v[n]), go = to_float(dv.v[n]);
        const SwigluGrad gr = swiglu_grad(gt, u, go, scale);
        rg.v[n] = from_float<T>(gr.dgate);
        ru.v[n] = from_float<T>(gr.dup);
        if (a != nullptr) ra.v[n] = from_float<T>(swiglu_value(gt, u, scale));
        dot = fmaf(go, gr.silu * u, dot);
      }
      if (dgate != nullptr) {
        dgate[v] = rg;
        dup[v] = ru;
      }
      if (a != nullptr) a[v] = ra;
    }
  }
  if (dw != nullptr) {
    dot = row_sum(dot, tpr, scratch);
    if (live && threadIdx.x % tpr == 0) dw[r] = dot;
  }
}

}  // namespace

void swiglu_fwd(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.ffn == 0) return;
  const void* ptrs[] = {p.h, p.out};
  // Vectors never straddle gate and up: the width must divide F, the row stride and the pointers.
  by_float_vector(p.dtype, p.ffn, ptrs, 2, "swiglu", [&]<typename T, int N>() {
    const RowGeometry g = row_geometry(p.ffn * int64_t(sizeof(T)), int(sizeof(T)) * N);
    const int64_t blocks = (p.rows + g.rows_per_block - 1) / g.rows_per_block;
    swiglu_fwd_kernel<T, N><<<unsigned(blocks), kRowBlockThreads, 0, stream>>>(
        static_cast<const T*>(p.h), p.row_weights, static_cast<T*>(p.out), p.rows, p.ffn, g);
  });
  check_launch("swiglu_fwd_kernel");
}

void swiglu_bwd(const SwigluBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  if (p.ffn == 0) {
    if (p.drow_weights != nullptr) check_cuda(cudaMemsetAsync(p.drow_weights, 0, p.rows * sizeof(float), stream), "swiglu");
    return;
  }
  const void* ptrs[] = {p.dout, p.h, p.dh, p.act};
  by_float_vector(p.dtype, p.ffn, ptrs, 4, "swiglu_bwd", [&]<typename T, int N>() {
    const RowGeometry g = row_geometry(p.ffn * int64_t(sizeof(T)), int(sizeof(T)) * N);
    const int64_t blocks = (p.rows + g.rows_per_block - 1) / g.rows_per_block;
    swiglu_bwd_kernel<T, N><<<unsigned(blocks), kRowBlockThreads, 0, stream>>>(
        static_cast<const T*>(p.dout), static_cast<const T*>(p.h), p.row_weights, static_cast<T*>(p.dh),
        p.drow_weights, static_cast<T*>(p.act), p.rows, p.ffn, g);
  });
  check_launch("swiglu_bwd_kernel");
}

}  // namespace moe::activation
