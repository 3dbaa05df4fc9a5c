#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(fwd_fp16_pingpong, cutlass::half_t, GemmOp::kFwd, Pingpong)
}  // namespace moe::gemm::sm90
