#include "gemm/sm100/fp8_blockwise_sm100.cuh"

namespace moe::gemm::sm100 {
MOE_FP8_BLOCKWISE_SM100_INSTANCE(fwd_fp8_blockwise_1sm_128x128x128_c1x1, GemmOp::kFwd, cutlass::bfloat16_t)
}  // namespace moe::gemm::sm100
