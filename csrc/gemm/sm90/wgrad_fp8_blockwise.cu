#include "gemm/sm90/fp8_blockwise.cuh"

namespace moe::gemm::sm90 {
size_t wgrad_fp8_blockwise_workspace(const GroupedParams& p, int sm_count) {
  return Fp8BlockwiseGemm<GemmOp::kWgrad, float>::workspace_bytes(p, sm_count);
}
void wgrad_fp8_blockwise_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) {
  Fp8BlockwiseGemm<GemmOp::kWgrad, float>::run(p, sm_count, groups, stream);
}
}  // namespace moe::gemm::sm90
