// Picks the CUTLASS sm_90a instantiation for (op, dtype, schedule). Built into every extension; the
// instantiations themselves exist only when the build targets sm_90a (MOE_KERNELS_HAVE_SM90).
#include <stdexcept>

#include "gemm/grouped_mm.h"

namespace moe::gemm::sm90 {

#ifdef MOE_KERNELS_HAVE_SM90

#define MOE_DECLARE(NAME)                                             \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count);      \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
MOE_DECLARE(fwd_bf16_pingpong)
MOE_DECLARE(fwd_bf16_cooperative)
MOE_DECLARE(fwd_fp16_pingpong)
MOE_DECLARE(fwd_fp16_cooperative)
MOE_DECLARE(dgrad_bf16_pingpong)
MOE_DECLARE(dgrad_bf16_cooperative)
MOE_DECLARE(dgrad_fp16_pingpong)
MOE_DECLARE(dgrad_fp16_cooperative)
MOE_DECLARE(wgrad_bf16_cooperative)
MOE_DECLARE(wgrad_fp16_cooperative)
MOE_DECLARE(fwd_fp8_blockwise)
MOE_DECLARE(wgrad_fp8_blockwise)
MOE_DECLARE(wgrad_fp8_blockwise_bf16)
#undef MOE_DECLARE

namespace {

struct Entry {
  size_t (*workspace)(const GroupedParams&, int);
  void (*run)(const GroupedParams&, int, const GroupInfo*, cudaStream_t);
};

#define MOE_ENTRY(NAME) Entry{&NAME##_workspace, &NAME##_run}

Entry pick(const GroupedParams& p, Path path) {
  if (path == Path::kSm90Fp8Blockwise) {
    if (p.op != GemmOp::kWgrad) return MOE_ENTRY(fwd_fp8_blockwise);
    return p.fp8_wgrad_out == DType::kBFloat16 ? MOE_ENTRY(wgrad_fp8_blockwise_bf16) : MOE_ENTRY(wgrad_fp8_blockwise);
  }
  const bool bf16 = p.dtype == DType::kBFloat16;
  const bool pingpong = path == Path::kSm90Pingpong;
  switch (p.op) {
    case GemmOp::kFwd:
      if (bf16) return pingpong ? MOE_ENTRY(fwd_bf16_pingpong) : MOE_ENTRY(fwd_bf16_cooperative);
      return pingpong ? MOE_ENTRY(fwd_fp16_pingpong) : MOE_ENTRY(fwd_fp16_cooperative);
    case GemmOp::kDgrad:
      if (bf16) return pingpong ? MOE_ENTRY(dgrad_bf16_pingpong) : MOE_ENTRY(dgrad_bf16_cooperative);
      return pingpong ? MOE_ENTRY(dgrad_fp16_pingpong) : MOE_ENTRY(dgrad_fp16_cooperative);
    case GemmOp::kWgrad:
      return bf16 ? MOE_ENTRY(wgrad_bf16_cooperative) : MOE_ENTRY(wgrad_fp16_cooperative);
  }
  throw std::invalid_argument("grouped_mm: unknown op");
}

#undef MOE_ENTRY

}  // namespace

bool compiled() { return true; }

size_t workspace_bytes(const GroupedParams& p, Path path, int sm_count) { return pick(p, path).workspace(p, sm_count); }

void run(const GroupedParams& p, Path path, int sm_count, const GroupInfo* groups, cudaStream_t stream) {
  pick(p, path).run(p, sm_count, groups, stream);
}

#else

bool compiled() { return false; }

size_t workspace_bytes(const GroupedParams&, Path, int) {
  throw std::logic_error("grouped_mm: this build has no sm_90a kernels");
}

void run(const GroupedParams&, Path, int, const GroupInfo*, cudaStream_t) {
  throw std::logic_error("grouped_mm: this build has no sm_90a kernels");
}

#endif

}  // namespace moe::gemm::sm90
