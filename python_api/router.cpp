#include "router/router.h"

#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

namespace moe::api {

void register_router(py::module_& m) {
  using router::Score;
  m.attr("router_max_experts") = router::kMaxExperts;
  m.attr("router_max_k") = router::kMaxK;
  m.attr("router_max_groups") = router::kMaxGroups;
  m.def(
      "router_topk_fwd",
      [](uintptr_t logits, uintptr_t bias, uintptr_t weights, uintptr_t indices, int64_t num_tokens,
         int32_t num_experts, int32_t k, int32_t score, bool pre_softmax, int32_t num_groups, int32_t group_topk,
         int32_t group_score_topk, bool normalize, float scaling_factor, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::TopkParams p{ptr<const void>(logits), ptr<const float>(bias), ptr<float>(weights),
                             ptr<int32_t>(indices),   num_tokens,            num_experts,
                             k,                       Score(score),          pre_softmax,
                             num_groups,              group_topk,            group_score_topk,
                             normalize,               scaling_factor,        DType(dtype)};
        router::topk_fwd(p, stream(s));
      },
      py::arg("logits"), py::arg("bias"), py::arg("weights"), py::arg("indices"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("k"), py::arg("score"), py::arg("pre_softmax"), py::arg("num_groups"),
      py::arg("group_topk"), py::arg("group_score_topk"), py::arg("normalize"), py::arg("scaling_factor"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "router_topk_bwd",
      [](uintptr_t grad_weights, uintptr_t logits, uintptr_t indices, uintptr_t grad_logits, int64_t num_tokens,
         int32_t num_experts, int32_t k, int32_t score, bool pre_softmax, bool normalize, float scaling_factor,
         int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::TopkBwdParams p{ptr<const float>(grad_weights), ptr<const void>(logits), ptr<const int32_t>(indices),
                                ptr<float>(grad_logits),        num_tokens,              num_experts,
                                k,                              Score(score),            pre_softmax,
                                normalize,                      scaling_factor,          DType(dtype)};
        router::topk_bwd(p, stream(s));
      },
      py::arg("grad_weights"), py::arg("logits"), py::arg("indices"), py::arg("grad_logits"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("k"), py::arg("score"), py::arg("pre_softmax"), py::arg("normalize"),
      py::arg("scaling_factor"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "router_aux_scores_fwd",
      [](uintptr_t logits, uintptr_t scores, uintptr_t indices, int64_t num_tokens, int32_t num_experts, int32_t k,
         int32_t score, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::AuxScoresParams p{ptr<const void>(logits), ptr<float>(scores), ptr<int32_t>(indices), num_tokens,
                                  num_experts,             k,                  Score(score),          DType(dtype)};
        router::aux_scores_fwd(p, stream(s));
      },
      py::arg("logits"), py::arg("scores"), py::arg("indices"), py::arg("num_tokens"), py::arg("num_experts"),
      py::arg("k"), py::arg("score"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "router_aux_scores_bwd",
      [](uintptr_t grad_scores, uintptr_t logits, uintptr_t grad_logits, int64_t num_tokens, int32_t num_experts,
         int32_t score, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::AuxScoresBwdParams p{ptr<const float>(grad_scores), ptr<const void>(logits), ptr<float>(grad_logits),
                                     num_tokens, num_experts, Score(score), DType(dtype)};
        router::aux_scores_bwd(p, stream(s));
      },
      py::arg("grad_scores"), py::arg("logits"), py::arg("grad_logits"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("score"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
}

}  // namespace moe::api
