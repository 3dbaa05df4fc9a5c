#include "permute/permute.h"

#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

namespace moe::api {

void register_permute(py::module_& m) {
  m.attr("permute_max_experts") = permute::kMaxExperts;
  m.def("permute_workspace_bytes", &permute::permute_workspace_bytes, py::arg("num_slots"),
        py::arg("num_experts"));
  m.def(
      "permute_fwd",
      [](uintptr_t x, uintptr_t indices, uintptr_t x_perm, uintptr_t row_map, uintptr_t group_sizes,
         uintptr_t workspace, int64_t num_tokens, int64_t k, int64_t row_bytes, int32_t num_experts, int32_t align,
         int device, uintptr_t s) {
        DeviceGuard guard(device);
        permute::PermuteParams p{ptr<const void>(x),   ptr<const int32_t>(indices), ptr<void>(x_perm),
                                 ptr<int32_t>(row_map), ptr<int32_t>(group_sizes), ptr<void>(workspace),
                                 num_tokens,            k,                          row_bytes,
                                 num_experts,           align};
        permute::permute_fwd(p, stream(s));
      },
      py::arg("x"), py::arg("indices"), py::arg("x_perm"), py::arg("row_map"), py::arg("group_sizes"),
      py::arg("workspace"), py::arg("num_tokens"), py::arg("k"), py::arg("row_bytes"), py::arg("num_experts"),
      py::arg("align"), py::arg("device"), py::arg("stream"));
  m.def(
      "permute_quantize_fp8",
      [](uintptr_t x, uintptr_t indices, uintptr_t x_perm, uintptr_t codes, uintptr_t scales, uintptr_t row_map,
         uintptr_t group_sizes, uintptr_t workspace, int64_t num_tokens, int64_t k, int64_t hidden, int32_t dtype,
         int32_t num_experts, int32_t align, bool pow2, int device, uintptr_t s) {
        DeviceGuard guard(device);
        permute::PermuteParams p{ptr<const void>(x),   ptr<const int32_t>(indices), ptr<void>(x_perm),
                                 ptr<int32_t>(row_map), ptr<int32_t>(group_sizes), ptr<void>(workspace),
                                 num_tokens,            k,                          hidden * dtype_size(DType(dtype)),
                                 num_experts,           align};
        p.fp8_codes = ptr<uint8_t>(codes);
        p.fp8_scales = ptr<float>(scales);
        p.dtype = DType(dtype);
        p.pow2 = pow2;
        permute::permute_fwd(p, stream(s));
      },
      "permute with E4M3 1x128-block quantization fused into the copy (x_perm may be 0)", py::arg("x"),
      py::arg("indices"), py::arg("x_perm"), py::arg("codes"), py::arg("scales"), py::arg("row_map"),
      py::arg("group_sizes"), py::arg("workspace"), py::arg("num_tokens"), py::arg("k"), py::arg("hidden"),
      py::arg("dtype"), py::arg("num_experts"), py::arg("align"), py::arg("pow2"), py::arg("device"),
      py::arg("stream"));
  m.def(
      "tokens_per_expert",
      [](uintptr_t indices, int64_t num_slots, int32_t num_experts, uintptr_t counts, int device, uintptr_t s) {
        DeviceGuard guard(device);
        permute::tokens_per_expert(ptr<const int32_t>(indices), num_slots, num_experts, ptr<int32_t>(counts),
                                   stream(s));
      },
      py::arg("indices"), py::arg("num_slots"), py::arg("num_experts"), py::arg("counts"), py::arg("device"), py::arg("stream"));
  m.def(
      "rows_to_tokens",
      [](uintptr_t row_map, int64_t num_tokens, int64_t k, int64_t num_rows, uintptr_t row_token, int device,
         uintptr_t s) {
        DeviceGuard guard(device);
        permute::rows_to_tokens(ptr<const int32_t>(row_map), num_tokens, k, num_rows, ptr<int32_t>(row_token),
                                stream(s));
      },
      "row_token[r] = the token whose slot row_map sends to row r, -1 for rows no slot maps to (with k = 1 and "
      "num_tokens = T * k: the slot itself, the inverse of row_map)",
      py::arg("row_map"), py::arg("num_tokens"), py::arg("k"), py::arg("num_rows"), py::arg("row_token"),
      py::arg("device"), py::arg("stream"));
  m.def(
      "unpermute_fwd",
      [](uintptr_t y, uintptr_t row_map, uintptr_t weights, uintptr_t out, int64_t num_tokens, int64_t k,
         int64_t hidden, int64_t num_rows, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        permute::UnpermuteParams p{ptr<const void>(y), ptr<const int32_t>(row_map), ptr<const float>(weights),
                                   ptr<void>(out),     num_tokens,                  k,
                                   hidden,             num_rows,                    static_cast<DType>(dtype)};
        permute::unpermute_fwd(p, stream(s));
      },
      py::arg("y"), py::arg("row_map"), py::arg("weights"), py::arg("out"), py::arg("num_tokens"), py::arg("k"),
      py::arg("hidden"), py::arg("num_rows"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "unpermute_bwd",
      [](uintptr_t dout, uintptr_t y, uintptr_t row_map, uintptr_t weights, uintptr_t dy, uintptr_t dweights,
         uintptr_t row_mask, int64_t num_tokens, int64_t k, int64_t hidden, int64_t num_rows, int32_t dtype,
         int device, uintptr_t s) {
        DeviceGuard guard(device);
        permute::UnpermuteBwdParams p{ptr<const void>(dout),    ptr<const void>(y),  ptr<const int32_t>(row_map),
                                      ptr<const float>(weights), ptr<void>(dy),       ptr<float>(dweights),
                                      ptr<uint8_t>(row_mask),    num_tokens,          k,
                                      hidden,                    num_rows,            static_cast<DType>(dtype)};
        permute::unpermute_bwd(p, stream(s));
      },
      py::arg("dout"), py::arg("y"), py::arg("row_map"), py::arg("weights"), py::arg("dy"), py::arg("dweights"),
      py::arg("row_mask"), py::arg("num_tokens"), py::arg("k"), py::arg("hidden"), py::arg("num_rows"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "unpermute_bwd_fp8",
      [](uintptr_t dout, uintptr_t slot_of_row, uintptr_t weights, uintptr_t q, uintptr_t scale, uintptr_t q_t,
         uintptr_t scale_t, int64_t num_tokens, int64_t k, int64_t hidden, int64_t num_rows, bool pow2, int32_t dtype,
         int device, uintptr_t s) {
        DeviceGuard guard(device);
        permute::unpermute_bwd_fp8({ptr<const void>(dout), ptr<const int32_t>(slot_of_row), ptr<const float>(weights),
                                    ptr<uint8_t>(q), ptr<float>(scale), ptr<uint8_t>(q_t), ptr<float>(scale_t),
                                    num_tokens, k, hidden, num_rows, pow2, static_cast<DType>(dtype)},
                                   stream(s));
      },
      py::arg("dout"), py::arg("slot_of_row"), py::arg("weights"), py::arg("q"), py::arg("scale"), py::arg("q_t"),
      py::arg("scale_t"), py::arg("num_tokens"), py::arg("k"), py::arg("hidden"), py::arg("num_rows"),
      py::arg("pow2"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
}

}  // namespace moe::api
