#include "gemm/sm100/grouped_sm100.cuh"

namespace moe::gemm::sm100 {
MOE_GROUPED_SM100_INSTANCE(wgrad_bf16_2sm_256x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kWgrad, Sm100Config<256, 256, 64, 2, 1, true>)
}  // namespace moe::gemm::sm100
