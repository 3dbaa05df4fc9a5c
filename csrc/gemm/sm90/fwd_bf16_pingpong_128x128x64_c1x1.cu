#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(fwd_bf16_pingpong_128x128x64_c1x1, cutlass::bfloat16_t, GemmOp::kFwd, Sm90Config<128, 128, 64, 1, 1, true>)
}  // namespace moe::gemm::sm90
