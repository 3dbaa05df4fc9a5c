// quantize_fp8_tokens: [M, C] -> E4M3 [C, Mp] in 1x128 blocks along M, the transpose and the padding
// in the same pass as the quantization (one read of x, one write of the codes). A block per tile of
// 128 rows x 64 columns: coalesced row loads into shared memory, then per column its amax over the
// 128 rows and its codes stored as 16-byte vectors (quant/fp8_tokens.cuh).
#include <stdexcept>

#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "quant/fp8.h"
#include "quant/fp8_tokens.cuh"

namespace moe::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 64;  // a row's 64 columns: one 128-byte line of bf16
constexpr int kItems = 8;  // elements per vector load

// VEC: rows start 16-byte aligned (cols % 8 == 0, aligned x): each thread loads 8 elements at once.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads) tokens_quant_kernel(Fp8TokensQuantParams p, int64_t col_tiles, int64_t tiles) {
  __shared__ __align__(32) T tile[kFp8Block * kCols];  // 32: the alignment of an fp32 Pack<T, kItems>
  __shared__ float red[kThreads];
  const T* x = static_cast<const T*>(p.x);
  const int64_t padded = (p.rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const T zero = from_float<T>(0.f);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m_tile = t / col_tiles, c0 = (t % col_tiles) * kCols;
    if constexpr (VEC) {
      for (int i = threadIdx.x; i < kFp8Block * kCols / kItems; i += kThreads) {
        const int r = i / (kCols / kItems), v = (i % (kCols / kItems)) * kItems;
        const int64_t row = m_tile * kFp8Block + r, col = c0 + v;
        Pack<T, kItems> pk;
        if (row < p.rows && col < p.cols) {
          pk = *reinterpret_cast<const Pack<T, kItems>*>(x + row * p.cols + col);
        } else {
#pragma unroll
          for (int j = 0; j < kItems; ++j) pk.v[j] = zero;
        }
        *reinterpret_cast<Pack<T, kItems>*>(tile + r * kCols + v) = pk;
      }
    } else {
      for (int i = threadIdx.x; i < kFp8Block * kCols; i += kThreads) {
        const int r = i / kCols, v = i % kCols;
        const int64_t row = m_tile * kFp8Block + r, col = c0 + v;
        tile[i] = row < p.rows && col < p.cols ? x[row * p.cols + col] : zero;
      }
    }
    __syncthreads();
    quantize_tile_columns<T, kCols, kThreads>(tile, red, m_tile, c0, p.cols, padded, p.q, p.scale, p.e5m2, p.pow2);
  }
}

}  // namespace

void fp8_quantize_tokens(const Fp8TokensQuantParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0) throw std::invalid_argument("quantize_fp8_tokens: negative size");
  check_code_alignment("quantize_fp8_tokens", nullptr, p.q);
  const int64_t col_tiles = (p.cols + kCols - 1) / kCols;
  const int64_t tiles = (p.rows + kFp8Block - 1) / kFp8Block * col_tiles;
  if (tiles == 0) return;
  const unsigned grid = unsigned(tiles < 65536 ? tiles : 65536);
  by_float_dtype(p.dtype, "quantize_fp8_tokens", [&]<typename T>() {
    const bool vec = p.cols % kItems == 0 && reinterpret_cast<uintptr_t>(p.x) % alignof(Pack<T, kItems>) == 0;
    if (vec) {
      tokens_quant_kernel<T, true><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
    } else {
      tokens_quant_kernel<T, false><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
    }
  });
  check_launch("fp8 tokens_quant_kernel");
}

}  // namespace moe::quant
