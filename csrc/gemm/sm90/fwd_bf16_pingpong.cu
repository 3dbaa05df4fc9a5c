#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(fwd_bf16_pingpong, cutlass::bfloat16_t, GemmOp::kFwd, Pingpong)
}  // namespace moe::gemm::sm90
