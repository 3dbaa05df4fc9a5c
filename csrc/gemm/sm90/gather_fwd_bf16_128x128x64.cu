#include "gemm/sm90/gather_sm90.cuh"

namespace moe::gemm::sm90 {
MOE_GATHER_SM90_INSTANCE(gather_fwd_bf16_128x128x64, cutlass::bfloat16_t, GemmOp::kFwd)
}  // namespace moe::gemm::sm90
