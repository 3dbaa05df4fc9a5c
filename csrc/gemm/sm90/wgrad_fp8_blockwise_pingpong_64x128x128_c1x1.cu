#include "gemm/sm90/fp8_blockwise.cuh"

// Ping-pong, 64x128 tiles: one warpgroup's fp32 epilogue (read too where it accumulates) under the other's
// mainloop; for experts with few tokens each.
namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(wgrad_fp8_blockwise_pingpong_64x128x128_c1x1, GemmOp::kWgrad, float)
}  // namespace moe::gemm::sm90
