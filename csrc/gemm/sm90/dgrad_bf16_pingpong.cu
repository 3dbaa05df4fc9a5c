#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_pingpong, cutlass::bfloat16_t, GemmOp::kDgrad, Pingpong)
}  // namespace moe::gemm::sm90
