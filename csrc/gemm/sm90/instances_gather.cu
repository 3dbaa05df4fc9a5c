// The gathered grouped GEMMs for sm_90a (the expert MLP's forward, dgrad and wgrad), listed in sm90_dispatch.cu.
#include "gemm/sm90/gather_sm90.cuh"

namespace moe::gemm::sm90 {

MOE_GATHER_SM90_INSTANCE(gather_dgrad_bf16_128x128x64, cutlass::bfloat16_t, GemmOp::kDgrad)

MOE_GATHER_SM90_INSTANCE(gather_fwd_bf16_128x128x64, cutlass::bfloat16_t, GemmOp::kFwd)

MOE_GATHER_SM90_INSTANCE(gather_wgrad_bf16_128x128x64, cutlass::bfloat16_t, GemmOp::kWgrad)

}  // namespace moe::gemm::sm90
