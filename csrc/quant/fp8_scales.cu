// fp8_dequant_scales: the FP8 GEMMs' dequantization scales from the quantization scales of both operands in one
// launch (fp8.h). A block per 32 x 32 tile of either tensor: read along its rows, inverted (0 for a zero scale),
// and written as it is or, for wgrad's token-block-major layout, transposed through shared memory, so both the
// reads and the writes are coalesced.
#include <stdexcept>

#include "common/check.h"
#include "quant/fp8.h"

namespace moe::quant {
namespace {

constexpr int kTile = 32;
constexpr int kThreads = 256;
constexpr int kRowStep = kThreads / kTile;  // 8 rows of the tile per pass

__device__ __forceinline__ float dequant_scale(float s) { return s == 0.f ? 0.f : 1.f / s; }

struct Operand {
  const float* src;
  float* dst;
  int64_t rows, cols, col_tiles;
};

__global__ void __launch_bounds__(kThreads) dequant_scales_kernel(Operand a, Operand b, int64_t a_tiles, int64_t tiles,
                                                                  bool transpose) {
  __shared__ float tile[kTile][kTile + 1];
  const int lane = threadIdx.x % kTile;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    // The operand's fields picked one by one (a reference to either parameter struct would be copied to local
    // memory).
    const bool first = t < a_tiles;
    const float* src = first ? a.src : b.src;
    float* dst = first ? a.dst : b.dst;
    const int64_t rows = first ? a.rows : b.rows, cols = first ? a.cols : b.cols;
    const int64_t col_tiles = first ? a.col_tiles : b.col_tiles;
    const int64_t local = first ? t : t - a_tiles;
    const int64_t r0 = local / col_tiles * kTile, c0 = local % col_tiles * kTile;
    for (int r = threadIdx.x / kTile; r < kTile; r += kRowStep) {
      const int64_t row = r0 + r, col = c0 + lane;
      if (row < rows && col < cols) {
        const float v = dequant_scale(src[row * cols + col]);
        if (transpose) {
          tile[r][lane] = v;
        } else {
          dst[row * cols + col] = v;
        }
      }
    }
    if (transpose) {  // dst [cols, rows]: the tile's column c0 + r is dst's row, its rows r0.. dst's columns
      __syncthreads();
      for (int r = threadIdx.x / kTile; r < kTile; r += kRowStep) {
        const int64_t row = c0 + r, col = r0 + lane;
        if (row < cols && col < rows) dst[row * rows + col] = tile[lane][r];
      }
      __syncthreads();  // the tile is rewritten by the next iteration
    }
  }
}

Operand operand(const float* src, float* dst, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("fp8_dequant_scales: negative size");
  if (rows * cols > 0 && (src == nullptr || dst == nullptr)) {
    throw std::invalid_argument("fp8_dequant_scales: a scale tensor without its pointers");
  }
  return {src, dst, rows, cols, (cols + kTile - 1) / kTile};
}

int64_t tile_count(const Operand& o) { return o.rows == 0 ? 0 : (o.rows + kTile - 1) / kTile * o.col_tiles; }

}  // namespace

void fp8_dequant_scales(const Fp8DequantScalesParams& p, cudaStream_t stream) {
  if (p.max_blocks < 0) throw std::invalid_argument("fp8_dequant_scales: negative max_blocks");
  const Operand a = operand(p.a, p.a_out, p.a_rows, p.a_cols);
  const Operand b = operand(p.b, p.b_out, p.b_rows, p.b_cols);
  const int64_t a_tiles = tile_count(a), tiles = a_tiles + tile_count(b);
  if (tiles == 0) return;
  const int64_t cap = p.max_blocks > 0 && p.max_blocks < 65536 ? p.max_blocks : 65536;
  const unsigned grid = unsigned(tiles < cap ? tiles : cap);
  dequant_scales_kernel<<<grid, kThreads, 0, stream>>>(a, b, a_tiles, tiles, p.transpose);
  check_launch("dequant_scales_kernel");
}

}  // namespace moe::quant
