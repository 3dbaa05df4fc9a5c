// NVFP4 quantization (specs/lowprec.md, "NVFP4"): x = q * s_block / s_global with q in FP4 E2M1 (two
// codes per byte, the first element in the low nibble), s_block an E4M3 scale per 16 consecutive
// elements along K (or per 16x16 tile for weights), s_global an fp32 scale per tensor.
//
//   s_global = 2688 / amax (448 * 6; 1 when amax is 0 or not finite; clamped to the largest float)
//   s_block  = e4m3(block_amax / 6 * s_global), round-to-nearest-even, saturated at 448
//   r        = s_global / float(s_block)  (one division per block; a zero s_block encodes all zeros)
//   q        = e2m1(x * r): round-to-nearest-even on {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturated at 6, or
//              stochastic: up with probability (|v| - lo) / (hi - lo), from 24 random bits of a
//              Philox4x32-10 stream keyed by the seed, counter (element index / 4, offset)
//   x'       = q * float(s_block) / s_global
// The reference in moe_kernels/ops/quant.py fixes the same order of operations; results match it bit
// for bit. A NaN makes its block's (or 2-D tile's) scale NaN (E4M3 0x7f) and every code there 0, so the
// whole block dequantizes to NaN.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace moe::quant {

constexpr int kNvfp4Block = 16;

struct Nvfp4QuantParams {
  const void* x;           // [rows, cols], cols % 16 == 0
  uint8_t* packed;         // [rows, cols / 2]
  uint8_t* block_scale;    // [rows, cols / 16] E4M3 bytes (2-D tiles: each tile's scale on its 16 rows)
  float* global_scale;     // [] out
  const float* amax;       // [] the global amax, or nullptr: computed here into amax_scratch
  uint32_t* amax_scratch;  // one word when amax == nullptr
  float* tile_amax;        // [ceil(rows / 16), cols / 16] scratch for 2-D tiles, else nullptr
  const int64_t* rng;      // [2] (seed, offset) on the device for stochastic rounding, else nullptr
  int64_t rows;
  int64_t cols;
  bool tile_2d;
  DType dtype;
};
void nvfp4_quantize(const Nvfp4QuantParams& p, cudaStream_t stream);

struct Nvfp4DequantParams {
  const uint8_t* packed;       // [rows, cols / 2]
  const uint8_t* block_scale;  // [rows, cols / 16]
  const float* global_scale;   // []
  void* out;                   // [rows, cols], dtype
  int64_t rows;
  int64_t cols;
  DType dtype;
};
void nvfp4_dequantize(const Nvfp4DequantParams& p, cudaStream_t stream);

}  // namespace moe::quant
