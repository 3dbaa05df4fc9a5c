#include "gemm/sm90/fp8_blockwise.cuh"

namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_INSTANCE(wgrad_fp8_blockwise_128x128x128_c1x1, GemmOp::kWgrad, float, 1)
}  // namespace moe::gemm::sm90
