#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GROUPED_SM90_INSTANCE(dgrad_fp16_pingpong_128x128x64_c1x1, cutlass::half_t, GemmOp::kDgrad, Sm90Config<128, 128, 64, 1, 1, true>)
}  // namespace moe::gemm::sm90
