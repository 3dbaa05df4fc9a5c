#include "gemm/grouped_mm.h"

#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

namespace moe::api {

namespace {

gemm::GroupedParams make(int32_t op, uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_sizes, int32_t E,
                         int64_t M, int64_t N, int64_t K, int32_t dtype, uintptr_t workspace, size_t workspace_bytes,
                         int device, uintptr_t sfa, uintptr_t sfb, int32_t fp8_wgrad_out) {
  auto p = gemm::GroupedParams{gemm::GemmOp(op),         ptr<const void>(a), ptr<const void>(b), ptr<void>(d),
                             ptr<const int32_t>(group_sizes), E,         M,                  N,
                             K,                        DType(dtype),       ptr<void>(workspace), workspace_bytes,
                             device,                   ptr<const float>(sfa), ptr<const float>(sfb)};
  p.fp8_wgrad_out = DType(fp8_wgrad_out);
  return p;
}

}  // namespace

void register_gemm(py::module_& m) {
  m.attr("grouped_mm_max_groups") = gemm::kMaxGroups;
  m.attr("grouped_mm_has_sm90") = gemm::sm90::compiled();
  m.def(
      "grouped_mm_path",
      [](int32_t op, int32_t dtype, int32_t num_groups, int64_t M, int64_t N, int64_t K, uintptr_t a, uintptr_t b,
         uintptr_t d, int device, uintptr_t sfa, uintptr_t sfb, int32_t fp8_wgrad_out) {
        DeviceGuard guard(device);
        return int(gemm::choose_path(
            make(op, a, b, d, 0, num_groups, M, N, K, dtype, 0, 0, device, sfa, sfb, fp8_wgrad_out)));
      },
      "0 = portable kernel, 1 = sm_90a ping-pong, 2 = sm_90a cooperative, 3 = sm_90a fp8 blockwise", py::arg("op"),
      py::arg("dtype"), py::arg("num_groups"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("a"), py::arg("b"),
      py::arg("d"), py::arg("device"), py::arg("sfa") = 0, py::arg("sfb") = 0, py::arg("fp8_wgrad_out") = 0);
  m.def(
      "grouped_mm_workspace_bytes",
      [](int32_t op, int32_t dtype, int32_t num_groups, int64_t M, int64_t N, int64_t K, uintptr_t a, uintptr_t b,
         uintptr_t d, int device, uintptr_t sfa, uintptr_t sfb, int32_t fp8_wgrad_out) {
        DeviceGuard guard(device);
        return gemm::grouped_workspace_bytes(
            make(op, a, b, d, 0, num_groups, M, N, K, dtype, 0, 0, device, sfa, sfb, fp8_wgrad_out));
      },
      py::arg("op"), py::arg("dtype"), py::arg("num_groups"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("a"),
      py::arg("b"), py::arg("d"), py::arg("device"), py::arg("sfa") = 0, py::arg("sfb") = 0,
      py::arg("fp8_wgrad_out") = 0);
  m.def(
      "grouped_mm",
      [](int32_t op, uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_sizes, int32_t num_groups, int64_t M,
         int64_t N, int64_t K, int32_t dtype, uintptr_t workspace, size_t workspace_bytes, int device, uintptr_t s,
         uintptr_t sfa, uintptr_t sfb, int32_t group_align, int32_t fp8_wgrad_out) {
        DeviceGuard guard(device);
        auto p = make(op, a, b, d, group_sizes, num_groups, M, N, K, dtype, workspace, workspace_bytes, device, sfa, sfb,
                      fp8_wgrad_out);
        p.group_align = group_align;
        gemm::grouped_mm(p, stream(s));
      },
      "group_align (wgrad): groups whose rows do not start and end on multiples of it get NaN; 0: any. "
      "fp8_wgrad_out (FP8 wgrad): the output's dtype code, float32 (0) or bfloat16 (2)",
      py::arg("op"), py::arg("a"), py::arg("b"), py::arg("d"), py::arg("group_sizes"), py::arg("num_groups"),
      py::arg("M"), py::arg("N"), py::arg("K"), py::arg("dtype"), py::arg("workspace"), py::arg("workspace_bytes"),
      py::arg("device"), py::arg("stream"), py::arg("sfa") = 0, py::arg("sfb") = 0, py::arg("group_align") = 0,
      py::arg("fp8_wgrad_out") = 0);
}

}  // namespace moe::api
