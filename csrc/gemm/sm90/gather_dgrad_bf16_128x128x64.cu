#include "gemm/sm90/gather_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GATHER_SM90_INSTANCE(gather_dgrad_bf16_128x128x64, cutlass::bfloat16_t, GemmOp::kDgrad)
}  // namespace moe::gemm::sm90
