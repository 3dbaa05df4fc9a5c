#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(wgrad_fp16_coop_256x128x64_c1x1, cutlass::half_t, GemmOp::kWgrad, Sm90Config<256, 128, 64, 1, 1, false>)
}  // namespace moe::gemm::sm90
