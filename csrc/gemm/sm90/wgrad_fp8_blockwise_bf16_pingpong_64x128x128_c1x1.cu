#include "gemm/sm90/fp8_blockwise.cuh"

// Ping-pong, 64x128 tiles, bf16 output: one warpgroup's epilogue under the other's mainloop.
namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(wgrad_fp8_blockwise_bf16_pingpong_64x128x128_c1x1, GemmOp::kWgrad, cutlass::bfloat16_t)
}  // namespace moe::gemm::sm90
