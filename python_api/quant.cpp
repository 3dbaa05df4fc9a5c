#include "quant/fp8.h"
#include "quant/nvfp4.h"

#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

namespace moe::api {

void register_quant(py::module_& m) {
  using quant::Granularity;
  m.attr("fp8_block") = quant::kFp8Block;
  m.def(
      "fp8_quantize",
      [](uintptr_t x, uintptr_t q, uintptr_t scale, uintptr_t amax, int64_t rows, int64_t cols, int32_t granularity,
         bool e5m2, bool pow2, int32_t dtype, int device, uintptr_t s, int64_t q_cols) {
        DeviceGuard guard(device);
        quant::Fp8QuantParams p{ptr<const void>(x), ptr<uint8_t>(q), ptr<float>(scale), ptr<uint32_t>(amax),
                                rows,               cols,           Granularity(granularity), e5m2,
                                pow2,               DType(dtype),   q_cols};
        quant::fp8_quantize(p, stream(s));
      },
      py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("amax"), py::arg("rows"), py::arg("cols"),
      py::arg("granularity"), py::arg("e5m2"), py::arg("pow2"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::arg("q_cols") = 0);
  m.def(
      "fp8_quantize_tokens",
      [](uintptr_t x, uintptr_t q, uintptr_t scale, int64_t rows, int64_t cols, bool e5m2, bool pow2, int32_t dtype,
         int device, uintptr_t s) {
        DeviceGuard guard(device);
        quant::fp8_quantize_tokens({ptr<const void>(x), ptr<uint8_t>(q), ptr<float>(scale), rows, cols, e5m2, pow2,
                                    DType(dtype)},
                                   stream(s));
      },
      py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("rows"), py::arg("cols"), py::arg("e5m2"),
      py::arg("pow2"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "fp8_quantize_experts",
      [](uintptr_t w, uintptr_t q, uintptr_t scale, uintptr_t q_t, uintptr_t scale_t, int64_t experts, int64_t rows,
         int64_t cols, bool pow2, int32_t dtype, int device, uintptr_t s, uintptr_t copy, int32_t copy_dtype,
         int64_t q_cols, int64_t q_t_rows) {
        DeviceGuard guard(device);
        quant::Fp8ExpertsQuantParams p{ptr<const void>(w), ptr<uint8_t>(q), ptr<float>(scale), ptr<uint8_t>(q_t),
                                       ptr<float>(scale_t), experts, rows, cols, pow2, DType(dtype)};
        p.copy = ptr<void>(copy);
        p.copy_dtype = DType(copy_dtype);
        p.q_cols = q_cols;
        p.q_t_rows = q_t_rows;
        quant::fp8_quantize_experts(p, stream(s));
      },
      py::arg("w"), py::arg("q"), py::arg("scale"), py::arg("q_t"), py::arg("scale_t"), py::arg("experts"),
      py::arg("rows"), py::arg("cols"), py::arg("pow2"), py::arg("dtype"), py::arg("device"), py::arg("stream"),
      py::arg("copy") = 0, py::arg("copy_dtype") = int32_t(DType::kBFloat16), py::arg("q_cols") = 0,
      py::arg("q_t_rows") = 0);
  m.def(
      "fp8_dequant_scales",
      [](uintptr_t a, uintptr_t a_out, int64_t a_rows, int64_t a_cols, uintptr_t b, uintptr_t b_out, int64_t b_rows,
         int64_t b_cols, bool transpose, int device, uintptr_t s, int64_t max_blocks) {
        DeviceGuard guard(device);
        quant::fp8_dequant_scales({ptr<const float>(a), ptr<float>(a_out), a_rows, a_cols, ptr<const float>(b),
                                   ptr<float>(b_out), b_rows, b_cols, transpose, max_blocks},
                                  stream(s));
      },
      py::arg("a"), py::arg("a_out"), py::arg("a_rows"), py::arg("a_cols"), py::arg("b"), py::arg("b_out"),
      py::arg("b_rows"), py::arg("b_cols"), py::arg("transpose"), py::arg("device"), py::arg("stream"),
      py::arg("max_blocks") = 0);
  m.def(
      "fp8_dequantize",
      [](uintptr_t q, uintptr_t scale, uintptr_t out, int64_t rows, int64_t cols, int32_t granularity, bool e5m2,
         int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        quant::Fp8DequantParams p{ptr<const uint8_t>(q), ptr<const float>(scale), ptr<void>(out), rows, cols,
                                  Granularity(granularity), e5m2, DType(dtype)};
        quant::fp8_dequantize(p, stream(s));
      },
      py::arg("q"), py::arg("scale"), py::arg("out"), py::arg("rows"), py::arg("cols"), py::arg("granularity"),
      py::arg("e5m2"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "nvfp4_quantize",
      [](uintptr_t x, uintptr_t packed, uintptr_t block_scale, uintptr_t global_scale, uintptr_t amax,
         uintptr_t amax_scratch, uintptr_t tile_amax, uintptr_t rng, int64_t rows, int64_t cols, bool tile_2d,
         int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        quant::Nvfp4QuantParams p{ptr<const void>(x),      ptr<uint8_t>(packed),      ptr<uint8_t>(block_scale),
                                  ptr<float>(global_scale), ptr<const float>(amax),   ptr<uint32_t>(amax_scratch),
                                  ptr<float>(tile_amax),    ptr<const int64_t>(rng),  rows,
                                  cols,                     tile_2d,                  DType(dtype)};
        quant::nvfp4_quantize(p, stream(s));
      },
      py::arg("x"), py::arg("packed"), py::arg("block_scale"), py::arg("global_scale"), py::arg("amax"),
      py::arg("amax_scratch"), py::arg("tile_amax"), py::arg("rng"), py::arg("rows"), py::arg("cols"),
      py::arg("tile_2d"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "nvfp4_dequantize",
      [](uintptr_t packed, uintptr_t block_scale, uintptr_t global_scale, uintptr_t out, int64_t rows, int64_t cols,
         int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        quant::Nvfp4DequantParams p{ptr<const uint8_t>(packed), ptr<const uint8_t>(block_scale),
                                    ptr<const float>(global_scale), ptr<void>(out), rows, cols, DType(dtype)};
        quant::nvfp4_dequantize(p, stream(s));
      },
      py::arg("packed"), py::arg("block_scale"), py::arg("global_scale"), py::arg("out"), py::arg("rows"),
      py::arg("cols"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
}

}  // namespace moe::api
