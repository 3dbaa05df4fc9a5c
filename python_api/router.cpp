#include "router/router.h"
#include "router/balance.h"

#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

namespace moe::api {

void register_router(py::module_& m) {
  using router::Score;
  m.attr("router_max_experts") = router::kMaxExperts;
  m.attr("router_max_k") = router::kMaxK;
  m.attr("router_max_groups") = router::kMaxGroups;
  m.attr("router_bwd_warps") = router::kRouterBwdWarps;
  m.attr("router_max_blocks") = router::kMaxRouterBlocks;
  m.def("router_fwd_warps", &router::router_fwd_warps, py::arg("num_experts"));
  m.def("router_blocks", &router::router_blocks, py::arg("num_tokens"), py::arg("warps_per_block"));
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
  // The fused router (router.h, FusedParams): positional arguments (the MoE layer's hot path). Returns the
  // workspace bytes it needs when `workspace_bytes` is short (nothing launched), else 0.
  m.attr("router_fused_max_experts") = router::kFusedMaxExperts;
  m.def("router_fused_warps", &router::router_fused_warps);
  m.def("router_fused_fwd",
        [](uintptr_t logits, uintptr_t bias, uintptr_t weights, uintptr_t indices, uintptr_t counts,
           uintptr_t aux_counts, uintptr_t seq_counts, uintptr_t loss, uintptr_t workspace, size_t workspace_bytes,
           uintptr_t counter, int64_t num_tokens, int32_t num_experts, int32_t k, int32_t score, bool pre_softmax,
           int32_t num_groups, int32_t group_topk, int32_t group_score_topk, bool normalize, float scaling_factor,
           float aux_scale, int64_t seq_len, float seq_scale, float z_coeff, int32_t dtype, int device,
           uintptr_t s) -> size_t {
          DeviceGuard guard(device);
          router::FusedParams p{
              router::TopkParams{ptr<const void>(logits), ptr<const float>(bias), ptr<float>(weights),
                                 ptr<int32_t>(indices), num_tokens, num_experts, k, Score(score), pre_softmax,
                                 num_groups, group_topk, group_score_topk, normalize, scaling_factor, DType(dtype)},
              ptr<int32_t>(counts), ptr<int32_t>(aux_counts), ptr<int32_t>(seq_counts), ptr<float>(loss),
              ptr<void>(workspace), workspace_bytes, ptr<uint32_t>(counter), aux_scale, seq_len, seq_scale,
              z_coeff};
          const size_t need = router::fused_workspace_bytes(p);
          if (workspace_bytes < need) return need;
          router::fused_fwd(p, stream(s));
          return 0;
        });
  m.def("router_fused_bwd",
        [](uintptr_t grad_weights, uintptr_t grad_loss, uintptr_t logits, uintptr_t indices, uintptr_t aux_counts,
           uintptr_t seq_counts, uintptr_t grad_logits, int64_t num_tokens, int32_t num_experts, int32_t k,
           int32_t score, bool pre_softmax, bool normalize, float scaling_factor, float aux_scale, int64_t seq_len,
           float seq_scale, float z_coeff, int32_t dtype, int device, uintptr_t s) {
          DeviceGuard guard(device);
          router::FusedBwdParams p{
              router::TopkBwdParams{ptr<const float>(grad_weights), ptr<const void>(logits),
                                    ptr<const int32_t>(indices), ptr<float>(grad_logits), num_tokens, num_experts, k,
                                    Score(score), pre_softmax, normalize, scaling_factor, DType(dtype)},
              ptr<const float>(grad_loss), ptr<const int32_t>(aux_counts), ptr<const int32_t>(seq_counts), aux_scale,
              seq_len, seq_scale, z_coeff};
          router::fused_bwd(p, stream(s));
        });
}

void register_balance(py::module_& m) {
  m.attr("balance_max_experts") = router::kBalanceMaxExperts;
  m.def("balance_chunks", &router::balance_chunks, py::arg("num_tokens"), py::arg("seq_len"));
  m.def(
      "balance_loss_fwd",
      [](uintptr_t scores, uintptr_t indices, uintptr_t counts, bool counts_int64, uintptr_t partial_sums,
         uintptr_t partial_counts, uintptr_t seq_counts, uintptr_t loss, uintptr_t counter, int64_t num_tokens,
         int32_t num_experts, int32_t k, int64_t seq_len, float scale, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::BalanceParams p{ptr<const void>(scores),   ptr<const int32_t>(indices), ptr<const void>(counts),
                                counts_int64,             ptr<float>(partial_sums),    ptr<int32_t>(partial_counts),
                                ptr<int32_t>(seq_counts), ptr<float>(loss),            ptr<uint32_t>(counter),
                                num_tokens,               num_experts,                 k,
                                seq_len,                  scale,                       DType(dtype)};
        router::balance_loss_fwd(p, stream(s));
      },
      py::arg("scores"), py::arg("indices"), py::arg("counts"), py::arg("counts_int64"), py::arg("partial_sums"),
      py::arg("partial_counts"), py::arg("seq_counts"), py::arg("loss"), py::arg("counter"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("k"), py::arg("seq_len"), py::arg("scale"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"));
  m.def(
      "balance_loss_bwd",
      [](uintptr_t grad, uintptr_t counts, bool counts_int64, uintptr_t grad_scores, int64_t num_tokens,
         int32_t num_experts, int64_t seq_len, float scale, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::BalanceBwdParams p{ptr<const float>(grad), ptr<const void>(counts), counts_int64,
                                   ptr<void>(grad_scores), num_tokens,             num_experts,
                                   seq_len,                scale,                  DType(dtype)};
        router::balance_loss_bwd(p, stream(s));
      },
      py::arg("grad"), py::arg("counts"), py::arg("counts_int64"), py::arg("grad_scores"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("seq_len"), py::arg("scale"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"));
  m.def("z_loss_chunks", &router::z_loss_chunks, py::arg("num_tokens"));
  m.def(
      "z_loss_fwd",
      [](uintptr_t logits, uintptr_t lse, uintptr_t partials, uintptr_t loss, int64_t num_tokens,
         int32_t num_experts, float coeff, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::ZLossParams p{ptr<const void>(logits), ptr<float>(lse), ptr<float>(partials), ptr<float>(loss),
                              num_tokens,              num_experts,     coeff,                DType(dtype)};
        router::z_loss_fwd(p, stream(s));
      },
      py::arg("logits"), py::arg("lse"), py::arg("partials"), py::arg("loss"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("coeff"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "z_loss_bwd",
      [](uintptr_t grad, uintptr_t logits, uintptr_t lse, uintptr_t grad_logits, int64_t num_tokens,
         int32_t num_experts, float coeff, int32_t dtype, int device, uintptr_t s) {
        DeviceGuard guard(device);
        router::ZLossBwdParams p{ptr<const float>(grad), ptr<const void>(logits), ptr<const float>(lse),
                                 ptr<void>(grad_logits), num_tokens,              num_experts,
                                 coeff,                  DType(dtype)};
        router::z_loss_bwd(p, stream(s));
      },
      py::arg("grad"), py::arg("logits"), py::arg("lse"), py::arg("grad_logits"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("coeff"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def(
      "update_expert_bias",
      [](uintptr_t bias, uintptr_t counts, bool counts_int64, int32_t num_experts, float rate, int device,
         uintptr_t s) {
        DeviceGuard guard(device);
        router::update_expert_bias(ptr<float>(bias), ptr<const void>(counts), counts_int64, num_experts, rate,
                                   stream(s));
      },
      py::arg("bias"), py::arg("counts"), py::arg("counts_int64"), py::arg("num_experts"), py::arg("rate"),
      py::arg("device"), py::arg("stream"));
  m.def("capacity_workspace_bytes", &router::capacity_workspace_bytes, py::arg("num_slots"),
        py::arg("num_experts"));
  m.def("capacity_select_passes", &router::capacity_select_passes, py::arg("num_pairs"));
  m.def(
      "apply_capacity",
      [](uintptr_t weights, uintptr_t indices, uintptr_t weights_out, uintptr_t indices_out, uintptr_t workspace,
         int64_t num_slots, int32_t num_experts, int64_t capacity, bool by_probs, int32_t dtype, int device,
         uintptr_t s) {
        DeviceGuard guard(device);
        router::CapacityParams p{ptr<const void>(weights), ptr<const int32_t>(indices), ptr<void>(weights_out),
                                 ptr<int32_t>(indices_out), ptr<void>(workspace),       num_slots,
                                 num_experts,               capacity,                   by_probs,
                                 DType(dtype)};
        router::apply_capacity(p, stream(s));
      },
      py::arg("weights"), py::arg("indices"), py::arg("weights_out"), py::arg("indices_out"), py::arg("workspace"),
      py::arg("num_slots"), py::arg("num_experts"), py::arg("capacity"), py::arg("by_probs"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"));
}

}  // namespace moe::api
