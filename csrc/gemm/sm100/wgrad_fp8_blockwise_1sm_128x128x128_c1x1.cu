#include "gemm/sm100/fp8_blockwise_sm100.cuh"

namespace moe::gemm::sm100 {
MOE_FP8_BLOCKWISE_SM100_INSTANCE(wgrad_fp8_blockwise_1sm_128x128x128_c1x1, GemmOp::kWgrad, float)
}  // namespace moe::gemm::sm100
