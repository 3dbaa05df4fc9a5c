// FP8 grouped GEMMs with blockwise scaling for sm_90a (the DeepSeek-V3 recipe), on CUTLASS's FP8
// blockwise ptr-array kernel: TMA + WGMMA on K-major E4M3 operands, warp-specialised cooperative,
// grouped tile scheduler, fp32 accumulators promoted and scaled every 128 of the contraction.
//
// fwd (groups split the rows): E4M3 activations with one fp32 dequantization scale per 1x128 block
// along K, E4M3 weights with one per 128x128 tile, bf16 output.
//   d[rows of e] = sum_kb (a[rows, kb] @ b[e][:, kb]^T) * sfa[rows, kb] * sfb[e][n / 128, kb]
//   Both scale tensors K-major: sfa [M, K / 128] (a group's rows are one contiguous slice) and
//   sfb [E, ceil(N / 128), K / 128].
//
// wgrad (groups split the contraction, the tokens): a = dout^T codes [N, M] and b = x^T codes [K, M],
// both quantized along the tokens in 1x128 blocks, output d [E, N, K] in fp32 or bf16 (the weight's
// dtype: the epilogue rounds the fp32 accumulators once, as a cast of the fp32 result would).
//   d[e] = sum over the token blocks tb of group e: (a[:, tb] @ b[:, tb]^T) * sfa[tb, n] * sfb[tb, k]
//   Scales token-block-major: sfa [ceil(M / 128), N], sfb [ceil(M / 128), K], so a group's blocks are
//   one contiguous slice in the packed layout CUTLASS rebuilds from each group's problem shape. Every
//   group's first row and size must be multiples of 128 (a block never straddles two experts); a group
//   that is not is skipped here and filled with NaN by the caller (grouped_mm.cu), never misread.
//
// Shapes, pointers and scale layouts per group are written on the device from the group sizes (no
// host sync), like the bf16 kernels.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <cute/tensor.hpp>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "gemm/grouped_mm.h"
#include "gemm/sm90/cutlass_common.cuh"

namespace moe::gemm::sm90 {

using namespace cute;

// Per-product choices: scale granularity and major mode.
template <GemmOp kOp> struct Fp8Traits;
template <> struct Fp8Traits<GemmOp::kFwd> {
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
};
template <> struct Fp8Traits<GemmOp::kWgrad> {
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
};

constexpr int kFp8Block = 128;

// The architecture, tile and schedules: sm_90a's cooperative FP8 blockwise kernel on 128x128x128 tiles (the
// two consumer warpgroups split a tile's rows), kClusterM > 1 making the CTAs of neighbouring row tiles share
// each weight tile (and its scales) by TMA multicast. (gemm/sm100 has Blackwell's: the scale layouts are the
// same Sm1xx configuration.)
template <int kClusterM>
struct Sm90Fp8Schedule {
  using Arch = cutlass::arch::Sm90;
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<Int<kClusterM>, _1, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Ping-pong: each consumer warpgroup owns a whole 64x128 tile and the two take turns, so one warpgroup's
// epilogue (an fp32 wgrad tile is 32 KB written, and read too where it accumulates) runs while the other's
// mainloop issues its MMAs. The cooperative kernel leaves the tensor cores idle during every epilogue, which
// costs most where a tile's contraction is short: wgrad over the few hundred tokens an expert gets at 128
// experts. A warpgroup holds its 64x128 fp32 accumulators twice (the running sum and the block being
// promoted, 128 registers a thread), so a 128-row tile per warpgroup does not fit (256 > the 232 a
// consumer gets). The tile's k-blocks, their MMA instructions (m64n128k32) and the promotion per element
// are the cooperative kernel's: the same bits.
struct Sm90Fp8PingpongSchedule {
  using Arch = cutlass::arch::Sm90;
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// ElementOut: bf16 for the forward; fp32 or bf16 for wgrad.
template <GemmOp kOp, typename ElementOut, typename Schedule = Sm90Fp8Schedule<1>, typename Name = void>
struct Fp8BlockwiseGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = ElementOut;
  // The fp32 wgrad reads its output too where it accumulates (GroupedParams::accumulate: beta 1, C = D, an
  // fp32 main gradient); with beta 0 the epilogue never loads C. The other products have no source.
  static constexpr bool kSource = kOp == GemmOp::kWgrad && std::is_same_v<ElementOut, float>;
  using ElementC = std::conditional_t<kSource, float, void>;
  // Both operands K-major (FP8 WGMMA needs it): fwd a = x [M, K], b = w[e] [N, K]; wgrad a = dout^T
  // [N, M], b = x^T [K, M] (the contraction runs along the tokens).
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Tile = typename Schedule::Tile;
  using Cluster = typename Schedule::Cluster;
  using ScaleConfig = typename Fp8Traits<kOp>::ScaleConfig;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      typename Schedule::Arch, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      typename Schedule::Arch, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel =
      NamedKernel<cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>, Name>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(!kSource || std::is_same_v<typename Kernel::InternalStrideC, StrideD>, "C is read where D is written");
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  struct Arrays {
    Shape3* shapes;
    const ElementAB** ptr_a;
    const ElementAB** ptr_b;
    const float** ptr_sfa;
    const float** ptr_sfb;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    void* cutlass_workspace;
  };

  static size_t arrays_bytes(int E) {
    return round_up(E * sizeof(Shape3)) + 5 * round_up(E * sizeof(void*)) + round_up(E * sizeof(StrideA)) +
           round_up(E * sizeof(StrideB)) + round_up(E * sizeof(StrideD)) + round_up(E * sizeof(LayoutSFA)) +
           round_up(E * sizeof(LayoutSFB));
  }

  static Arrays carve(void* ws, int E) {
    char* p = static_cast<char*>(ws);
    Arrays a;
    a.shapes = take<Shape3>(p, E);
    a.ptr_a = take<const ElementAB*>(p, E);
    a.ptr_b = take<const ElementAB*>(p, E);
    a.ptr_sfa = take<const float*>(p, E);
    a.ptr_sfb = take<const float*>(p, E);
    a.ptr_d = take<ElementD*>(p, E);
    a.stride_a = take<StrideA>(p, E);
    a.stride_b = take<StrideB>(p, E);
    a.stride_d = take<StrideD>(p, E);
    a.layout_sfa = take<LayoutSFA>(p, E);
    a.layout_sfb = take<LayoutSFB>(p, E);
    a.cutlass_workspace = p;
    return a;
  }

  static typename Gemm::Arguments arguments(const Arrays& arr, const GroupedParams& p, int sm_count) {
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {p.num_groups, arr.shapes, nullptr},
        {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b, arr.ptr_sfa, arr.layout_sfa, arr.ptr_sfb, arr.layout_sfb},
        {{}, nullptr, nullptr, arr.ptr_d, arr.stride_d},
        hardware(p.device, sm_count)};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    if constexpr (kSource) {
      if (p.accumulate) {  // d += the product, in place: C is D, tile by tile
        args.epilogue.ptr_C = const_cast<const float**>(arr.ptr_d);
        args.epilogue.dC = arr.stride_d;
        args.epilogue.thread.beta = 1.0f;
      }
    }
    args.scheduler.raster_order = raster_option(p.raster);
    return args;
  }

  static size_t workspace_bytes(const GroupedParams& p, int sm_count) {
    Arrays arr{};
    const auto args = arguments(arr, p, sm_count);
    return arrays_bytes(p.num_groups) + round_up(Gemm::get_workspace_size(args));
  }

  static void run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
};

template <GemmOp kOp, typename G>
__global__ void prepare_fp8_blockwise(const cutlass::float_e4m3_t* a, const float* sfa, const cutlass::float_e4m3_t* b,
                                      const float* sfb, typename G::ElementD* d, const GroupInfo* groups,
                                      const int32_t* visit, int E, int64_t M, int64_t N, int64_t K,
                                      typename G::Arrays arr) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;  // problem s of the list: group visit[s] (prepare_sm90)
  if (s >= E) return;
  const int e = visit != nullptr ? visit[s] : s;
  const int64_t r0 = groups[e].row_start;
  const int m = groups[e].rows;
  if constexpr (kOp == GemmOp::kWgrad) {
    // Group e: [N, m] @ [m, K]. An empty or misaligned group becomes a 0 x 0 problem (skipped).
    const bool run = m > 0 && r0 % kFp8Block == 0 && m % kFp8Block == 0;
    const int mm = run ? m : 0;
    arr.shapes[s] = {run ? int(N) : 0, run ? int(K) : 0, mm};
    arr.ptr_a[s] = a + r0;
    arr.ptr_b[s] = b + r0;
    arr.ptr_sfa[s] = sfa + (r0 / kFp8Block) * N;
    arr.ptr_sfb[s] = sfb + (r0 / kFp8Block) * K;
    arr.ptr_d[s] = d + int64_t(e) * N * K;
    // Rows of a and b hold all M tokens: the leading dimension is M, not the group's size.
    auto sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, {int(N), mm, 1});
    auto sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(K), mm, 1});
    cute::get<0>(sa) = M;
    cute::get<0>(sb) = M;
    arr.stride_a[s] = sa;
    arr.stride_b[s] = sb;
    arr.stride_d[s] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {int(N), int(K), 1});
    arr.layout_sfa[s] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(int(N), int(K), mm, 1));
    arr.layout_sfb[s] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(int(N), int(K), mm, 1));
    return;
  }
  const int64_t kb = K / 128, nb = (N + 127) / 128;
  arr.shapes[s] = {m, int(N), int(K)};
  arr.ptr_a[s] = a + r0 * K;
  arr.ptr_b[s] = b + int64_t(e) * N * K;
  arr.ptr_sfa[s] = sfa + r0 * kb;
  arr.ptr_sfb[s] = sfb + int64_t(e) * nb * kb;
  arr.ptr_d[s] = d + r0 * N;
  arr.stride_a[s] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, int(K), 1});
  arr.stride_b[s] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(N), int(K), 1});
  arr.stride_d[s] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, int(N), 1});
  // In grouped mode CUTLASS rebuilds these layouts from the device problem shapes; they are written
  // anyway so the arguments stay self-consistent.
  arr.layout_sfa[s] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, int(N), int(K), 1));
  arr.layout_sfb[s] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, int(N), int(K), 1));
}

template <GemmOp kOp, typename ElementOut, typename Schedule, typename Name>
void Fp8BlockwiseGemm<kOp, ElementOut, Schedule, Name>::run(const GroupedParams& p, int sm_count,
                                                             const GroupInfo* groups, cudaStream_t stream) {
  const int E = p.num_groups;
  const Arrays arr = carve(p.workspace, E);
  prepare_fp8_blockwise<kOp, Fp8BlockwiseGemm><<<(E + 127) / 128, 128, 0, stream>>>(
      static_cast<const ElementAB*>(p.a), p.sfa, static_cast<const ElementAB*>(p.b), p.sfb,
      static_cast<ElementD*>(p.d), groups, p.visit, E, p.M, p.N, p.K, arr);
  check_launch("grouped_mm prepare_fp8_blockwise");
  run_gemm<Gemm>(arguments(arr, p, sm_count), arr.cutlass_workspace, stream, "grouped_mm fp8 blockwise kernel");
}

// One explicit instantiation, with named entry points for the dispatcher and its kernel named for it (NamedKernel).
#define MOE_FP8_BLOCKWISE_SCHEDULE_INSTANCE(NAME, OP, ELEMENT_OUT, SCHEDULE)                           \
  struct NAME##_instance;                                                                              \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count) {                                      \
    return Fp8BlockwiseGemm<OP, ELEMENT_OUT, SCHEDULE, NAME##_instance>::workspace_bytes(p, sm_count); \
  }                                                                                                    \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) { \
    Fp8BlockwiseGemm<OP, ELEMENT_OUT, SCHEDULE, NAME##_instance>::run(p, sm_count, groups, stream);    \
  }
#define MOE_FP8_BLOCKWISE_INSTANCE(NAME, OP, ELEMENT_OUT, CLUSTER_M) \
  MOE_FP8_BLOCKWISE_SCHEDULE_INSTANCE(NAME, OP, ELEMENT_OUT, Sm90Fp8Schedule<CLUSTER_M>)
#define MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE(NAME, OP, ELEMENT_OUT) \
  MOE_FP8_BLOCKWISE_SCHEDULE_INSTANCE(NAME, OP, ELEMENT_OUT, Sm90Fp8PingpongSchedule)

}  // namespace moe::gemm::sm90
