#include "gemm/sm90/fp8_blockwise.cuh"

// The FP8 weight gradient written as bf16 (a bf16 weight's gradient dtype): no fp32 [E, N, K] and no cast.
namespace moe::gemm::sm90 {
size_t wgrad_fp8_blockwise_bf16_workspace(const GroupedParams& p, int sm_count) {
  return Fp8BlockwiseGemm<GemmOp::kWgrad, cutlass::bfloat16_t>::workspace_bytes(p, sm_count);
}
void wgrad_fp8_blockwise_bf16_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) {
  Fp8BlockwiseGemm<GemmOp::kWgrad, cutlass::bfloat16_t>::run(p, sm_count, groups, stream);
}
}  // namespace moe::gemm::sm90
