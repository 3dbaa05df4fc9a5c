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
  void* dh;                   // [R, 2F], or nullptr: only drow_weights
  float* drow_weights;        // [R] or nullptr
  int64_t rows;
  int64_t ffn;
  DType dtype;
  // [R, F] or nullptr: the forward's output recomputed from the h this pass reads, bit for bit swiglu_fwd's (the
  // down projection's weight gradient reads it; the forward need not keep it).
  void* act = nullptr;
};
void swiglu_bwd(const SwigluBwdParams& p, cudaStream_t stream);

// The forward writing the down projection's input in E4M3 only, in both layouts the FP8 recipe reads
// (quant/fp8.h's rules, bit for bit quantize_fp8(swiglu(h), "block", pad_to_block=True) and
// quantize_fp8_tokens(swiglu(h))): 1x128 blocks along F for the forward GEMM (F zero-padded to Fp, a multiple of
// 128, which the GEMM contracts over), 1x128 blocks along the rows, transposed, for wgrad. The value quantized is
// the activation rounded to h's dtype, as the composition quantizes it. F % 8 == 0, h 16-byte aligned, fp16 or
// bf16 (a 128 x 128 fp32 tile would not fit 48 KB of static shared memory).
struct SwigluFp8Params {
  const void* h;              // [R, 2F]
  const float* row_weights;   // [R] or nullptr
  uint8_t* q;                 // [R, Fp], codes past F zero
  float* scale;               // [R, Fp / 128]
  uint8_t* q_t;               // [F, Rp], Rp = R rounded up to 128; 16-byte aligned
  float* scale_t;             // [F, Rp / 128]
  int64_t rows;
  int64_t ffn;
  bool pow2;
  DType dtype;
};
void swiglu_fwd_fp8(const SwigluFp8Params& p, cudaStream_t stream);

// The backward writing dh = [d(gate) | d(up)] in E4M3 only, in both layouts the up projection's FP8 backward
// reads (bit for bit quantize_fp8(dh, "block", pad_to_block=True) and quantize_fp8_tokens(dh) of swiglu_bwd's
// dh): 1x128 blocks along 2F for dgrad (2F zero-padded to Wp, a multiple of 128), 1x128 blocks along the rows,
// transposed, for wgrad. The value quantized is the gradient rounded to h's dtype, as the composition quantizes
// it. The routing weights' gradient is not computed here (swiglu_bwd with dh null gives it in its own reduction
// order). F % 8 == 0, dout and h 16-byte aligned, fp16 or bf16.
struct SwigluBwdFp8Params {
  const void* dout;           // [R, F]
  const void* h;              // [R, 2F]
  const float* row_weights;   // [R] or nullptr
  uint8_t* q;                 // [R, Wp], codes past 2F zero
  float* scale;               // [R, Wp / 128]
  uint8_t* q_t;               // [2F, Rp], Rp = R rounded up to 128; 16-byte aligned
  float* scale_t;             // [2F, Rp / 128]
  int64_t rows;
  int64_t ffn;
  bool pow2;
  DType dtype;
};
void swiglu_bwd_fp8(const SwigluBwdFp8Params& p, cudaStream_t stream);

}  // namespace moe::activation
