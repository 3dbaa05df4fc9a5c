#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_coop_128x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kDgrad, Sm90Config<128, 256, 64, 2, 1, false>)
}  // namespace moe::gemm::sm90
