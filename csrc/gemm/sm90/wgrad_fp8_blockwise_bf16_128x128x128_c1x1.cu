#include "gemm/sm90/fp8_blockwise.cuh"

// The FP8 weight gradient written as bf16 (a bf16 weight's gradient dtype): no fp32 [E, N, K] and no cast.
namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_INSTANCE(wgrad_fp8_blockwise_bf16_128x128x128_c1x1, GemmOp::kWgrad, cutlass::bfloat16_t, 1)
}  // namespace moe::gemm::sm90
