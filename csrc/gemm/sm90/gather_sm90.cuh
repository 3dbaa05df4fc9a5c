// Gathered grouped GEMMs for sm_90a: the gather-fused expert MLP's products (ops/expert_mlp.py) on WGMMA.
//
// The operands whose rows come from a row table (GroupedParams::a_rows / b_rows: the tokens of each permuted
// row) cannot be loaded by TMA, which moves boxes of a strided tensor. Here a producer warp group loads every
// operand tile with cp.async, 16 bytes per copy, each copy's source row looked up in the table (an index
// outside [0, gather_rows) fills zeros, so padding rows read nothing), into the swizzled shared-memory layout
// that CUTLASS's cp.async WGMMA mainloop (MainloopSm90CpAsyncGmmaWarpSpecialized) reads; two consumer warp
// groups run that mainloop's MMAs on a 128 x 128 x 64 tile, then write the fp32 accumulators, rounded once,
// straight from registers. One CTA per output tile (not persistent).
//
// Products (GroupedParams' semantics, gemm/grouped_mm.h), the gathered dimension in brackets:
//   fwd    h = x[rows] @ w[e]^T              A K-major [M]; with the SwiGLU epilogue (act set), B's 128 rows of a
//          tile are 64 gate rows and the 64 up rows of the same features, so each thread holds a feature's gate
//          and up accumulators and writes h's two columns and act = silu(gate) * up * weight (swiglu_math.cuh)
//   dgrad  d = dout[rows] @ w[e]             A K-major [M], B = w read N-major
//   wgrad  d[e] = dout[rows]^T @ x[rows]     A and B M/N-major, both gathered along K (the group's rows)
// The same values as the portable kernel's up to the order of the fp32 sums (WGMMA's), the same roundings.
// The handoff from the cp.async writes to WGMMA's reads is CUTLASS's cp.async mainloop's own (an mbarrier that
// cp.async arrives on, no proxy fence), as in its cp.async cooperative kernel.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include <cutlass/cutlass.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cute/tensor.hpp>

#include "activation/swiglu_math.cuh"
#include "common/check.h"
#include "gemm/grouped_mm.h"
#include "gemm/tile_groups.cuh"

namespace moe::gemm::sm90 {

using namespace cute;

template <GemmOp kOp> struct GatherLayouts;
template <> struct GatherLayouts<GemmOp::kFwd> {
  using A = cutlass::layout::RowMajor;     // x rows: K contiguous
  using B = cutlass::layout::ColumnMajor;  // w[e] rows: K contiguous
};
template <> struct GatherLayouts<GemmOp::kDgrad> {
  using A = cutlass::layout::RowMajor;  // dout rows: K (= N of the product) contiguous
  using B = cutlass::layout::RowMajor;  // w[e] read along its N: the output's columns contiguous
};
template <> struct GatherLayouts<GemmOp::kWgrad> {
  using A = cutlass::layout::ColumnMajor;  // dout rows are K here: M contiguous
  using B = cutlass::layout::RowMajor;     // x rows are K: N contiguous
};

// What a CTA's tile reads and writes, resolved from the group it falls in.
struct GatherTile {
  int group;
  int64_t row_start;  // the group's first row
  int64_t m0, n0;     // the tile's first output row and column (within the group's product)
  int64_t Mg, Ng, Kg;  // the group's product extents
};

template <typename Element, GemmOp kOp>
struct GatherGemm {
  static constexpr int kTileM = 128, kTileN = 128, kTileK = 64;
  static constexpr int kChunk = 8;  // elements per 16-byte cp.async
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  using Tile = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename GatherLayouts<kOp>::A, kChunk, Element,
      typename GatherLayouts<kOp>::B, kChunk, float, Tile, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCountAuto, cutlass::gemm::KernelCpAsyncWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using SmemLayoutA = typename Mainloop::SmemLayoutA;  // (BLK_M, BLK_K, PIPE)
  using SmemLayoutB = typename Mainloop::SmemLayoutB;  // (BLK_N, BLK_K, PIPE)
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  static constexpr int kStages = size<2>(SmemLayoutA{});
  static_assert(size(TiledMma{}) == kConsumerThreads, "two consumer warp groups");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage);

  struct Params {
    const Element* a;
    const Element* b;
    Element* d;
    const GroupInfo* groups;
    const int32_t* tiles;  // row-tiles of kTileM in use (fwd, dgrad)
    int E;
    int64_t M, N, K;
    const int32_t* a_rows;
    const int32_t* b_rows;
    int64_t gather_rows;
    Element* act;  // fwd: the SwiGLU epilogue's output [M, N / 2], or null
    const float* act_weights;
    const int32_t* visit;  // wgrad: blockIdx.z's group (GroupedParams::visit: largest first), or null
  };
};

// The source row of a tile row: `rows` looked up (the gather) or the row itself; -1 when outside the source.
__device__ __forceinline__ int64_t source_row(const int32_t* rows, int64_t n_rows, int64_t row) {
  if (rows == nullptr) return row;
  const int32_t r = rows[row];
  return r >= 0 && r < n_rows ? int64_t(r) : -1;
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

// The producer's view of one operand. K-major: storage row = the tile's M/N index (from row_of), K contiguous.
// MN-major: storage row = the K index (from row_of), the M/N index contiguous.
struct OperandView {
  const void* base;
  int64_t ld;          // elements between storage rows
  int64_t extent_i;    // valid M/N indices of the tile: [0, extent_i) (relative to the tile)
  int64_t extent_k;    // valid K indices: [0, Kg)
  const int32_t* rows; // the row table of the storage rows, or null
  int64_t n_rows;      // rows of the source (gathered) or unused
  int64_t row0;        // the storage row of tile index 0 (added before the lookup)
  int64_t col0;        // the first column of the tile along the contiguous dimension (MN-major)
  int64_t interleave;  // fwd SwiGLU: tile rows [64, 128) are the storage rows row0 + interleave + (i - 64) (the up
                       // half, interleave = F); 0: none
};

// Loads the tile (I x kTileK) at K offset k0 of `op` into the stage. Each of the 128 producer threads issues 8
// copies of 16 bytes: K-major, thread t copies chunk t % 8 of rows t / 8 + 16 j; MN-major, chunk t % 16 of the
// K indices t / 16 + 8 j. Rows past the extents, and source rows outside the table, are zero-filled.
template <bool kKMajor, typename Element, int kI, int kK, typename SmemTensor>
__device__ __forceinline__ void load_operand(const OperandView& op, SmemTensor&& s, int64_t k0, int t) {
  constexpr int kChunk = 8;
  const Element* base = static_cast<const Element*>(op.base);
  if constexpr (kKMajor) {
    constexpr int kChunksPerRow = kK / kChunk;           // 8
    constexpr int kRowsPerPass = 128 / kChunksPerRow;     // 16
    const int kc = t % kChunksPerRow;
    const int64_t k = k0 + kc * kChunk;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kI / kRowsPerPass; ++j) {
      const int i = t / kChunksPerRow + kRowsPerPass * j;
      int64_t row = -1;
      if (i < op.extent_i) {
        const int64_t tile_row = op.interleave && i >= kI / 2 ? op.row0 + op.interleave + (i - kI / 2) : op.row0 + i;
        row = source_row(op.rows, op.n_rows, tile_row);
      }
      const bool valid = row >= 0 && k < op.extent_k;
      const Element* src = valid ? base + row * op.ld + k : base;
      cp_async_16(&s(i, kc * kChunk), src, valid);
    }
  } else {
    constexpr int kChunksPerRow = kI / kChunk;           // 16
    constexpr int kRowsPerPass = 128 / kChunksPerRow;     // 8
    const int ic = t % kChunksPerRow;
    const bool in_i = ic * kChunk < op.extent_i;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kK / kRowsPerPass; ++j) {
      const int kk = t / kChunksPerRow + kRowsPerPass * j;
      const int64_t k = k0 + kk;
      const int64_t row = in_i && k < op.extent_k ? source_row(op.rows, op.n_rows, op.row0 + k) : -1;
      const bool valid = row >= 0;
      const Element* src = valid ? base + row * op.ld + op.col0 + ic * kChunk : base;
      cp_async_16(&s(ic * kChunk, kk), src, valid);
    }
  }
}

template <typename Element, GemmOp kOp>
__device__ __forceinline__ bool resolve_tile(const typename GatherGemm<Element, kOp>::Params& p, GatherTile& t) {
  using G = GatherGemm<Element, kOp>;
  if constexpr (kOp == GemmOp::kWgrad) {
    // The hardware starts blocks in linear order (x, y, then z), so the largest groups' tiles go first.
    const int g = p.visit != nullptr ? p.visit[blockIdx.z] : int(blockIdx.z);
    const GroupInfo info = p.groups[g];
    if (info.rows <= 0) return false;  // an empty group: zero_uncovered writes its zeros
    t = {g, info.row_start, int64_t(blockIdx.x) * G::kTileM, int64_t(blockIdx.y) * G::kTileN, p.N, p.K, info.rows};
    return t.m0 < t.Mg && t.n0 < t.Ng;
  } else {
    const int tile = blockIdx.x;
    if (tile >= *p.tiles) return false;
    const int lo = group_of_tile(p.groups, p.E, tile);
    const GroupInfo info = p.groups[lo];
    const int64_t Ng = kOp == GemmOp::kFwd ? p.N : p.K;
    const int64_t Kg = kOp == GemmOp::kFwd ? p.K : p.N;
    t = {lo, info.row_start, int64_t(tile - info.tile_start) * G::kTileM, int64_t(blockIdx.y) * G::kTileN,
         info.rows, Ng, Kg};
    // With the SwiGLU epilogue a tile covers 64 features: blockIdx.y's gate and up halves.
    if (kOp == GemmOp::kFwd && p.act != nullptr) t.n0 = int64_t(blockIdx.y) * (G::kTileN / 2);
    return t.m0 < t.Mg && (p.act != nullptr ? t.n0 < t.Ng / 2 : t.n0 < t.Ng);
  }
}

template <typename Element, GemmOp kOp>
__global__ void __launch_bounds__(GatherGemm<Element, kOp>::kThreads, 1)
    gather_gemm_kernel(const typename GatherGemm<Element, kOp>::Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using G = GatherGemm<Element, kOp>;
  using Mainloop = typename G::Mainloop;
  constexpr int kTileM = G::kTileM, kTileN = G::kTileN, kTileK = G::kTileK;
  // The swizzled tiles and WGMMA's descriptors assume a 1024-byte aligned base (no static shared memory here).
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename G::SharedStorage*>(smem_raw);

  GatherTile tile;
  if (!resolve_tile<Element, kOp>(p, tile)) return;  // the whole CTA leaves before any barrier
  const bool swiglu = kOp == GemmOp::kFwd && p.act != nullptr;

  const int thread = threadIdx.x;
  const bool producer = thread < G::kProducerThreads;
  typename G::Pipeline::Params pp;
  pp.role = producer ? G::Pipeline::ThreadCategory::Producer : G::Pipeline::ThreadCategory::Consumer;
  pp.producer_arv_count = G::kProducerThreads;
  pp.consumer_arv_count = G::kConsumerThreads;
  typename G::Pipeline pipeline(shared.pipeline, pp);
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // the barriers initialised before anyone waits on them

  const int k_tiles = int((tile.Kg + kTileK - 1) / kTileK);

  if (producer) {
    // The operands as the producer reads them (module comment).
    OperandView a{}, b{};
    if constexpr (kOp == GemmOp::kFwd) {
      a = {p.a, p.K, tile.Mg - tile.m0, tile.Kg, p.a_rows, p.gather_rows, tile.row_start + tile.m0, 0, 0};
      const Element* w = p.b + int64_t(tile.group) * p.N * p.K;
      // With the SwiGLU epilogue every row of the tile is in range: N / 2 % 64 == 0 (the dispatch).
      b = {w, p.K, swiglu ? int64_t(kTileN) : tile.Ng - tile.n0, tile.Kg, nullptr, 0, tile.n0, 0, swiglu ? p.N / 2 : 0};
    } else if constexpr (kOp == GemmOp::kDgrad) {
      a = {p.a, p.N, tile.Mg - tile.m0, tile.Kg, p.a_rows, p.gather_rows, tile.row_start + tile.m0, 0, 0};
      const Element* w = p.b + int64_t(tile.group) * p.N * p.K;  // [N, K]: rows are the reduction index
      b = {w, p.K, tile.Ng - tile.n0, tile.Kg, nullptr, 0, 0, tile.n0, 0};
    } else {
      a = {p.a, p.N, tile.Mg - tile.m0, tile.Kg, p.a_rows, p.gather_rows, tile.row_start, tile.m0, 0};
      b = {p.b, p.K, tile.Ng - tile.n0, tile.Kg, p.b_rows, p.gather_rows, tile.row_start, tile.n0, 0};
    }
    Tensor sA = make_tensor(make_smem_ptr(shared.tensors.smem_A.data()), typename G::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.data()), typename G::SmemLayoutB{});
    constexpr bool kAK = kOp != GemmOp::kWgrad;  // A K-major except in wgrad
    constexpr bool kBK = kOp == GemmOp::kFwd;    // B K-major only in fwd
    auto state = cutlass::make_producer_start_state<typename G::Pipeline>();
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipeline.producer_acquire(state);
      const int stage = state.index();
      load_operand<kAK, Element, kTileM, kTileK>(a, sA(_, _, stage), int64_t(kt) * kTileK, thread);
      load_operand<kBK, Element, kTileN, kTileK>(b, sB(_, _, stage), int64_t(kt) * kTileK, thread);
      pipeline.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
      ++state;
    }
    pipeline.producer_tail(state);
    return;
  }

  const int ct = thread - G::kProducerThreads;  // consumer thread index
  typename G::TiledMma mma;
  Tensor accum = partition_fragment_C(mma, take<0, 2>(typename G::Tile{}));  // (MMA, MMA_M, MMA_N)
  Mainloop mainloop;
  typename Mainloop::Params unused{};
  typename G::PipelineState read{};
  mainloop.mma(pipeline, read, accum, k_tiles, ct, shared.tensors, unused);
  mainloop.mma_tail(pipeline, read, k_tiles);

  // Each accumulator's (row, column) in the tile.
  Tensor coord = mma.get_thread_slice(ct).partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
  static_assert(decltype(size(accum))::value == decltype(size(coord))::value);
  if (swiglu) {
    // WGMMA's accumulator layout: a thread's values come in 8-column groups, the second half of its values the
    // columns 64 further: a feature's gate accumulator pairs with its up accumulator half the fragment later.
    constexpr int kHalf = decltype(size(accum))::value / 2;
    const int64_t F = p.N / 2;
    Element* h = p.d;
    Element* act = p.act;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kHalf; ++v) {
      const int m = get<0>(coord(v)), c = get<1>(coord(v));
      if (get<1>(coord(v + kHalf)) != c + kTileN / 2 || get<0>(coord(v + kHalf)) != m) __trap();  // layout check
      const int64_t i = tile.m0 + m, j = tile.n0 + c;
      if (i < tile.Mg && j < F) {
        const int64_t row = tile.row_start + i;
        const Element gate(accum(v)), up(accum(v + kHalf));  // rounded to nearest even, as the portable kernel
        h[row * p.N + j] = gate;
        h[row * p.N + F + j] = up;
        const float w = p.act_weights != nullptr ? p.act_weights[row] : 1.f;
        act[row * F + j] = Element(activation::swiglu_value(float(gate), float(up), w));
      }
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < size(accum); ++v) {
      const int64_t i = tile.m0 + get<0>(coord(v)), j = tile.n0 + get<1>(coord(v));
      if (i < tile.Mg && j < tile.Ng) {
        const int64_t at = kOp == GemmOp::kWgrad ? (int64_t(tile.group) * p.N + i) * p.K + j
                                                 : (tile.row_start + i) * tile.Ng + j;
        p.d[at] = Element(accum(v));
      }
    }
  }
#endif
}

template <typename Element, GemmOp kOp>
void gather_gemm_run(const GroupedParams& p, const GroupInfo* groups, const int32_t* tiles, int64_t row_tiles,
                     cudaStream_t stream) {
  using G = GatherGemm<Element, kOp>;
  typename G::Params q{static_cast<const Element*>(p.a), static_cast<const Element*>(p.b), static_cast<Element*>(p.d),
                       groups, tiles, p.num_groups, p.M, p.N, p.K, p.a_rows, p.b_rows, p.gather_rows,
                       static_cast<Element*>(p.act), p.act_weights, p.visit};
  dim3 grid;
  if constexpr (kOp == GemmOp::kWgrad) {
    grid = dim3(unsigned((p.N + G::kTileM - 1) / G::kTileM), unsigned((p.K + G::kTileN - 1) / G::kTileN),
                unsigned(p.num_groups));
  } else {
    const int64_t cols = kOp == GemmOp::kFwd ? (p.act != nullptr ? p.N / 2 : p.N) : p.K;
    const int64_t per_tile = kOp == GemmOp::kFwd && p.act != nullptr ? G::kTileN / 2 : G::kTileN;
    grid = dim3(unsigned(row_tiles), unsigned((cols + per_tile - 1) / per_tile));
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  auto* kernel = gather_gemm_kernel<Element, kOp>;
  static std::atomic<bool> smem_set[64] = {};  // the attribute is per device: set once each
  int device = 0;
  check_cuda(cudaGetDevice(&device), "grouped_mm gather");
  if (!smem_set[device & 63].load(std::memory_order_acquire)) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(G::kSmemBytes)),
               "grouped_mm gather: shared memory");
    smem_set[device & 63].store(true, std::memory_order_release);
  }
  kernel<<<grid, G::kThreads, G::kSmemBytes, stream>>>(q);
  check_launch("grouped_mm gather_gemm_kernel");
}

// One instantiation (each is a CUTLASS mainloop; instances_gather.cu): a named entry point for the dispatcher.
#define MOE_GATHER_SM90_INSTANCE(NAME, ELEMENT, OP)                                                            \
  void NAME##_run(const GroupedParams& p, const GroupInfo* groups, const int32_t* tiles, int64_t row_tiles,   \
                  cudaStream_t stream) {                                                                        \
    gather_gemm_run<ELEMENT, OP>(p, groups, tiles, row_tiles, stream);                                          \
  }

}  // namespace moe::gemm::sm90
