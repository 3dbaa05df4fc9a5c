// Fused SwiGLU for the experts: out = silu(gate) * up (* row weight), and its backward, in one pass
// each. h holds [gate | up] per row (the w13 product). Math in fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace moe::activation {

struct SwigluParams {
  const void* h;              // [R, 2F]
  const float* row_weights;   // [R] or nullptr
  void* out;                  // [R, F]
  int64_t rows;
  int64_t ffn;                // F
  DType dtype;
};
void swiglu_fwd(const SwigluParams& p, cudaStream_t stream);

struct SwigluBwdParams {
  const void* dout;           // [R, F]
  const void* h;              // [R, 2F]
  const float* row_weights;   // [R] or nullptr
  void* dh;                   // [R, 2F]
  float* drow_weights;        // [R] or nullptr
  int64_t rows;
  int64_t ffn;
  DType dtype;
};
void swiglu_bwd(const SwigluBwdParams& p, cudaStream_t stream);

}  // namespace moe::activation
