// The bf16 and fp16 grouped GEMM instances for sm_90a (forward, dgrad, wgrad), listed in sm90_kernels.cu.
//
// Several instances to a translation unit: each one's own code compiles in seconds, while the CUTLASS headers
// and the templates all instances share take about a minute per translation unit (measured with nvcc 13.0).
#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm90 {

MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_coop_128x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kDgrad, Sm90Config<128, 256, 64, 2, 1, false>)

MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_coop_256x128x64_c1x1, cutlass::bfloat16_t, GemmOp::kDgrad, Sm90Config<256, 128, 64, 1, 1, false>)

MOE_GROUPED_SM90_INSTANCE(dgrad_bf16_pingpong_128x128x64_c1x1, cutlass::bfloat16_t, GemmOp::kDgrad, Sm90Config<128, 128, 64, 1, 1, true>)

MOE_GROUPED_SM90_INSTANCE(fwd_bf16_coop_128x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kFwd, Sm90Config<128, 256, 64, 2, 1, false>)

MOE_GROUPED_SM90_INSTANCE(fwd_bf16_coop_256x128x64_c1x1, cutlass::bfloat16_t, GemmOp::kFwd, Sm90Config<256, 128, 64, 1, 1, false>)

MOE_GROUPED_SM90_INSTANCE(fwd_bf16_pingpong_128x128x64_c1x1, cutlass::bfloat16_t, GemmOp::kFwd, Sm90Config<128, 128, 64, 1, 1, true>)

MOE_GROUPED_SM90_INSTANCE(wgrad_bf16_coop_128x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kWgrad, Sm90Config<128, 256, 64, 2, 1, false>)

MOE_GROUPED_SM90_INSTANCE(wgrad_bf16_coop_256x128x64_c1x1, cutlass::bfloat16_t, GemmOp::kWgrad, Sm90Config<256, 128, 64, 1, 1, false>)

// fp16
MOE_GROUPED_SM90_INSTANCE(dgrad_fp16_coop_256x128x64_c1x1, cutlass::half_t, GemmOp::kDgrad, Sm90Config<256, 128, 64, 1, 1, false>)

MOE_GROUPED_SM90_INSTANCE(dgrad_fp16_pingpong_128x128x64_c1x1, cutlass::half_t, GemmOp::kDgrad, Sm90Config<128, 128, 64, 1, 1, true>)

MOE_GROUPED_SM90_INSTANCE(fwd_fp16_coop_256x128x64_c1x1, cutlass::half_t, GemmOp::kFwd, Sm90Config<256, 128, 64, 1, 1, false>)

MOE_GROUPED_SM90_INSTANCE(fwd_fp16_pingpong_128x128x64_c1x1, cutlass::half_t, GemmOp::kFwd, Sm90Config<128, 128, 64, 1, 1, true>)

MOE_GROUPED_SM90_INSTANCE(wgrad_fp16_coop_256x128x64_c1x1, cutlass::half_t, GemmOp::kWgrad, Sm90Config<256, 128, 64, 1, 1, false>)

}  // namespace moe::gemm::sm90
