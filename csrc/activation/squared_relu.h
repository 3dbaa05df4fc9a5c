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
};
void squared_relu_bwd(const SquaredReluBwdParams& p, cudaStream_t stream);

// The squared ReLU writing its result in E4M3 only, in both layouts the FP8 recipe reads, from one read of its
// inputs: the forward's a = relu(h)^2 (the down projection's input; dout null) or the backward's
// dh = squared_relu_bwd(dout, h) (the up projection's output gradient; dout given). 1x128 blocks along F for
// the forward GEMM (or dgrad), F zero-padded to Fp = ceil(F/128) * 128 (the GEMM contracts over it), and 1x128
// blocks along the rows, transposed, for wgrad: bit for bit quantize_fp8(v, "block", pad_to_block=True) and
// quantize_fp8_tokens(v) of the value v the unfused op writes (rounded to h's dtype). F % 8 == 0, dout and h
// 16-byte aligned, fp16 or bf16 (a 128 x 128 fp32 tile would not fit 48 KB of static shared memory).
struct SquaredReluFp8Params {
  const void* dout;           // [R, F], or nullptr: the forward
  const void* h;              // [R, F]
  uint8_t* q;                 // [R, Fp], codes past F zero
  float* scale;               // [R, Fp / 128]
  uint8_t* q_t;               // [F, Rp], Rp = R rounded up to 128 (padding codes 0); 16-byte aligned
  float* scale_t;             // [F, Rp / 128]
  int64_t rows;
  int64_t ffn;                // F
  bool pow2;
  DType dtype;
};
void squared_relu_fp8(const SquaredReluFp8Params& p, cudaStream_t stream);

}  // namespace moe::activation
