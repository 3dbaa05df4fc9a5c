// Runs the CUTLASS sm_100f instance for the product and dtypes (csrc/gemm/sm100/): bf16, and E4M3 blockwise. Built into every extension;
// the instantiations exist only when the build targets the 10.x family (MOE_KERNELS_HAVE_SM100). They are
// opt-in (MOE_KERNELS_SM100_CUTLASS=1) until their GPU tests have passed on a Blackwell GPU; by default a
// 10.x GPU takes torch._grouped_mm for bf16 (moe_kernels/ops/grouped_mm.py).
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "gemm/grouped_mm.h"

namespace moe::gemm::sm100 {

#ifdef MOE_KERNELS_HAVE_SM100

#define MOE_SM100_INSTANCES(X)                                                                           \
  X(fwd_bf16_2sm_256x256x64_c2x1) X(dgrad_bf16_2sm_256x256x64_c2x1) X(wgrad_bf16_2sm_256x256x64_c2x1)      \
  X(fwd_fp8_blockwise_1sm_128x128x128_c1x1) X(wgrad_fp8_blockwise_1sm_128x128x128_c1x1)                 \
  X(wgrad_fp8_blockwise_bf16_1sm_128x128x128_c1x1) X(fwd_nvfp4_1sm_128x256x256_c1x1)

#define MOE_DECLARE(NAME)                                        \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count); \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
MOE_SM100_INSTANCES(MOE_DECLARE)
#undef MOE_DECLARE

namespace {

struct Entry {
  size_t (*workspace)(const GroupedParams&, int);
  void (*run)(const GroupedParams&, int, const GroupInfo*, cudaStream_t);
};

#define MOE_ENTRY(NAME) \
  Entry { &NAME##_workspace, &NAME##_run }

// bf16: one per product; E4M3: the forward and the wgrad by its output dtype (no FP8 dgrad: the recipe runs
// dgrad as a forward product on the transposed weight tiles); NVFP4: the forward (dgrad likewise).
const Entry& entry(const GroupedParams& p) {
  static const Entry kBf16[] = {MOE_ENTRY(fwd_bf16_2sm_256x256x64_c2x1), MOE_ENTRY(dgrad_bf16_2sm_256x256x64_c2x1),
                                MOE_ENTRY(wgrad_bf16_2sm_256x256x64_c2x1)};
  static const Entry kFp8Fwd = MOE_ENTRY(fwd_fp8_blockwise_1sm_128x128x128_c1x1);
  static const Entry kFp8Wgrad = MOE_ENTRY(wgrad_fp8_blockwise_1sm_128x128x128_c1x1);
  static const Entry kFp8WgradBf16 = MOE_ENTRY(wgrad_fp8_blockwise_bf16_1sm_128x128x128_c1x1);
  static const Entry kNvfp4Fwd = MOE_ENTRY(fwd_nvfp4_1sm_128x256x256_c1x1);
  if (p.dtype == DType::kBFloat16) return kBf16[int(p.op)];
  if (p.dtype == DType::kFloat4E2M1 && p.op == GemmOp::kFwd) return kNvfp4Fwd;
  if (p.dtype == DType::kFloat8E4M3 && p.op == GemmOp::kFwd) return kFp8Fwd;
  if (p.dtype == DType::kFloat8E4M3 && p.op == GemmOp::kWgrad) {
    return p.fp8_wgrad_out == DType::kBFloat16 ? kFp8WgradBf16 : kFp8Wgrad;
  }
  throw std::logic_error("grouped_mm: no sm_100f instance for this product and dtype");
}
#undef MOE_ENTRY

}  // namespace

bool compiled() { return true; }

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOE_KERNELS_SM100_CUTLASS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

size_t workspace_bytes(const GroupedParams& p, int sm_count) { return entry(p).workspace(p, sm_count); }

void run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) {
  entry(p).run(p, sm_count, groups, stream);
}

#else

bool compiled() { return false; }
bool enabled() { return false; }

size_t workspace_bytes(const GroupedParams&, int) {
  throw std::logic_error("grouped_mm: this build has no sm_100f kernels");
}

void run(const GroupedParams&, int, const GroupInfo*, cudaStream_t) {
  throw std::logic_error("grouped_mm: this build has no sm_100f kernels");
}

#endif

}  // namespace moe::gemm::sm100
