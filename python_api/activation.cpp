#include <pybind11/pybind11.h>

#include "activation/rows_fp8.h"
#include "activation/squared_relu.h"
#include "activation/swiglu.h"
#include "registry.h"

namespace py = pybind11;

namespace moe::api {

void register_activation(py::module_& m) {
  m.def(
      "swiglu_fwd",
      [](uintptr_t h, uintptr_t row_weights, uintptr_t out, int64_t rows, int64_t ffn, int32_t dtype, int device,
         uintptr_t s) {
        DeviceGuard guard(device);
        activation::swiglu_fwd({ptr<const void>(h), ptr<const float>(row_weights), ptr<void>(out), rows, ffn,
                                DType(dtype)},
                               stream(s));
      },
      py::arg("h"), py::arg("row_weights"), py::arg("out"), py::arg("rows"), py::arg("ffn"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"));
  m.def(
      "swiglu_bwd",
      [](uintptr_t dout, uintptr_t h, uintptr_t row_weights, uintptr_t dh, uintptr_t drow_weights, int64_t rows,
         int64_t ffn, int32_t dtype, int device, uintptr_t s, uintptr_t act) {
        DeviceGuard guard(device);
        activation::swiglu_bwd({ptr<const void>(dout), ptr<const void>(h), ptr<const float>(row_weights),
                                ptr<void>(dh), ptr<float>(drow_weights), rows, ffn, DType(dtype), ptr<void>(act)},
                               stream(s));
      },
      py::arg("dout"), py::arg("h"), py::arg("row_weights"), py::arg("dh"), py::arg("drow_weights"), py::arg("rows"),
      py::arg("ffn"), py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("act") = 0);
  m.def(
      "squared_relu_fwd",
      [](uintptr_t h, uintptr_t out, int64_t n, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        activation::squared_relu_fwd({ptr<const void>(h), ptr<void>(out), n, DType(dtype)}, stream(s));
      },
      py::arg("h"), py::arg("out"), py::arg("n"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "squared_relu_bwd",
      [](uintptr_t dout, uintptr_t h, uintptr_t dh, int64_t n, int32_t dtype, int device, uintptr_t s, uintptr_t act) {
        DeviceGuard guard(device);
        activation::squared_relu_bwd(
            {ptr<const void>(dout), ptr<const void>(h), ptr<void>(dh), n, DType(dtype), ptr<void>(act)}, stream(s));
      },
      py::arg("dout"), py::arg("h"), py::arg("dh"), py::arg("n"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::arg("act") = 0);
  m.def(
      "rows_fp8",
      [](int32_t op, uintptr_t x, uintptr_t dout, uintptr_t q, uintptr_t scale, uintptr_t q_t, uintptr_t scale_t,
         int64_t rows, int64_t cols, bool pow2, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        activation::rows_fp8({activation::RowsFp8Op(op), ptr<const void>(x), ptr<const void>(dout), ptr<uint8_t>(q),
                              ptr<float>(scale), ptr<uint8_t>(q_t), ptr<float>(scale_t), rows, cols, pow2, DType(dtype)},
                             stream(s));
      },
      py::arg("op"), py::arg("x"), py::arg("dout"), py::arg("q"), py::arg("scale"), py::arg("q_t"), py::arg("scale_t"),
      py::arg("rows"), py::arg("cols"), py::arg("pow2"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "swiglu_fwd_fp8",
      [](uintptr_t h, uintptr_t row_weights, uintptr_t q, uintptr_t scale, uintptr_t q_t, uintptr_t scale_t,
         int64_t rows, int64_t ffn, bool pow2, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        activation::swiglu_fwd_fp8({ptr<const void>(h), ptr<const float>(row_weights), ptr<uint8_t>(q),
                                    ptr<float>(scale), ptr<uint8_t>(q_t), ptr<float>(scale_t), rows, ffn, pow2,
                                    DType(dtype)},
                                   stream(s));
      },
      py::arg("h"), py::arg("row_weights"), py::arg("q"), py::arg("scale"), py::arg("q_t"), py::arg("scale_t"),
      py::arg("rows"), py::arg("ffn"), py::arg("pow2"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "swiglu_bwd_fp8",
      [](uintptr_t dout, uintptr_t h, uintptr_t row_weights, uintptr_t q, uintptr_t scale, uintptr_t q_t,
         uintptr_t scale_t, int64_t rows, int64_t ffn, bool pow2, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        activation::swiglu_bwd_fp8({ptr<const void>(dout), ptr<const void>(h), ptr<const float>(row_weights),
                                    ptr<uint8_t>(q), ptr<float>(scale), ptr<uint8_t>(q_t), ptr<float>(scale_t), rows,
                                    ffn, pow2, DType(dtype)},
                                   stream(s));
      },
      py::arg("dout"), py::arg("h"), py::arg("row_weights"), py::arg("q"), py::arg("scale"), py::arg("q_t"),
      py::arg("scale_t"), py::arg("rows"), py::arg("ffn"), py::arg("pow2"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"));
}

}  // namespace moe::api
