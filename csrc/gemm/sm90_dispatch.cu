// Runs the CUTLASS sm_90a instantiation that resolve_sm90 chose (by kernel id, sm90_kernels.h). Built into
// every extension; the instantiations themselves exist only when the build targets sm_90a
// (MOE_KERNELS_HAVE_SM90).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "gemm/grouped_mm.h"
#include "gemm/sm90_kernels.h"

namespace moe::gemm::sm90 {

#ifdef MOE_KERNELS_HAVE_SM90

// The instance list, in kSm90Kernels' order (checked by name at first use).
#define MOE_SM90_INSTANCES(X)                                                                                \
  X(fwd_bf16_pingpong_128x128x64_c1x1) X(fwd_bf16_coop_256x128x64_c1x1) X(fwd_bf16_coop_128x256x64_c2x1)       \
  X(fwd_fp16_pingpong_128x128x64_c1x1) X(fwd_fp16_coop_256x128x64_c1x1) X(dgrad_bf16_pingpong_128x128x64_c1x1) \
  X(dgrad_bf16_coop_256x128x64_c1x1) X(dgrad_bf16_coop_128x256x64_c2x1) X(dgrad_fp16_pingpong_128x128x64_c1x1) \
  X(dgrad_fp16_coop_256x128x64_c1x1) X(wgrad_bf16_coop_256x128x64_c1x1) X(wgrad_bf16_coop_128x256x64_c2x1)     \
  X(wgrad_fp16_coop_256x128x64_c1x1) X(fwd_fp8_blockwise_128x128x128_c1x1) X(fwd_fp8_blockwise_128x128x128_c2x1) \
  X(wgrad_fp8_blockwise_128x128x128_c1x1) X(wgrad_fp8_blockwise_bf16_128x128x128_c1x1)                     \
  X(fwd_fp8_blockwise_pingpong_64x128x128_c1x1) X(wgrad_fp8_blockwise_pingpong_64x128x128_c1x1)           \
  X(wgrad_fp8_blockwise_bf16_pingpong_64x128x128_c1x1)

#define MOE_DECLARE(NAME)                                        \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count); \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
MOE_SM90_INSTANCES(MOE_DECLARE)
#undef MOE_DECLARE

namespace {

struct Entry {
  const char* name;
  size_t (*workspace)(const GroupedParams&, int);
  void (*run)(const GroupedParams&, int, const GroupInfo*, cudaStream_t);
};

#define MOE_ENTRY(NAME) Entry{#NAME, &NAME##_workspace, &NAME##_run},
const Entry kEntries[] = {MOE_SM90_INSTANCES(MOE_ENTRY)};
#undef MOE_ENTRY
constexpr int kNumEntries = int(sizeof(kEntries) / sizeof(kEntries[0]));

const Entry& entry(const GroupedParams& p) {
  static const bool same_list = [] {
    if (kNumEntries != kNumSm90Kernels) return false;
    for (int i = 0; i < kNumEntries; ++i)
      if (std::string(kEntries[i].name) != kSm90Kernels[i].name) return false;
    return true;
  }();
  if (!same_list) throw std::logic_error("grouped_mm: the sm_90a instances and kSm90Kernels disagree");
  if (p.kernel < 0 || p.kernel >= kNumEntries || p.raster < 0) {
    throw std::logic_error("grouped_mm: the sm_90a kernel was not resolved");
  }
  return kEntries[p.kernel];
}

}  // namespace

bool compiled() { return true; }

size_t workspace_bytes(const GroupedParams& p, int sm_count) { return entry(p).workspace(p, sm_count); }

void run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) {
  entry(p).run(p, sm_count, groups, stream);
}

#define MOE_GATHER_INSTANCES(X) X(gather_fwd_bf16_128x128x64) X(gather_dgrad_bf16_128x128x64) X(gather_wgrad_bf16_128x128x64)
#define MOE_DECLARE(NAME) \
  void NAME##_run(const GroupedParams& p, const GroupInfo* groups, const int32_t* tiles, int64_t row_tiles, cudaStream_t stream);
MOE_GATHER_INSTANCES(MOE_DECLARE)
#undef MOE_DECLARE

bool gather_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOE_KERNELS_GATHER_CUTLASS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

void gather_run(const GroupedParams& p, const GroupInfo* groups, const int32_t* tiles, int64_t row_tiles,
                cudaStream_t stream) {
  if (p.dtype != DType::kBFloat16) throw std::logic_error("grouped_mm: the gathered sm_90a kernels take bf16");
  switch (p.op) {
    case GemmOp::kFwd: return gather_fwd_bf16_128x128x64_run(p, groups, tiles, row_tiles, stream);
    case GemmOp::kDgrad: return gather_dgrad_bf16_128x128x64_run(p, groups, tiles, row_tiles, stream);
    default: return gather_wgrad_bf16_128x128x64_run(p, groups, tiles, row_tiles, stream);
  }
}

#else

bool compiled() { return false; }

size_t workspace_bytes(const GroupedParams&, int) {
  throw std::logic_error("grouped_mm: this build has no sm_90a kernels");
}

void run(const GroupedParams&, int, const GroupInfo*, cudaStream_t) {
  throw std::logic_error("grouped_mm: this build has no sm_90a kernels");
}

bool gather_enabled() { return false; }

void gather_run(const GroupedParams&, const GroupInfo*, const int32_t*, int64_t, cudaStream_t) {
  throw std::logic_error("grouped_mm: this build has no sm_90a kernels");
}

#endif

}  // namespace moe::gemm::sm90
