#include "gemm/sm90/fp8_blockwise.cuh"

// Cluster 2x1: each weight tile and its scales loaded once for two row tiles (TMA multicast).
namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_INSTANCE(fwd_fp8_blockwise_128x128x128_c2x1, GemmOp::kFwd, cutlass::bfloat16_t, 2)
}  // namespace moe::gemm::sm90
