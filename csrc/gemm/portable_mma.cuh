// The portable grouped GEMM on tensor cores: warp-level mma.sync (m16n8k16, bf16 or fp16 in, fp32
// accumulators) and ldmatrix, which every GPU from sm_80 on has (A100, L40, RTX 30/40/50, and H100/B200 where
// their own kernels do not take the problem). Included by grouped_mm.cu, which prepares the groups and
// chooses the path.
//
// One CTA computes a 128x128 tile of one group's output (the same group and tile lookup as the CUDA-core
// portable kernel), 8 warps of 64x32 each, over 32-deep slices of the contraction. Each slice of each
// operand is copied from global to shared memory with cp.async, 16 bytes a copy, 2 to 4 stages deep (the launcher
// fits as many as the SM's shared memory holds for the CTAs it should run), so the next slices are in flight
// while the tensor cores work on this one. A slice lies in shared memory as it lies in global memory: an operand
// whose contraction is contiguous (fwd's x and w, dgrad's dout) as [rows][32], one whose rows are contiguous
// (dgrad's w, wgrad's dout and x) as [32][rows], both padded so that 8 consecutive rows fall on distinct
// banks. ldmatrix reads the fragments (.trans for the second layout), so no operand is ever transposed by
// the threads. One barrier per slice.
//
// Every element outside the group, the operand or the contraction reads as 0; unaligned operands (a base
// pointer off 16 bytes, or a leading dimension off 8 elements) are read element by element, so the kernel
// takes any size and stride the portable kernel takes (fp32 excepted, which stays on the CUDA cores), and the
// same fusions: gathered operand rows and the forward's SwiGLU epilogue (the gather-fused expert MLP).
//
// On the CPU-executed build (CUDA_ON_CPU), mma.sync and ldmatrix are spelled with warp shuffles, the
// instructions' exact data movement; the products are summed in fp32 along k, one rounding
// each (the tensor cores' internal order and rounding differ within fp32's last bits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "activation/swiglu_math.cuh"
#include "common/cp_async.cuh"
#include "common/vec.cuh"
#include "gemm/grouped_mm.h"
#include "gemm/tile_groups.cuh"

namespace moe::gemm::mma {

constexpr int kBM = 128, kBN = 128, kBK = 32, kThreads = 256;
constexpr int kWarpM = 64, kWarpN = 32;                 // 2 x 4 warps
constexpr int kLdK = kBK + 8;                           // [rows][32] slices: 80-byte rows
constexpr int kLdR = kBM + 8;                           // [32][rows] slices: 272-byte rows
constexpr int kSlice = kBM * kLdK > kBK * kLdR ? kBM * kLdK : kBK * kLdR;  // elements per operand slice
static_assert(kBM == kBN, "one slice size serves both operands");

// ---------------------------------------------------------------------------------------------------
// The two instructions, and their shuffle twins.

#if defined(CUDA_ON_CPU)
// Element e (0: the low 16 bits) of a fragment register holding two T, as fp32.
template <typename T>
inline float element(uint32_t v, int e) {
  Pack<T, 2> p;
  std::memcpy(&p, &v, sizeof p);
  return to_float(p.v[e]);
}

// The shuffle twin of mma.sync m16n8k(8 kPer), row.col, fp32 accumulators, kPer elements a 32-bit fragment register
// (2: bf16 or fp16; 4: E4M3), decode(register, e) giving element e as fp32: the instruction's exact data movement,
// the products summed in fp32 along k, one rounding each (the tensor cores' internal order and rounding differ
// within fp32's last bits). Row g's elements sit in lanes 4g..4g+3 (a[0] and a[2] for row g, a[1] and a[3] for
// row g + 8: the first and the second half of k), column n's in lanes 4n..4n+3 (b[0], b[1]).
template <int kPer, typename Decode>
__device__ __forceinline__ void emulated_mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             Decode decode) {
  constexpr int kK = 8 * kPer;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float arow[2][kK], bcol[2][kK];
  for (int q = 0; q < 4; ++q) {
    const uint4 av = __shfl_sync(0xffffffffu, make_uint4(a[0], a[1], a[2], a[3]), 4 * g + q);
    const uint32_t regs[4] = {av.x, av.y, av.z, av.w};
    for (int half = 0; half < 2; ++half) {  // half 0: row g, 1: row g + 8
      for (int e = 0; e < kPer; ++e) {
        arow[half][kPer * q + e] = decode(regs[half], e);
        arow[half][kK / 2 + kPer * q + e] = decode(regs[half + 2], e);
      }
    }
    for (int j = 0; j < 2; ++j) {  // column 2t + j
      const uint2 bv = __shfl_sync(0xffffffffu, make_uint2(b[0], b[1]), 4 * (2 * t + j) + q);
      for (int e = 0; e < kPer; ++e) {
        bcol[j][kPer * q + e] = decode(bv.x, e);
        bcol[j][kK / 2 + kPer * q + e] = decode(bv.y, e);
      }
    }
  }
  for (int i = 0; i < 4; ++i) {
    float s = c[i];
    for (int k = 0; k < kK; ++k) s = __fmaf_rn(arow[i / 2][k], bcol[i % 2][k], s);
    c[i] = s;
  }
}
#endif

// c += A (16x16, row-major fragment a) * B (16x8, column-major fragment b). Fragments, lane l = 4 g + t:
// a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9];
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if !defined(CUDA_ON_CPU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // below sm_80: the path choice never launches this kernel
#elif defined(CUDA_ON_CPU)
  emulated_mma<2>(c, a, b, [](uint32_t v, int e) { return element<T>(v, e); });
#endif
}

// Four 8x8 matrices of 16-bit elements from shared memory; lane 8 j + r gives the address of row r of
// matrix j. Without .trans lane 4 g + t receives, in r[j], matrix j's row g, columns 2t and 2t+1; with it
// (kTrans), matrix j's column g, rows 2t and 2t+1 (the transposed matrix's row g).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if !defined(CUDA_ON_CPU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#elif defined(CUDA_ON_CPU)
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const auto mine = reinterpret_cast<uintptr_t>(row);
  for (int j = 0; j < 4; ++j) {
    if constexpr (kTrans) {
      const auto* r0 = reinterpret_cast<const uint16_t*>(__shfl_sync(0xffffffffu, mine, 8 * j + 2 * t));
      const auto* r1 = reinterpret_cast<const uint16_t*>(__shfl_sync(0xffffffffu, mine, 8 * j + 2 * t + 1));
      r[j] = uint32_t(r0[g]) | (uint32_t(r1[g]) << 16);
    } else {
      const auto* rg = reinterpret_cast<const uint16_t*>(__shfl_sync(0xffffffffu, mine, 8 * j + g));
      r[j] = uint32_t(rg[2 * t]) | (uint32_t(rg[2 * t + 1]) << 16);
    }
  }
#endif
}

// ---------------------------------------------------------------------------------------------------
// Operands: element (i, r) of a group's operand (i its output row or column, r the contraction) at
// base[i * ld + r] (kContig: the contraction contiguous) or base[r * ld + i]; rows i < rows and r < depth.
// The strided index (i where the contraction is contiguous, r where the rows are) names the operand's row in
// memory; the fused kernels (kFused) may map it:
// - gather (the gathered products): the group-ordered row s is row gather[s] of base, and a source row outside
//   [0, sources) reads zeros (GroupedParams::a_rows, b_rows);
// - dual (the SwiGLU forward's w13, N = 2 dual rows): tile row t holds feature 16 (t / 32) + t % 16 of the tile's
//   64, from the gate rows (t % 32 < 16) or the up rows `dual` further, so each warp's 32 columns are 16 gate
//   features and the same 16 up features.

struct Operand {
  const void* base;
  int64_t ld, rows, depth;
  bool vec;  // base 16-byte aligned and ld a whole number of 16-byte vectors (8 bf16, 16 E4M3): cp.async where they fit
  const int32_t* gather = nullptr;
  int64_t sources = 0;
  int64_t dual = 0;
};

// The zero of an operand's element type (bf16, fp16, or uint8_t: E4M3 codes).
template <typename T>
__device__ __forceinline__ T zero_element() {
  if constexpr (std::is_integral_v<T>) {
    return T(0);
  } else {
    return from_float<T>(0.f);
  }
}

// One slice of an operand into shared memory, in the layout the operand has in global memory (see the top of the
// file): each thread's two 16-byte pieces. A piece that is whole inside the operand, of an operand whose 16-byte
// vectors are aligned (`vec`), is copied with cp.async; zeros and the edges (elements one at a time, 0 outside the
// operand) are stored directly. Those loads wait for global memory before the slice's compute; an operand whose
// base and leading dimension are whole vectors has edges only where a size is not a multiple of 8 (16 for E4M3). T: bf16 or fp16, or uint8_t (E4M3 codes, 64 a slice row: the same 64 bytes).
template <typename T, bool kContig, bool kFused>
struct SliceLoader {
  static constexpr int kPer = 16 / int(sizeof(T));  // elements a piece
  static_assert(kContig || sizeof(T) == 2, "1-byte operands have the contraction contiguous");

  __device__ __forceinline__ void issue(const Operand& op, int64_t i0, int64_t r0, uint16_t* slice) const {
    const T* base = static_cast<const T*>(op.base);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c = threadIdx.x + s * kThreads;
      // kContig: row c / 4 of the tile, contraction kPer (c % 4) ..; else contraction row c / 16, rows 8 (c % 16) ..
      int t = c / 4;
      bool up = false;
      if (kFused && kContig && op.dual != 0) {
        up = (t / 16) % 2 != 0;
        t = (t / 32) * 16 + t % 16;
      }
      const int64_t i = kContig ? i0 + t : i0 + (c % 16) * 8;
      const int64_t r = kContig ? r0 + (c % 4) * kPer : r0 + c / 16;
      // Of the piece's kPer elements along the contiguous index, those inside the operand (none: a row outside it).
      const int64_t inside = kContig ? (i < op.rows ? op.depth - r : 0) : (r < op.depth ? op.rows - i : 0);
      int64_t row = kContig ? i : r;
      bool zero = inside <= 0;
      if constexpr (kFused) {
        if (!zero && op.gather != nullptr) {  // read only for rows inside the group
          const int32_t src = op.gather[row];
          zero = src < 0 || src >= op.sources;
          row = src;
        }
        if (up) row += op.dual;
      }
      uint16_t* dst = kContig ? slice + (c / 4) * kLdK + (c % 4) * 8 : slice + (c / 16) * kLdR + (c % 16) * 8;
      if (zero) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        continue;
      }
      const T* at = base + row * op.ld + (kContig ? r : i);  // formed only for a row inside the operand
      if (op.vec && inside >= kPer) {
        cp_async_16(dst, at);
      } else {  // the edges and the unaligned operands: the elements inside the operand one at a time, else 0
        Pack<T, kPer> p;
#pragma unroll
        for (int u = 0; u < kPer; ++u) p.v[u] = u < inside ? at[u] : zero_element<T>();
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&p);
      }
    }
  }
};

// The address this lane gives ldmatrix for the 16x16 block of the slice at tile rows m.., contraction
// k.. (k = 0 or 16): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
// for A's fragment (kRowsFirst), or (rows 0-7, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 0-7),
// (rows 8-15, k 8-15) for two of B's n8 fragments.
template <bool kContig, bool kRowsFirst>
__device__ __forceinline__ const void* fragment_row(const uint16_t* slice_as_b16, int m, int k) {
  const int lane = threadIdx.x % 32, j = lane / 8, rr = lane % 8;
  const int dm = kRowsFirst ? (j % 2) * 8 : (j / 2) * 8;
  const int dk = kRowsFirst ? (j / 2) * 8 : (j % 2) * 8;
  // [rows][k]: lane rr gives row m + dm + rr; [k][rows]: contraction row k + dk + rr (the .trans read).
  return kContig ? slice_as_b16 + (m + dm + rr) * kLdK + k + dk : slice_as_b16 + (k + dk + rr) * kLdR + m + dm;
}

// The four n8 fragments of B for one step of the contraction (k in 16-bit units: 16 bf16 or 32 E4M3 values) of
// the warp's 32 columns from n0: fragments 2 nj and 2 nj + 1 from one ldmatrix each.
template <bool kContig>
__device__ __forceinline__ void b_fragments(uint32_t (&bf)[4][2], const uint16_t* slice, int n0, int k) {
#pragma unroll
  for (int nj = 0; nj < 2; ++nj) {
    uint32_t r[4];
    ldmatrix_x4<!kContig>(r, fragment_row<kContig, false>(slice, n0 + 16 * nj, k));
    bf[2 * nj][0] = r[0];
    bf[2 * nj][1] = r[1];
    bf[2 * nj + 1][0] = r[2];
    bf[2 * nj + 1][1] = r[3];
  }
}

// The shared-memory stages: each holds one slice of A, then one of B (kSlice 16-bit elements each).
constexpr int kStageElems = 2 * kSlice;
constexpr int kStageBytes = kStageElems * 2;
constexpr int kMaxStages = 4;

// The contraction slice by slice through `stages` (2 to kMaxStages) shared-memory stages: the next stages - 1
// slices' copies are in flight (one cp.async commit group a slice) while compute(s, next, a_slice, b_slice) runs on
// slice s. One barrier a slice: after it every thread's copies of slice s have landed (each thread waited for its
// own), and every warp has finished slice s - 1, whose stage the copies issued next (slice s + stages - 1) overwrite.
// `width`: the contraction's elements a slice; `next`: whether slice s + 1 exists.
template <typename LoaderA, typename LoaderB, typename Compute>
__device__ __forceinline__ void slice_pipeline(const LoaderA& la, const LoaderB& lb, const Operand& A,
                                               const Operand& B, int64_t i0, int64_t j0, int64_t depth, int width,
                                               uint16_t* smem, int stages, Compute&& compute) {
  const int64_t slices = (depth + width - 1) / width;
  int write = 0, read = 0;  // the stages the next copies fill and the next compute reads
  const auto issue = [&](int64_t s) {
    if (s < slices) {
      uint16_t* stage = smem + write * kStageElems;
      la.issue(A, i0, s * width, stage);
      lb.issue(B, j0, s * width, stage + kSlice);
    }
    cp_async_commit();  // a group for every slice number, empty past the last, so the wait below counts slices
    write = write + 1 == stages ? 0 : write + 1;
  };
  for (int s = 0; s < stages - 1; ++s) issue(s);
  for (int64_t s = 0; s < slices; ++s) {
    cp_async_wait(stages - 2);  // this thread's copies of slice s have landed
    __syncthreads();
    issue(s + stages - 1);
    const uint16_t* stage = smem + read * kStageElems;
    read = read + 1 == stages ? 0 : read + 1;
    compute(s, s + 1 < slices, stage, stage + kSlice);
  }
}

// Two neighbouring outputs (columns j, j + 1 of a row; `left` columns from j to the row's end): one 4-byte store
// where `vec` says the row allows it (even row length, 4-byte aligned base, j even).
template <typename T>
__device__ __forceinline__ void store_pair(T* out, T v0, T v1, bool vec, int64_t left) {
  if (vec && left >= 2) {
    Pack<T, 2> p;
    p.v[0] = v0;
    p.v[1] = v1;
    *reinterpret_cast<Pack<T, 2>*>(out) = p;
  } else {
    if (left >= 1) out[0] = v0;
    if (left >= 2) out[1] = v1;
  }
}

// The kernel. kOp picks the operands' layouts: fwd (x, w) both contiguous along the contraction; dgrad dout
// contiguous, w along its rows; wgrad dout and x both along their rows. kFused: the gathered products
// (fu.a_rows: the A operand of every product; fu.b_rows: wgrad's x) and, in the forward, the SwiGLU epilogue
// (fu.act non-null: a CTA's 128 columns are 64 features' gate and up columns, and it writes h = [gate | up] and
// act = swiglu(gate, up) * act_weights[row], the CUDA-core kernel's epilogue, from the rounded h).
template <typename T, GemmOp kOp, bool kFused>
__global__ void __launch_bounds__(kThreads, 2)
    mma_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ d, int E, int64_t N, int64_t K,
               const GroupInfo* __restrict__ groups, const int32_t* __restrict__ tiles, bool vec_a, bool vec_b,
               bool vec_d, Fusion fu, int stages) {
  constexpr bool kContigA = kOp != GemmOp::kWgrad;
  constexpr bool kContigB = kOp == GemmOp::kFwd;
  extern __shared__ __align__(16) uint16_t mma_smem[];  // [stage][A, B][kSlice]: stages * kStageBytes
  const int tile = blockIdx.x;
  if (tile >= *tiles) return;
  const int g = group_of_tile(groups, E, tile);
  const GroupInfo info = groups[g];
  // Gathered operands keep their base at row 0 (the gather index adds the source row).
  const int32_t* a_rows = kFused && fu.a_rows != nullptr ? fu.a_rows + info.row_start : nullptr;
  const int32_t* b_rows = kFused && fu.b_rows != nullptr ? fu.b_rows + info.row_start : nullptr;
  const int64_t a_row0 = a_rows != nullptr ? 0 : info.row_start, b_row0 = b_rows != nullptr ? 0 : info.row_start;
  const bool dual = kFused && kOp == GemmOp::kFwd && fu.act != nullptr;
  Operand A, B;
  T* C;
  int64_t Mg, Ng, ldc;
  if constexpr (kOp == GemmOp::kFwd) {  // x[rows of g] [rows, K] @ w[g] [N, K]^T
    Ng = dual ? N / 2 : N;
    A = {a + a_row0 * K, K, info.rows, K, vec_a, a_rows, fu.gather_rows};
    B = {b + int64_t(g) * N * K, K, Ng, K, vec_b, nullptr, 0, dual ? Ng : 0};
    C = d + info.row_start * N; Mg = info.rows; ldc = N;
  } else if constexpr (kOp == GemmOp::kDgrad) {  // dout[rows of g] [rows, N] @ w[g] [N, K]
    A = {a + a_row0 * N, N, info.rows, N, vec_a, a_rows, fu.gather_rows};
    B = {b + int64_t(g) * N * K, K, K, N, vec_b};
    C = d + info.row_start * K; Mg = info.rows; Ng = K; ldc = K;
  } else {  // dout[rows of g]^T [N, rows] @ x[rows of g] [rows, K]
    A = {a + a_row0 * N, N, N, info.rows, vec_a, a_rows, fu.gather_rows};
    B = {b + b_row0 * K, K, K, info.rows, vec_b, b_rows, fu.gather_rows};
    C = d + int64_t(g) * N * K; Mg = N; Ng = K; ldc = K;
  }
  const int64_t i0 = int64_t(tile - info.tile_start) * kBM, j0 = int64_t(blockIdx.y) * (dual ? kBN / 2 : kBN);
  if (j0 >= Ng) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp % 2) * kWarpM, wn = (warp / 2) * kWarpN;

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;

  const SliceLoader<T, kContigA, kFused> la;
  const SliceLoader<T, kContigB, kFused> lb;
  slice_pipeline(la, lb, A, B, i0, j0, A.depth, kBK, mma_smem, stages, [&](int64_t, bool, const uint16_t* sa,
                                                                          const uint16_t* sb) {
#pragma unroll
    for (int k = 0; k < kBK; k += 16) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) ldmatrix_x4<!kContigA>(af[mi], fragment_row<kContigA, true>(sa, wm + 16 * mi, k));
      b_fragments<kContigB>(bf, sb, wn, k);
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_16816<T>(acc[mi][ni], af[mi], bf[ni]);
    }
  });

  // Epilogue: c[0], c[1] at row g, columns 2t, 2t+1 of each m16n8 block; c[2], c[3] at row g + 8. With the
  // SwiGLU epilogue, fragments ni (gate) and ni + 2 (up) hold the same features, 16 (warp / 2) + 8 ni + tc ..
  const int gr = lane / 4, tc = 2 * (lane % 4);
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t i = i0 + wm + 16 * mi + gr + 8 * half;
      if (i >= Mg) continue;
      if (dual) {
        T* act = static_cast<T*>(fu.act);
        const int64_t row = info.row_start + i;
        const float w = fu.act_weights != nullptr ? fu.act_weights[row] : 1.f;
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
          const int64_t j = j0 + (warp / 2) * 16 + 8 * ni + tc;
          T gate[2], up[2], out[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            gate[e] = from_float<T>(acc[mi][ni][2 * half + e]);
            up[e] = from_float<T>(acc[mi][ni + 2][2 * half + e]);
            out[e] = from_float<T>(activation::swiglu_value(to_float(gate[e]), to_float(up[e]), w));
          }
          store_pair(C + i * ldc + j, gate[0], gate[1], vec_d, Ng - j);
          store_pair(C + i * ldc + Ng + j, up[0], up[1], vec_d, Ng - j);
          store_pair(act + row * Ng + j, out[0], out[1], vec_d, Ng - j);
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int64_t j = j0 + wn + 8 * ni + tc;
          store_pair(C + i * ldc + j, from_float<T>(acc[mi][ni][2 * half]), from_float<T>(acc[mi][ni][2 * half + 1]),
                     vec_d, Ng - j);
        }
      }
    }
}

}  // namespace moe::gemm::mma
