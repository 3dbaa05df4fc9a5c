// Elementwise producers writing E4M3 in both layouts (rows_fp8.h), from one read of their inputs: the tile loop
// of quant/fp8_dual_tiles.cuh (the columns zero-padded to a multiple of 128) around the elementwise value.
#include <stdexcept>
#include <string>

#include "activation/rows_fp8.h"
#include "activation/squared_relu_math.cuh"
#include "common/check.h"
#include "common/vec.cuh"
#include "quant/fp8_dual_tiles.cuh"

namespace moe::activation {
namespace {

using quant::kDualItems;
using quant::kDualThreads;
using quant::kFp8Block;

template <typename T, RowsFp8Op kOp>
__global__ void __launch_bounds__(kDualThreads) rows_fp8_kernel(RowsFp8Params p) {
  using P = Pack<T, kDualItems>;
  __shared__ quant::DualTileSmem<T> smem;
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  auto value = [&](int64_t row, int64_t c) {
    const P in = *reinterpret_cast<const P*>(x + row * p.cols + c);
    P v;
    if constexpr (kOp == RowsFp8Op::kSquaredReluBwd) {
      const P d = *reinterpret_cast<const P*>(dout + row * p.cols + c);
#pragma unroll
      for (int j = 0; j < kDualItems; ++j) {
        v.v[j] = from_float<T>(squared_relu_grad<T>(to_float(in.v[j]), to_float(d.v[j])));
      }
    } else if constexpr (kOp == RowsFp8Op::kSquaredRelu) {
#pragma unroll
      for (int j = 0; j < kDualItems; ++j) v.v[j] = from_float<T>(squared_relu_value(to_float(in.v[j])));
    } else {
      v = in;
    }
    return v;
  };
  quant::dual_fp8_tiles<T>(smem, p.rows, p.cols, p.q, p.scale, p.q_t, p.scale_t, p.pow2, value);
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
  if (p.cols % kDualItems) throw std::invalid_argument(std::string(op) + ": the columns must be a multiple of 8");
  if ((p.op == RowsFp8Op::kSquaredReluBwd) != (p.dout != nullptr) && p.rows * p.cols > 0) {
    throw std::invalid_argument(std::string(op) + ": dout is the backward's input alone");
  }
  if (reinterpret_cast<uintptr_t>(p.x) % 16 || reinterpret_cast<uintptr_t>(p.dout) % 16) {
    throw std::invalid_argument(std::string(op) + ": the inputs must be 16-byte aligned");
  }
  quant::check_code_alignment(op, p.q, p.q_t);
  if (quant::dual_tiles(p.rows, p.cols) == 0) return;
  const unsigned grid = quant::dual_grid(p.rows, p.cols);
  auto launch = [&]<typename T>() {
    switch (p.op) {
      case RowsFp8Op::kIdentity:
        rows_fp8_kernel<T, RowsFp8Op::kIdentity><<<grid, kDualThreads, 0, stream>>>(p);
        break;
      case RowsFp8Op::kSquaredRelu:
        rows_fp8_kernel<T, RowsFp8Op::kSquaredRelu><<<grid, kDualThreads, 0, stream>>>(p);
        break;
      case RowsFp8Op::kSquaredReluBwd:
        rows_fp8_kernel<T, RowsFp8Op::kSquaredReluBwd><<<grid, kDualThreads, 0, stream>>>(p);
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
