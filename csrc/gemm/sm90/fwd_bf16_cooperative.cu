#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(fwd_bf16_cooperative, cutlass::bfloat16_t, GemmOp::kFwd, Cooperative)
}  // namespace moe::gemm::sm90
