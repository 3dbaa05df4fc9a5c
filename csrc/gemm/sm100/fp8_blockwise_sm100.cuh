// FP8 blockwise grouped GEMMs for Blackwell (sm_100f): the sm_90a instances' template (gemm/sm90/
// fp8_blockwise.cuh: the same operands, scale layouts, device-written problems and epilogues) with Blackwell's
// 1-SM blockwise schedule (tcgen05 FP8 MMAs, the scales applied per 128 of the contraction).
#pragma once

#include "gemm/sm90/fp8_blockwise.cuh"

namespace moe::gemm::sm100 {

using namespace cute;

struct Sm100Fp8Schedule {
  using Arch = cutlass::arch::Sm100;
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedBlockwise1SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
};

using sm90::Fp8BlockwiseGemm;

}  // namespace moe::gemm::sm100

#define MOE_FP8_BLOCKWISE_SM100_INSTANCE(NAME, OP, ELEMENT_OUT) \
  MOE_FP8_BLOCKWISE_SCHEDULE_INSTANCE(NAME, OP, ELEMENT_OUT, Sm100Fp8Schedule)
