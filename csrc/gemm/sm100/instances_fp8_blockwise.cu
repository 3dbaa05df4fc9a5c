// The FP8 blockwise grouped GEMM instances for sm_100f (forward, wgrad), listed in sm100_dispatch.cu.
//
// Several instances to a translation unit: each one's own code compiles in seconds, while the CUTLASS headers
// and the templates all instances share take about a minute per translation unit (measured with nvcc 13.0).
#include "gemm/sm100/fp8_blockwise_sm100.cuh"

namespace moe::gemm::sm100 {

MOE_FP8_BLOCKWISE_SM100_INSTANCE(fwd_fp8_blockwise_1sm_128x128x128_c1x1, GemmOp::kFwd, cutlass::bfloat16_t)

MOE_FP8_BLOCKWISE_SM100_INSTANCE(wgrad_fp8_blockwise_1sm_128x128x128_c1x1, GemmOp::kWgrad, float)

MOE_FP8_BLOCKWISE_SM100_INSTANCE(wgrad_fp8_blockwise_bf16_1sm_128x128x128_c1x1, GemmOp::kWgrad, cutlass::bfloat16_t)

}  // namespace moe::gemm::sm100
