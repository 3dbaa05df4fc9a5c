// Runs the CUTLASS sm_100f bf16 instance for the product (csrc/gemm/sm100/). Built into every extension;
// the instantiations exist only when the build targets the 10.x family (MOE_KERNELS_HAVE_SM100). They are
// opt-in (MOE_KERNELS_SM100_CUTLASS=1) until their GPU tests have passed on a Blackwell GPU; by default a
// 10.x GPU takes torch._grouped_mm for bf16 (moe_kernels/ops/grouped_mm.py).
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "gemm/grouped_mm.h"

namespace moe::gemm::sm100 {

#ifdef MOE_KERNELS_HAVE_SM100

#define MOE_SM100_INSTANCES(X) \
  X(fwd_bf16_2sm_256x256x64_c2x1) X(dgrad_bf16_2sm_256x256x64_c2x1) X(wgrad_bf16_2sm_256x256x64_c2x1)

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

const Entry& entry(const GroupedParams& p) {
  static const Entry kEntries[] = {
      {&fwd_bf16_2sm_256x256x64_c2x1_workspace, &fwd_bf16_2sm_256x256x64_c2x1_run},
      {&dgrad_bf16_2sm_256x256x64_c2x1_workspace, &dgrad_bf16_2sm_256x256x64_c2x1_run},
      {&wgrad_bf16_2sm_256x256x64_c2x1_workspace, &wgrad_bf16_2sm_256x256x64_c2x1_run},
  };
  if (p.dtype != DType::kBFloat16) throw std::logic_error("grouped_mm: the sm_100f instances are bf16");
  return kEntries[int(p.op)];
}

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
