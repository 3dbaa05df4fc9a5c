// Elementwise producers that write their result in E4M3 only, in both layouts the FP8 recipe's GEMMs read, from
// one read of their inputs: the value v itself (quantize_fp8_dual: a GEMM operand and its wgrad copy in one pass),
// the squared ReLU's forward a = relu(x)^2 (the down projection's input of experts without a gate) and its
// backward dx = squared_relu_bwd(dout, x) (the up projection's output gradient). Layouts: 1x128 blocks along
// the columns for the forward GEMM (or dgrad), the columns zero-padded to Cp = ceil(C/128) * 128 (the GEMM
// contracts over them), and 1x128 blocks along the rows, transposed, for wgrad: bit for bit
// quantize_fp8(v, "block", pad_to_block=True) and quantize_fp8_tokens(v) of the value v the unfused op writes
// (rounded to x's dtype). C % 8 == 0, x and dout 16-byte aligned, fp16 or bf16 (a 128 x 128 fp32 tile would not
// fit 48 KB of static shared memory).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace moe::activation {

enum class RowsFp8Op : int32_t { kIdentity = 0, kSquaredRelu = 1, kSquaredReluBwd = 2 };

struct RowsFp8Params {
  RowsFp8Op op;
  const void* x;              // [R, C]
  const void* dout;           // [R, C] (kSquaredReluBwd), else nullptr
  uint8_t* q;                 // [R, Cp], codes past C zero
  float* scale;               // [R, Cp / 128]
  uint8_t* q_t;               // [C, Rp], Rp = R rounded up to 128 (padding codes 0); 16-byte aligned
  float* scale_t;             // [C, Rp / 128]
  int64_t rows;
  int64_t cols;               // C
  bool pow2;
  DType dtype;
};
void rows_fp8(const RowsFp8Params& p, cudaStream_t stream);

}  // namespace moe::activation
