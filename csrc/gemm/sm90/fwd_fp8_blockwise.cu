#include "gemm/sm90/fp8_blockwise.cuh"

namespace moe::gemm::sm90 {
size_t fwd_fp8_blockwise_workspace(const GroupedParams& p, int sm_count) {
  return Fp8BlockwiseGemm<GemmOp::kFwd, cutlass::bfloat16_t>::workspace_bytes(p, sm_count);
}
void fwd_fp8_blockwise_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) {
  Fp8BlockwiseGemm<GemmOp::kFwd, cutlass::bfloat16_t>::run(p, sm_count, groups, stream);
}
}  // namespace moe::gemm::sm90
