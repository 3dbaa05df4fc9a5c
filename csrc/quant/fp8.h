// FP8 quantization (specs/lowprec.md, "FP8 scaling recipes"): current scaling per tensor, per row, per
// 1x128 block along K (activations, gradients) or per 128x128 tile (weights).
//
//   scale = fmax / amax    (fmax 448 for E4M3, 57344 for E5M2; amax of 0, inf or NaN gives 1; a quotient
//                           past the fp32 range is clamped to the largest finite float)
//   scale = 2^floor(log2(scale)) with pow2 (the exponent bits only)
//   q     = fp8(x * scale) round-to-nearest-even, saturated to +-fmax; NaN stays NaN (0x7f)
//   x'    = q / scale
// The reference in moe_kernels/ops/quant.py defines the same order of operations; results match it
// bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace moe::quant {

constexpr int kFp8Block = 128;

enum class Granularity : int32_t { kTensor = 0, kRow = 1, kBlock = 2, kTile = 3 };

struct Fp8QuantParams {
  const void* x;      // [rows, cols], dtype
  uint8_t* q;         // [rows, cols] fp8 bytes
  float* scale;       // tensor: [1]; row: [rows]; block: [rows, ceil(cols/128)]; tile: [ceil(rows/128), ceil(cols/128)]
  uint32_t* amax;     // tensor granularity only: one word of scratch
  int64_t rows;
  int64_t cols;
  Granularity granularity;
  bool e5m2;
  bool pow2;
  DType dtype;
  // block granularity: q's row length, cols (0: the same) or more, up to ceil(cols/128) * 128, the codes
  // past cols written as zeros (the operand of an FP8 GEMM whose K is no multiple of 128, zero-padded)
  int64_t q_cols = 0;
};
void fp8_quantize(const Fp8QuantParams& p, cudaStream_t stream);

struct Fp8DequantParams {
  const uint8_t* q;   // [rows, cols] fp8 bytes
  const float* scale; // as above
  void* out;          // [rows, cols], dtype
  int64_t rows;
  int64_t cols;
  Granularity granularity;
  bool e5m2;
  DType dtype;
};
void fp8_dequantize(const Fp8DequantParams& p, cudaStream_t stream);

// 1x128 blocks along the rows (the tokens), written transposed: quantize_fp8(pad(x)^T, block) with the
// rows zero-padded to padded_rows = rows rounded up to 128, in one pass (wgrad's operands).
struct Fp8TokensQuantParams {
  const void* x;      // [rows, cols], dtype
  uint8_t* q;         // [cols, padded_rows] fp8 bytes, 16-byte aligned
  float* scale;       // [cols, padded_rows / 128]
  int64_t rows;
  int64_t cols;
  bool e5m2;
  bool pow2;
  DType dtype;
};
void fp8_quantize_tokens(const Fp8TokensQuantParams& p, cudaStream_t stream);

// Expert weights in 128x128 tiles, both layouts from one read: the forward's codes [E, N, K] with scales
// [E, ceil(N/128), ceil(K/128)], and dgrad's transposed codes [E, K, N] with scales [E, ceil(K/128),
// ceil(N/128)]. A 128x128 tile is its own transpose, so these are the same codes and scales laid out the
// other way: bit for bit quantize_fp8(w[e], tile) per expert, then transpose(1, 2). E4M3.
struct Fp8ExpertsQuantParams {
  const void* w;      // [experts, rows, cols], dtype
  uint8_t* q;         // [experts, rows, cols] fp8 bytes
  float* scale;       // [experts, ceil(rows/128), ceil(cols/128)]
  uint8_t* q_t;       // [experts, cols, rows] fp8 bytes; nullptr: the row-major layout only (then scale_t unused)
  float* scale_t;     // [experts, ceil(cols/128), ceil(rows/128)]
  int64_t experts;
  int64_t rows;       // N
  int64_t cols;       // K
  bool pow2;
  DType dtype;
  bool e5m2 = false;  // E5M2 codes, the row-major layout alone (the generic tile quantization); dual: E4M3
  // With both layouts, an fp32 w (the master weights) may be rounded to copy_dtype (bf16 or fp16) on the way:
  // the rounded weights written to `copy` [experts, rows, cols] and the rounded values quantized, bit for bit
  // copy = w.to(copy_dtype) and then the dual quantization of copy (the optimizer step's compute copy and the
  // FP8 weight cache's refresh from one read of the master). nullptr: no copy.
  void* copy = nullptr;
  DType copy_dtype = DType::kBFloat16;
  // Row lengths of the codes (0: unpadded): q's rows q_cols long (cols, or ceil(cols/128) * 128) and q_t's
  // q_t_rows long (rows, or ceil(rows/128) * 128), the codes past cols (rows) written as zeros: the weight
  // operand of an FP8 GEMM whose contraction is no multiple of 128, zero-padded in the same pass.
  int64_t q_cols = 0;
  int64_t q_t_rows = 0;
};
void fp8_quantize_experts(const Fp8ExpertsQuantParams& p, cudaStream_t stream);

// The FP8 GEMMs' dequantization scales (the factors their kernels multiply the accumulators by) from both
// operands' quantization scales, in one launch: out = 1 / scale, and 0 where the scale is 0 (a block of zeros:
// zero codes times 0, where 1 / 0 = inf would give NaN); IEEE division, so bit for bit torch.where(scale == 0, 0,
// scale.reciprocal()). With `transpose` each [rows, cols] scale tensor is written [cols, rows] (wgrad's
// token-block-major layout). fp32, contiguous; any size, a [0, n] or [n, 0] operand writes nothing.
struct Fp8DequantScalesParams {
  const float* a;
  float* a_out;
  int64_t a_rows;
  int64_t a_cols;
  const float* b;
  float* b_out;
  int64_t b_rows;
  int64_t b_cols;
  bool transpose;
  int64_t max_blocks = 0;  // the grid's cap (0: 65536); the blocks stride over the tiles of both tensors
};
void fp8_dequant_scales(const Fp8DequantScalesParams& p, cudaStream_t stream);

}  // namespace moe::quant
