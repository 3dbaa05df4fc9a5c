// CUTLASS 3.x grouped GEMM for sm_90a: TMA loads, WGMMA, warp-specialised persistent kernels with
// the grouped tile scheduler. Problem shapes, pointers and strides are written on the device by
// `prepare_sm90` from the group sizes, so nothing here syncs with the host and a CUDA graph can
// capture it. The instances are instantiated in instances_bf16_fp16.cu.
#pragma once

#include <cutlass/cutlass.h>
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

#include "common/check.h"
#include "gemm/grouped_mm.h"
#include "gemm/sm90/cutlass_common.cuh"

namespace moe::gemm::sm90 {

using namespace cute;

// One instance's configuration (GroupedGemm takes any whose Arch, Tile, Cluster, Kernel and Epilogue name a
// CUTLASS ptr-array schedule pair: Sm100Config in gemm/sm100 is Blackwell's): CTA tile, thread-block cluster (> 1 along M multicasts the weight tile to
// the CTAs of neighbouring row tiles by TMA), and schedule (ping-pong: two consumer warp groups on
// alternate tiles, each tile_m rows; cooperative: both on one tile). Listed in sm90_kernels.cu.
template <int kTileM, int kTileN, int kTileK, int kClusterM, int kClusterN, bool kPingpong>
struct Sm90Config {
  using Arch = cutlass::arch::Sm90;
  using Tile = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using Cluster = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
  using Kernel = cute::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// fwd: A row-major x, B = w[e] (N x K rows: K-major). dgrad: A row-major dout, B = w[e] read N-major.
// wgrad: A = dout_e^T (M-major), B = x_e (N-major). D row-major everywhere; no C operand.
template <GemmOp kOp> struct Layouts;
template <> struct Layouts<GemmOp::kFwd> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <> struct Layouts<GemmOp::kDgrad> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <> struct Layouts<GemmOp::kWgrad> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

template <typename Element, GemmOp kOp, typename Config, typename Name = void>
struct GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using LayoutA = typename Layouts<kOp>::A;
  using LayoutB = typename Layouts<kOp>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      typename Config::Arch, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*,
      kAlign, typename Config::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      typename Config::Arch, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,
      float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;

  using Kernel =
      NamedKernel<cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>, Name>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // Per-group arrays in the workspace, each section 256-byte aligned, then CUTLASS's own workspace.
  struct Arrays {
    Shape3* shapes;
    const Element** ptr_a;
    const Element** ptr_b;
    Element** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    void* cutlass_workspace;
  };

  static size_t arrays_bytes(int E) {
    return round_up(E * sizeof(Shape3)) + 3 * round_up(E * sizeof(void*)) + round_up(E * sizeof(StrideA)) +
           round_up(E * sizeof(StrideB)) + round_up(E * sizeof(StrideD));
  }

  static Arrays carve(void* ws, int E) {
    char* p = static_cast<char*>(ws);
    Arrays a;
    a.shapes = take<Shape3>(p, E);
    a.ptr_a = take<const Element*>(p, E);
    a.ptr_b = take<const Element*>(p, E);
    a.ptr_d = take<Element*>(p, E);
    a.stride_a = take<StrideA>(p, E);
    a.stride_b = take<StrideB>(p, E);
    a.stride_d = take<StrideD>(p, E);
    a.cutlass_workspace = p;
    return a;
  }

  static typename Gemm::Arguments arguments(const Arrays& arr, const GroupedParams& p, int sm_count) {
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {p.num_groups, arr.shapes, nullptr},  // no host copy of the shapes: they only exist on the device
        {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b},
        {{}, nullptr, nullptr, arr.ptr_d, arr.stride_d},
        hardware(p.device, sm_count)};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
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

// The group row ranges come from the portable path's prepare kernel (GroupInfo in the base workspace);
// this kernel turns them into CUTLASS problem shapes, pointers and packed strides. Problem s of the list is
// group visit[s] (GroupedParams::visit: the scheduler visits the problems in list order), group s without it.
template <typename G, typename Element, GemmOp kOp>
__global__ void prepare_sm90(const Element* a, const Element* b, Element* d, const GroupInfo* groups,
                             const int32_t* visit, int E, int64_t N, int64_t K, typename G::Arrays arr) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= E) return;
  const int e = visit != nullptr ? visit[s] : s;
  const int64_t r0 = groups[e].row_start;
  const int m = groups[e].rows;
  if constexpr (kOp == GemmOp::kFwd) {
    arr.shapes[s] = {m, int(N), int(K)};
    arr.ptr_a[s] = a + r0 * K;
    arr.ptr_b[s] = b + int64_t(e) * N * K;
    arr.ptr_d[s] = d + r0 * N;
    arr.stride_a[s] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, int(K), 1});
    arr.stride_b[s] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(N), int(K), 1});
    arr.stride_d[s] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, int(N), 1});
  } else if constexpr (kOp == GemmOp::kDgrad) {
    arr.shapes[s] = {m, int(K), int(N)};
    arr.ptr_a[s] = a + r0 * N;
    arr.ptr_b[s] = b + int64_t(e) * N * K;
    arr.ptr_d[s] = d + r0 * K;
    arr.stride_a[s] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, int(N), 1});
    arr.stride_b[s] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(K), int(N), 1});
    arr.stride_d[s] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, int(K), 1});
  } else {
    // An empty group becomes a 0 x 0 problem (skipped); its zeros are written separately.
    arr.shapes[s] = {m > 0 ? int(N) : 0, m > 0 ? int(K) : 0, m};
    arr.ptr_a[s] = a + r0 * N;
    arr.ptr_b[s] = b + r0 * K;
    arr.ptr_d[s] = d + int64_t(e) * N * K;
    arr.stride_a[s] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {int(N), m, 1});
    arr.stride_b[s] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(K), m, 1});
    arr.stride_d[s] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {int(N), int(K), 1});
  }
}

template <typename Element, GemmOp kOp, typename Config, typename Name>
void GroupedGemm<Element, kOp, Config, Name>::run(const GroupedParams& p, int sm_count, const GroupInfo* groups,
                                            cudaStream_t stream) {
  using Self = GroupedGemm<Element, kOp, Config, Name>;
  const int E = p.num_groups;
  const Arrays arr = carve(p.workspace, E);
  prepare_sm90<Self, Element, kOp><<<(E + 127) / 128, 128, 0, stream>>>(
      static_cast<const Element*>(p.a), static_cast<const Element*>(p.b), static_cast<Element*>(p.d), groups,
      p.visit, E, p.N, p.K, arr);
  check_launch("grouped_mm prepare_sm90");
  run_gemm<Gemm>(arguments(arr, p, sm_count), arr.cutlass_workspace, stream, "grouped_mm sm90 kernel");
}

// One explicit instantiation, with named entry points for the dispatcher and its kernel named for it
// (NamedKernel). The configuration is the variadic tail (its template arguments hold commas).
#define MOE_GROUPED_SM90_INSTANCE(NAME, ELEMENT, OP, ...)                                              \
  struct NAME##_instance;                                                                              \
  size_t NAME##_workspace(const GroupedParams& p, int sm_count) {                                      \
    return GroupedGemm<ELEMENT, OP, __VA_ARGS__, NAME##_instance>::workspace_bytes(p, sm_count);       \
  }                                                                                                    \
  void NAME##_run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream) { \
    GroupedGemm<ELEMENT, OP, __VA_ARGS__, NAME##_instance>::run(p, sm_count, groups, stream);          \
  }

}  // namespace moe::gemm::sm90
