#include "gemm/sm90/fp8_blockwise.cuh"

namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_INSTANCE(fwd_fp8_blockwise_128x128x128_c1x1, GemmOp::kFwd, cutlass::bfloat16_t, 1)
}  // namespace moe::gemm::sm90
