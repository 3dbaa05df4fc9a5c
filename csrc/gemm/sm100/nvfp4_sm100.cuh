// NVFP4 block-scaled grouped GEMM for Blackwell (sm_100f): tcgen05 block-scaled MMAs on E2M1 operands with one
// E4M3 scale per 16 elements along K (specs/lowprec.md, "NVFP4"), CUTLASS's 1-SM NVFP4 ptr-array kernel with
// the grouped tile scheduler; problem shapes, pointers and scale layouts written on the device from the group
// sizes (no host sync), as for the bf16 and FP8 instances.
//
// Forward only (the recipe runs dgrad as a forward on the transposed weight, wgrad in its own precision):
//   d[rows of e] = alpha * sum_k (a[rows, k] * sfa[rows, k / 16]) (b[e][:, k] * sfb[e][:, k / 16])
//   a = x codes [M, K / 2] (two E2M1 codes a byte, the first element in the low nibble: quantize_nvfp4's
//   packing), b = w codes [E, N, K / 2], d bf16 [M, N], alpha = (1 / a_global) / b_global read on the device.
// The scales reach this kernel in CUTLASS's blocked layout (Sm1xxBlockScaledConfig: atoms of 128 rows x 4
// scales, 512 bytes, rows r % 32 at stride 16 and r / 32 % 4 at stride 4, atoms K-block-major), one run of
// whole atoms per group: grouped_mm.cu converts quantize_nvfp4's row-major [rows, K / 16] scales into it
// (nvfp4_blocked_scales_kernel), each group's rows padded to 128, so `groups[e].tile_start` (tiles of 128
// rows) is the group's first atom row.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <cute/tensor.hpp>

#include "common/check.h"
#include "gemm/grouped_mm.h"
#include "gemm/sm90/cutlass_common.cuh"

namespace moe::gemm::sm100 {

using namespace cute;
using sm90::round_up;
using sm90::take;

template <int kTileM, int kTileN, int kTileK, typename Name = void>
struct Nvfp4Gemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
  using ElementCode = typename ElementAB::DataType;
  using ElementSF = typename ElementAB::ScaleFactorType;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // x [M, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // w[e] [N, K], K-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 32;  // 16 bytes of codes
  static constexpr int kAlignD = 8;
  using Tile = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using Cluster = Shape<_1, _1, _1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB,
      LayoutB*, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100>::CollectiveOp;

  using Kernel =
      sm90::NamedKernel<cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>, Name>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using LayoutSFA = typename CollectiveMainloop::InternalLayoutSFA;
  using LayoutSFB = typename CollectiveMainloop::InternalLayoutSFB;
  using ScaleConfig = typename CollectiveMainloop::Sm1xxBlkScaledConfig;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  static_assert(ScaleConfig::SFVecSize == 16, "NVFP4: one scale per 16 elements");

  struct Arrays {
    Shape3* shapes;
    const ElementCode** ptr_a;
    const ElementCode** ptr_b;
    const ElementSF** ptr_sfa;
    const ElementSF** ptr_sfb;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    float* alpha;  // [1]
    void* cutlass_workspace;
  };

  static size_t arrays_bytes(int E) {
    return round_up(E * sizeof(Shape3)) + 5 * round_up(E * sizeof(void*)) + round_up(E * sizeof(StrideA)) +
           round_up(E * sizeof(StrideB)) + round_up(E * sizeof(StrideD)) + round_up(E * sizeof(LayoutSFA)) +
           round_up(E * sizeof(LayoutSFB)) + round_up(sizeof(float));
  }

  static Arrays carve(void* ws, int E) {
    char* p = static_cast<char*>(ws);
    Arrays a;
    a.shapes = take<Shape3>(p, E);
    a.ptr_a = take<const ElementCode*>(p, E);
    a.ptr_b = take<const ElementCode*>(p, E);
    a.ptr_sfa = take<const ElementSF*>(p, E);
    a.ptr_sfb = take<const ElementSF*>(p, E);
    a.ptr_d = take<ElementD*>(p, E);
    a.stride_a = take<StrideA>(p, E);
    a.stride_b = take<StrideB>(p, E);
    a.stride_d = take<StrideD>(p, E);
    a.layout_sfa = take<LayoutSFA>(p, E);
    a.layout_sfb = take<LayoutSFB>(p, E);
    a.alpha = take<float>(p, 1);
    a.cutlass_workspace = p;
    return a;
  }

  static typename Gemm::Arguments arguments(const Arrays& arr, const GroupedParams& p, int sm_count) {
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {p.num_groups, arr.shapes, nullptr},
        {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b, arr.ptr_sfa, arr.layout_sfa, arr.ptr_sfb, arr.layout_sfb},
        {{}, nullptr, nullptr, arr.ptr_d, arr.stride_d},
        sm90::hardware(p.device, sm_count)};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.alpha_ptr = arr.alpha;  // (1 / a_global) / b_global, written by prepare_nvfp4
    args.epilogue.thread.beta = 0.0f;
    args.scheduler.raster_order = sm90::raster_option(p.raster);
    return args;
  }

  static size_t workspace_bytes(const GroupedParams& p, int sm_count) {
    Arrays arr{};
    const auto args = arguments(arr, p, sm_count);
    return arrays_bytes(p.num_groups) + round_up(Gemm::get_workspace_size(args));
  }

  static void run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
};

// Problem s of the list is group visit[s] (GroupedParams::visit), as in prepare_sm90. p.sfa / p.sfb: the
// blocked scales (one run of atoms per group, groups[e].tile_start atom rows in; the weights' expert e at
// e * ceil(N / 128) atom rows).
template <typename G>
__global__ void prepare_nvfp4(const uint8_t* a, const uint8_t* sfa, const uint8_t* b, const uint8_t* sfb,
                              cutlass::bfloat16_t* d, const float* a_global, const float* b_global,
                              const GroupInfo* groups, const int32_t* visit, int E, int64_t N, int64_t K,
                              typename G::Arrays arr) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  // One fp32 factor (1 / g_a) / g_b for the epilogue (the emulation divides the output by each instead): it
  // stays a normal float while amax_a * amax_b >= ~1e-31 (alpha = amax_a amax_b / 2688^2), loses precision
  // below and reaches 0 near 1e-38; the outputs there are as small (docs/ops.md).
  if (s == 0) *arr.alpha = (1.0f / *a_global) / *b_global;
  if (s >= E) return;
  const int e = visit != nullptr ? visit[s] : s;
  const int64_t r0 = groups[e].row_start;
  const int m = groups[e].rows;
  const int64_t atoms_k = (K / 16 + 3) / 4;  // 4 scales (64 elements) per atom column
  const int64_t atom_rows_n = (N + 127) / 128;
  arr.shapes[s] = {m, int(N), int(K)};
  arr.ptr_a[s] = reinterpret_cast<const typename G::ElementCode*>(a + r0 * (K / 2));
  arr.ptr_b[s] = reinterpret_cast<const typename G::ElementCode*>(b + int64_t(e) * N * (K / 2));
  arr.ptr_sfa[s] = reinterpret_cast<const typename G::ElementSF*>(sfa + int64_t(groups[e].tile_start) * atoms_k * 512);
  arr.ptr_sfb[s] = reinterpret_cast<const typename G::ElementSF*>(sfb + int64_t(e) * atom_rows_n * atoms_k * 512);
  arr.ptr_d[s] = d + r0 * N;
  arr.stride_a[s] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, int(K), 1});
  arr.stride_b[s] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(N), int(K), 1});
  arr.stride_d[s] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, int(N), 1});
  arr.layout_sfa[s] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, int(N), int(K), 1));
  arr.layout_sfb[s] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, int(N), int(K), 1));
}

template <int kTileM, int kTileN, int kTileK, typename Name>
void Nvfp4Gemm<kTileM, kTileN, kTileK, Name>::run(const GroupedParams& p, int sm_count, const GroupInfo* groups,
                                                   cudaStream_t stream) {
  using Self = Nvfp4Gemm<kTileM, kTileN, kTileK, Name>;
  const int E = p.num_groups;
  const Arrays arr = carve(p.workspace, E);
  prepare_nvfp4<Self><<<(E + 127) / 128, 128, 0, stream>>>(
      static_cast<const uint8_t*>(p.a), reinterpret_cast<const uint8_t*>(p.sfa), static_cast<const uint8_t*>(p.b),
      reinterpret_cast<const uint8_t*>(p.sfb), static_cast<cutlass::bfloat16_t*>(p.d), p.a_global, p.b_global, groups,
      p.visit, E, p.N, p.K, arr);
  check_launch("grouped_mm prepare_nvfp4");
  sm90::run_gemm<Gemm>(arguments(arr, p, sm_count), arr.cutlass_workspace, stream, "grouped_mm nvfp4 kernel");
}

}  // namespace moe::gemm::sm100

#define MOE_NVFP4_SM100_INSTANCE(NAME, TILE_M, TILE_N, TILE_K)                                          \
  struct NAME##_instance;                                                                               \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count) {                                       \
    return Nvfp4Gemm<TILE_M, TILE_N, TILE_K, NAME##_instance>::workspace_bytes(p, sm_count);            \
  }                                                                                                     \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) { \
    Nvfp4Gemm<TILE_M, TILE_N, TILE_K, NAME##_instance>::run(p, sm_count, groups, stream);               \
  }
