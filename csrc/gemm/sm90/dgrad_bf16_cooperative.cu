#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_cooperative, cutlass::bfloat16_t, GemmOp::kDgrad, Cooperative)
}  // namespace moe::gemm::sm90
