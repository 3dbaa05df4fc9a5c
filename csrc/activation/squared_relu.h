// Fused squared ReLU for experts without a gate (Nemotron-H's, Primer's): out = relu(h)^2, and its backward
// dh = 2 relu(h) dout, one pass each way (torch's relu then square take two kernels forward, three backward,
// and keep relu(h) for the backward). Math in fp32, each product rounded to the dtype as torch rounds it: bit for
// bit torch's in every dtype (relu and 2 relu(h) are exact but for overflow, and a product of two 16-bit values is
// exact in fp32).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace moe::activation {

struct SquaredReluParams {
  const void* h;   // [n] (a contiguous [R, F])
  void* out;       // [n]
  int64_t n;       // elements
  DType dtype;
};
void squared_relu_fwd(const SquaredReluParams& p, cudaStream_t stream);

struct SquaredReluBwdParams {
  const void* dout;  // [n]
  const void* h;     // [n]
  void* dh;          // [n]
  int64_t n;
  DType dtype;
  void* act = nullptr;  // [n] or nullptr: the forward's output recomputed from h, bit for bit squared_relu_fwd's
};
void squared_relu_bwd(const SquaredReluBwdParams& p, cudaStream_t stream);

}  // namespace moe::activation
