#include "quant/fp8.h"

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
         bool e5m2, bool pow2, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        quant::Fp8QuantParams p{ptr<const void>(x), ptr<uint8_t>(q), ptr<float>(scale), ptr<uint32_t>(amax),
                                rows,               cols,           Granularity(granularity), e5m2,
                                pow2,               DType(dtype)};
        quant::fp8_quantize(p, stream(s));
      },
      py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("amax"), py::arg("rows"), py::arg("cols"),
      py::arg("granularity"), py::arg("e5m2"), py::arg("pow2"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"));
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
}

}  // namespace moe::api
