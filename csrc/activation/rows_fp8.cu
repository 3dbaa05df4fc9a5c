// Elementwise producers writing E4M3 in both layouts (rows_fp8.h), from one read of their inputs: a block per
// tile of 128 rows x 128 columns. Each row's 128 values are one 1x128 block (16 lanes, 8 values each, amax by
// shuffles, 8 codes stored at once), the last tile's columns past C read as zeros and stored as zero codes (the
// padding of C to a multiple of 128); the tile, rounded to x's dtype, is staged in shared memory for the
// token-major blocks (quant/fp8_tokens.cuh), which cover the columns below C only.
#include <stdexcept>
#include <string>

#include "activation/rows_fp8.h"
#include "activation/squared_relu_math.cuh"
#include "common/check.h"
#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"
#include "quant/fp8_tokens.cuh"

namespace moe::activation {
namespace {

using quant::kFp8Block;
constexpr int kThreads = 256;
constexpr int kLanes = 16;                      // lanes per row block
constexpr int kItems = kFp8Block / kLanes;      // 8 values per lane: one 16-byte load of h (and of dout)
constexpr int kRowStep = kThreads / kLanes;     // rows per pass

template <typename T, RowsFp8Op kOp>
__global__ void __launch_bounds__(kThreads) rows_fp8_kernel(RowsFp8Params p, int64_t col_tiles, int64_t tiles) {
  using P = Pack<T, kItems>;
  __shared__ __align__(16) T tile[kFp8Block * kFp8Block];
  __shared__ float red[kThreads];
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  const int64_t padded = (p.rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const int64_t q_cols = col_tiles * kFp8Block;
  const int lane = threadIdx.x % kLanes;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m_tile = t / col_tiles, c0 = (t % col_tiles) * kFp8Block;
    const int64_t c = c0 + lane * kItems;
    for (int r = threadIdx.x / kLanes; r < kFp8Block; r += kRowStep) {  // the same trip count in every lane
      const int64_t row = m_tile * kFp8Block + r;
      const bool live = row < p.rows;
      P v;
      float m = 0.f;
      if (live && c < p.cols) {  // C % 8 == 0: a lane's 8 values are all in or all out
        const P in = *reinterpret_cast<const P*>(x + row * p.cols + c);
        if constexpr (kOp == RowsFp8Op::kSquaredReluBwd) {
          const P d = *reinterpret_cast<const P*>(dout + row * p.cols + c);
#pragma unroll
          for (int j = 0; j < kItems; ++j) v.v[j] = from_float<T>(squared_relu_grad<T>(to_float(in.v[j]), to_float(d.v[j])));
        } else if constexpr (kOp == RowsFp8Op::kSquaredRelu) {
#pragma unroll
          for (int j = 0; j < kItems; ++j) v.v[j] = from_float<T>(squared_relu_value(to_float(in.v[j])));
        } else {
          v = in;
        }
#pragma unroll
        for (int j = 0; j < kItems; ++j) m = quant::nan_max(m, fabsf(to_float(v.v[j])));
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j) v.v[j] = from_float<T>(0.f);  // padding rows and columns: code 0
      }
      *reinterpret_cast<P*>(tile + r * kFp8Block + lane * kItems) = v;
      quant::quantize_row_block<kLanes>(v, m, live, p.q + row * q_cols + c, p.scale + row * col_tiles + c0 / kFp8Block,
                                        lane, p.pow2);
    }
    __syncthreads();
    quant::quantize_tile_columns<T, kFp8Block, kThreads>(tile, red, m_tile, c0, p.cols, padded, p.q_t, p.scale_t,
                                                         false, p.pow2);
  }
}

}  // namespace

void rows_fp8(const RowsFp8Params& p, cudaStream_t stream) {
  const char* op = p.op == RowsFp8Op::kIdentity      ? "quantize_fp8_dual"
                   : p.op == RowsFp8Op::kSquaredRelu ? "squared_relu_quantize_fp8"
                                                     : "squared_relu_bwd_quantize_fp8";
  if (p.op != RowsFp8Op::kIdentity && p.op != RowsFp8Op::kSquaredRelu && p.op != RowsFp8Op::kSquaredReluBwd) {
    throw std::invalid_argument("rows_fp8: unknown op");
  }
  if (p.rows < 0 || p.cols < 0) throw std::invalid_argument(std::string(op) + ": negative size");
  if (p.cols % kItems) throw std::invalid_argument(std::string(op) + ": the columns must be a multiple of 8");
  if ((p.op == RowsFp8Op::kSquaredReluBwd) != (p.dout != nullptr) && p.rows * p.cols > 0) {
    throw std::invalid_argument(std::string(op) + ": dout is the backward's input alone");
  }
  if (reinterpret_cast<uintptr_t>(p.x) % 16 || reinterpret_cast<uintptr_t>(p.dout) % 16) {
    throw std::invalid_argument(std::string(op) + ": the inputs must be 16-byte aligned");
  }
  quant::check_code_alignment(op, p.q, p.q_t);
  const int64_t col_tiles = (p.cols + kFp8Block - 1) / kFp8Block;
  const int64_t tiles = (p.rows + kFp8Block - 1) / kFp8Block * col_tiles;
  if (tiles == 0) return;
  const unsigned grid = unsigned(tiles < 65536 ? tiles : 65536);
  auto launch = [&]<typename T>() {
    switch (p.op) {
      case RowsFp8Op::kIdentity:
        rows_fp8_kernel<T, RowsFp8Op::kIdentity><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
        break;
      case RowsFp8Op::kSquaredRelu:
        rows_fp8_kernel<T, RowsFp8Op::kSquaredRelu><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
        break;
      case RowsFp8Op::kSquaredReluBwd:
        rows_fp8_kernel<T, RowsFp8Op::kSquaredReluBwd><<<grid, kThreads, 0, stream>>>(p, col_tiles, tiles);
        break;
    }
  };
  switch (p.dtype) {
    case DType::kFloat16: launch.template operator()<__half>(); break;
    case DType::kBFloat16: launch.template operator()<__nv_bfloat16>(); break;
    default: throw std::invalid_argument(std::string(op) + ": the input must be float16 or bfloat16");
  }
  check_launch("rows_fp8_kernel");
}

}  // namespace moe::activation
