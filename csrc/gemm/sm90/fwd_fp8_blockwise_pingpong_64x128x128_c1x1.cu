#include "gemm/sm90/fp8_blockwise.cuh"

// Ping-pong, 64x128 tiles: one warpgroup's epilogue under the other's mainloop (short contractions).
namespace moe::gemm::sm90 {
MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(fwd_fp8_blockwise_pingpong_64x128x128_c1x1, GemmOp::kFwd, cutlass::bfloat16_t)
}  // namespace moe::gemm::sm90
