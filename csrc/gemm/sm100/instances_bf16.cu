// The bf16 grouped GEMM instances for sm_100f (forward, dgrad, wgrad), listed in sm100_dispatch.cu.
//
// Several instances to a translation unit: each one's own code compiles in seconds, while the CUTLASS headers
// and the templates all instances share take about a minute per translation unit (measured with nvcc 13.0).
#include "gemm/sm100/grouped_sm100.cuh"

namespace moe::gemm::sm100 {

MOE_GROUPED_SM100_INSTANCE(dgrad_bf16_2sm_256x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kDgrad, Sm100Config<256, 256, 64, 2, 1, true>)

MOE_GROUPED_SM100_INSTANCE(fwd_bf16_2sm_256x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kFwd, Sm100Config<256, 256, 64, 2, 1, true>)

MOE_GROUPED_SM100_INSTANCE(wgrad_bf16_2sm_256x256x64_c2x1, cutlass::bfloat16_t, GemmOp::kWgrad, Sm100Config<256, 256, 64, 2, 1, true>)

}  // namespace moe::gemm::sm100
