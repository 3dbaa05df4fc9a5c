// The FP8 blockwise grouped GEMM instances for sm_90a (forward, wgrad), listed in sm90_kernels.cu.
//
// Several instances to a translation unit: each one's own code compiles in seconds, while the CUTLASS headers
// and the templates all instances share take about a minute per translation unit (measured with nvcc 13.0).
#include "gemm/sm90/fp8_blockwise.cuh"

namespace moe::gemm::sm90 {

MOE_FP8_BLOCKWISE_INSTANCE(fwd_fp8_blockwise_128x128x128_c1x1, GemmOp::kFwd, cutlass::bfloat16_t, 1)

// Cluster 2x1: each weight tile and its scales loaded once for two row tiles (TMA multicast).
MOE_FP8_BLOCKWISE_INSTANCE(fwd_fp8_blockwise_128x128x128_c2x1, GemmOp::kFwd, cutlass::bfloat16_t, 2)

// Ping-pong, 64x128 tiles: one warpgroup's epilogue under the other's mainloop (short contractions).
MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(fwd_fp8_blockwise_pingpong_64x128x128_c1x1, GemmOp::kFwd, cutlass::bfloat16_t)

MOE_FP8_BLOCKWISE_INSTANCE(wgrad_fp8_blockwise_128x128x128_c1x1, GemmOp::kWgrad, float, 1)

// The FP8 weight gradient written as bf16 (a bf16 weight's gradient dtype): no fp32 [E, N, K] and no cast.
MOE_FP8_BLOCKWISE_INSTANCE(wgrad_fp8_blockwise_bf16_128x128x128_c1x1, GemmOp::kWgrad, cutlass::bfloat16_t, 1)

// Ping-pong, 64x128 tiles, bf16 output: one warpgroup's epilogue under the other's mainloop.
MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(wgrad_fp8_blockwise_bf16_pingpong_64x128x128_c1x1, GemmOp::kWgrad, cutlass::bfloat16_t)

// Ping-pong, 64x128 tiles: one warpgroup's fp32 epilogue (read too where it accumulates) under the other's
// mainloop; for experts with few tokens each.
MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(wgrad_fp8_blockwise_pingpong_64x128x128_c1x1, GemmOp::kWgrad, float)

}  // namespace moe::gemm::sm90
