#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_pingpong_64x128x128_c2x1, cutlass::bfloat16_t, GemmOp::kDgrad, Sm90Config<64, 128, 128, 2, 1, true>)
}  // namespace moe::gemm::sm90
