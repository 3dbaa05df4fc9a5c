// CUTLASS grouped GEMM for Blackwell datacenter GPUs (sm_100f: B200 and B300, compute capability 10.0 and
// 10.3): TMA loads, tcgen05 MMAs accumulating in tensor memory, warp-specialised persistent kernels with the
// grouped tile scheduler; the same device-written problem shapes, pointers and strides as the sm_90a
// instances (gemm/sm90/grouped_sm90.cuh's GroupedGemm and prepare kernel), with Blackwell's schedules.
// Compiled for the 10.x family (sm_100f): an sm_100a cubin does not load on a B300.
#pragma once

#include "gemm/sm90/grouped_sm90.cuh"

namespace moe::gemm::sm100 {

using namespace cute;

// kTwoSm: a 2-SM MMA (one tile of kTileM = 256 rows shared by the two CTAs of a 2x1 cluster, each operand
// tile loaded once for both); else one SM per tile (kTileM = 128).
template <int kTileM, int kTileN, int kTileK, int kClusterM, int kClusterN, bool kTwoSm>
struct Sm100Config {
  using Arch = cutlass::arch::Sm100;
  using Tile = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using Cluster = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
  using Kernel = cute::conditional_t<kTwoSm, cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmSm100,
                                     cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100>;
  using Epilogue = cute::conditional_t<kTwoSm, cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>;
};

using sm90::GroupedGemm;

}  // namespace moe::gemm::sm100

// One explicit instantiation, named for the dispatcher (gemm/sm100_dispatch.cu), its kernel too (NamedKernel).
#define MOE_GROUPED_SM100_INSTANCE(NAME, ELEMENT, OP, ...)                                             \
  struct NAME##_instance;                                                                              \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count) {                                      \
    return GroupedGemm<ELEMENT, OP, __VA_ARGS__, NAME##_instance>::workspace_bytes(p, sm_count);       \
  }                                                                                                    \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) { \
    GroupedGemm<ELEMENT, OP, __VA_ARGS__, NAME##_instance>::run(p, sm_count, groups, stream);          \
  }
