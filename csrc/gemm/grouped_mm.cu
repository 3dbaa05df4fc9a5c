// Grouped GEMM dispatch and the portable kernel.
//
// Path choice (documented in docs/ops.md): the CUTLASS sm_90a kernels run for bf16/fp16 on compute
// capability 9.0 when TMA's alignment holds (N and K multiples of 8, 16-byte aligned base pointers).
// Among them, the instance and raster order come from the tuning table by shape (sm90_kernels.h). Everything
// else (fp32, other GPUs, misaligned shapes) runs the portable tiled kernel: 64x64 tiles, fp32
// accumulation in a fixed order, any strides. FP8 (E4M3 with blockwise scales) runs only the sm_90a
// blockwise kernels: forward when K % 128 == 0 and N % 8 == 0 (bf16 output rows 16-byte aligned), wgrad
// when M % 16 == 0 (TMA's 16-byte row stride over the tokens) and K % 4 == 0 (fp32 output rows); on 8.9 and later
// without them, the tensor-core portable FP8 kernel (gemm/portable_mma_fp8.cuh) where opted in
// (MOE_KERNELS_PORTABLE_MMA=1); the Python layer falls back to dequantize + fp32 elsewhere. Gathered rows and the
// SwiGLU epilogue (expert_mlp) run the sm_90a gather kernels (gemm/sm90/gather_sm90.cuh) where opted in
// (MOE_KERNELS_GATHER_CUTLASS=1), bf16, N and K multiples of 8, 16-byte aligned pointers; else the portable kernel,
// which takes them everywhere.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "activation/swiglu_math.cuh"
#include "common/check.h"
#include "common/vec.cuh"
#include "gemm/grouped_mm.h"
#include "gemm/portable_mma.cuh"
#include "gemm/portable_mma_fp8.cuh"
#include "gemm/sm90_kernels.h"
#include "gemm/tile_groups.cuh"

namespace moe::gemm {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 16, kThreads = 256;
constexpr int kPrepThreads = 1024, kPrepItems = kMaxGroups / kPrepThreads;
static_assert(kMaxOrderedGroups <= kMaxGroups);

struct Prepared {
  GroupInfo* groups;   // [E]
  int64_t* total;      // rows covered by all groups
  int32_t* tiles;      // row-tiles in use
  int32_t* order;      // [E]: the groups largest first (written only when asked for)
};

Prepared carve(void* ws, int E) {
  auto* g = static_cast<GroupInfo*>(ws);
  auto* total = reinterpret_cast<int64_t*>(g + E);
  return {g, total, reinterpret_cast<int32_t*>(total + 1), reinterpret_cast<int32_t*>(total + 2)};
}

// Offsets from sizes (one block, cub scan), clamped so that no group reaches past row M. Where out.order is
// given it gets the visiting order: with `largest_first` (E <= kMaxOrderedGroups) the groups by their clamped
// rows, descending, ties in expert order (each group's rank counts the groups before it in that order, from
// shared-memory broadcast reads); else expert order.
__global__ void __launch_bounds__(kPrepThreads)
    prepare_kernel(const int32_t* __restrict__ sizes, int E, int64_t M, int64_t N, GemmOp op, int tile_rows,
                   bool largest_first, Prepared out) {
  using Scan = cub::BlockScan<int64_t, kPrepThreads>;
  __shared__ typename Scan::TempStorage scan_rows, scan_tiles;
  __shared__ int32_t ranked_rows[kMaxOrderedGroups];
  int64_t rows[kPrepItems], starts[kPrepItems], tiles[kPrepItems], tile_starts[kPrepItems];
#pragma unroll
  for (int i = 0; i < kPrepItems; ++i) {
    const int e = threadIdx.x * kPrepItems + i;
    rows[i] = e < E ? (sizes != nullptr ? max(sizes[e], 0) : M) : 0;  // null sizes: group 0 takes every row
  }
  int64_t total;
  Scan(scan_rows).ExclusiveSum(rows, starts, total);
#pragma unroll
  for (int i = 0; i < kPrepItems; ++i) {
    const int64_t begin = min(starts[i], M), end = min(starts[i] + rows[i], M);
    rows[i] = end - begin;
    starts[i] = begin;
    const int64_t rows_of_tiles = op == GemmOp::kWgrad ? N : rows[i];
    const int e = threadIdx.x * kPrepItems + i;
    tiles[i] = e < E ? (rows_of_tiles + tile_rows - 1) / tile_rows : 0;
  }
  int64_t total_tiles;
  Scan(scan_tiles).ExclusiveSum(tiles, tile_starts, total_tiles);
#pragma unroll
  for (int i = 0; i < kPrepItems; ++i) {
    const int e = threadIdx.x * kPrepItems + i;
    if (e < E) out.groups[e] = {starts[i], int32_t(rows[i]), int32_t(tile_starts[i])};
  }
  if (threadIdx.x == 0) {
    *out.total = min(total, M);
    *out.tiles = int32_t(total_tiles);
  }
  if (out.order == nullptr) return;  // block-uniform
  if (!largest_first || E > kMaxOrderedGroups) {  // the rank count's shared array holds kMaxOrderedGroups
    for (int e = threadIdx.x; e < E; e += kPrepThreads) out.order[e] = e;
    return;
  }
#pragma unroll
  for (int i = 0; i < kPrepItems; ++i) {
    const int e = threadIdx.x * kPrepItems + i;
    if (e < E) ranked_rows[e] = int32_t(rows[i]);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kPrepThreads) {
    const int32_t key = ranked_rows[e];
    int rank = 0;
    for (int j = 0; j < E; ++j) {
      const int32_t r = ranked_rows[j];
      rank += (r > key) | ((r == key) & (j < e));
    }
    out.order[rank] = e;
  }
}

// The operand element at (row, col) of a gathered operand: row `pos` of the group (group-ordered) is the
// source row rows[row_start + pos]; a source index outside [0, n) reads 0.
template <typename T>
__device__ __forceinline__ float gathered(const T* base, const int32_t* rows, int64_t n, int64_t row_start,
                                          int64_t pos, int64_t row_stride, int64_t col) {
  const int32_t src = rows[row_start + pos];
  return src >= 0 && src < n ? to_float(base[int64_t(src) * row_stride + col]) : 0.f;
}

// C_g[i, j] = sum_r A_g(i, r) * B_g(j, r) for the group and row-tile that this block finds. kDual (the
// forward's SwiGLU epilogue): the block's output columns j index [0, N / 2) and it accumulates both the
// gate column j and the up column N / 2 + j, in the same order as two plain tiles would.
template <typename T, bool kDual>
__global__ void __launch_bounds__(kThreads)
    portable_kernel(GemmOp op, const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ d, int E, int64_t N,
                    int64_t K, Prepared prep, bool accumulate, Fusion fu) {
  __shared__ float As[kBK][kBM + 1];
  __shared__ float Bs[kDual ? 2 : 1][kBK][kBN + 1];
  const int tile = blockIdx.x;
  if (tile >= *prep.tiles) return;
  const int g = group_of_tile(prep.groups, E, tile);
  const GroupInfo info = prep.groups[g];
  int64_t Mg, Ng, Kg, sai, sar, sbj, sbr, ldc;
  const T *A, *B;
  T* C;
  // With gathered rows the operand's pointer stays at its first row (gathered() adds the source row).
  const int64_t a_row0 = fu.a_rows != nullptr ? 0 : info.row_start;
  const int64_t b_row0 = fu.b_rows != nullptr ? 0 : info.row_start;
  switch (op) {
    case GemmOp::kFwd:
      Mg = info.rows; Ng = kDual ? N / 2 : N; Kg = K;
      A = a + a_row0 * K; sai = K; sar = 1;
      B = b + int64_t(g) * N * K; sbj = K; sbr = 1;
      C = d + info.row_start * N; ldc = N;
      break;
    case GemmOp::kDgrad:
      Mg = info.rows; Ng = K; Kg = N;
      A = a + a_row0 * N; sai = N; sar = 1;
      B = b + int64_t(g) * N * K; sbj = 1; sbr = K;
      C = d + info.row_start * K; ldc = K;
      break;
    default:
      Mg = N; Ng = K; Kg = info.rows;
      A = a + a_row0 * N; sai = 1; sar = N;
      B = b + b_row0 * K; sbj = 1; sbr = K;
      C = d + int64_t(g) * N * K; ldc = K;
      break;
  }
  const int64_t i0 = int64_t(tile - info.tile_start) * kBM, j0 = int64_t(blockIdx.y) * kBN;
  if (j0 >= Ng) return;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[kDual ? 2 : 1][4][4] = {};
  for (int64_t r0 = 0; r0 < Kg; r0 += kBK) {
    // Neighbouring threads walk the operand's contiguous index, so loads coalesce for every layout.
    for (int idx = threadIdx.x; idx < kBK * kBM; idx += kThreads) {
      const int r = sar == 1 ? idx % kBK : idx / kBM, i = sar == 1 ? idx / kBK : idx % kBM;
      const bool in = i0 + i < Mg && r0 + r < Kg;
      float v = 0.f;
      if (in && fu.a_rows == nullptr) {
        v = to_float(A[(i0 + i) * sai + (r0 + r) * sar]);
      } else if (in) {  // the gathered dimension is the group's rows: i (fwd, dgrad) or r (wgrad), by op (with
                        // N = 1 wgrad's sar is 1 too); one call, so the kernel keeps its registers
        const bool by_i = kDual || op != GemmOp::kWgrad;  // kDual: the forward
        v = gathered(A, fu.a_rows, fu.gather_rows, info.row_start, by_i ? i0 + i : r0 + r, by_i ? sai : sar,
                     by_i ? r0 + r : i0 + i);
      }
      As[r][i] = v;
    }
#pragma unroll
    for (int half = 0; half < (kDual ? 2 : 1); ++half) {
      const T* Bh = B + (half ? (N / 2) * sbj : 0);  // kDual: the up rows follow the gate rows
      for (int idx = threadIdx.x; idx < kBK * kBN; idx += kThreads) {
        const int r = sbr == 1 ? idx % kBK : idx / kBN, j = sbr == 1 ? idx / kBK : idx % kBN;
        const bool in = j0 + j < Ng && r0 + r < Kg;
        float v = 0.f;
        if (in && fu.b_rows == nullptr) {
          v = to_float(Bh[(j0 + j) * sbj + (r0 + r) * sbr]);
        } else if (in) {  // wgrad's x: rows along r
          v = gathered(Bh, fu.b_rows, fu.gather_rows, info.row_start, r0 + r, sbr, j0 + j);
        }
        Bs[half][r][j] = v;
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kBK; ++r) {
      float av[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) av[u] = As[r][ty + 16 * u];
#pragma unroll
      for (int half = 0; half < (kDual ? 2 : 1); ++half) {
        float bv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) bv[u] = Bs[half][r][tx + 16 * u];
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[half][u][v] = fmaf(av[u], bv[v], acc[half][u][v]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int64_t i = i0 + ty + 16 * u, j = j0 + tx + 16 * v;
      if (i < Mg && j < Ng) {
        if constexpr (kDual) {
          const T gate = from_float<T>(acc[0][u][v]), up = from_float<T>(acc[1][u][v]);
          C[i * ldc + j] = gate;
          C[i * ldc + Ng + j] = up;
          const int64_t row = info.row_start + i;
          const float w = fu.act_weights != nullptr ? fu.act_weights[row] : 1.f;
          static_cast<T*>(fu.act)[row * Ng + j] =
              from_float<T>(activation::swiglu_value(to_float(gate), to_float(up), w));
        } else {
          T& out = C[i * ldc + j];
          out = from_float<T>(accumulate ? to_float(out) + acc[0][u][v] : acc[0][u][v]);
        }
      }
    }
}

// NVFP4 scales into CUTLASS's blocked layout (grouped_mm.h, nvfp4_blocked_scales): block (t, j) writes atom
// row t's atom column j, thread i its row i (4 scales, one 32-bit store). Atom rows past the groups' are left.
__global__ void __launch_bounds__(128)
    nvfp4_blocked_scales_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                const GroupInfo* __restrict__ groups, const int32_t* __restrict__ tiles, int E,
                                int64_t N, int64_t K) {
  const int64_t t = blockIdx.x, j = blockIdx.y, cols = K / 16;
  int64_t row_start, rows, first_tile;
  if (groups != nullptr) {
    if (t >= *tiles) return;
    const GroupInfo& info = groups[group_of_tile(groups, E, t)];
    row_start = info.row_start;
    rows = info.rows;
    first_tile = info.tile_start;
  } else {  // E experts of N rows
    const int64_t per = (N + 127) / 128;
    row_start = t / per * N;
    rows = N;
    first_tile = t / per * per;
  }
  const int i = threadIdx.x;
  const int64_t local = (t - first_tile) * 128 + i;
  uint32_t word = 0;
  if (local < rows) {
    const uint8_t* in = src + (row_start + local) * cols;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t col = j * 4 + c;
      if (col < cols) word |= uint32_t(in[col]) << (8 * c);
    }
  }
  const int64_t atom = t * ((cols + 3) / 4) + j;
  *reinterpret_cast<uint32_t*>(dst + atom * 512 + (i % 32) * 16 + (i / 32) * 4) = word;
}

template <typename T>
__global__ void zero_tail_rows_kernel(T* __restrict__ d, const int64_t* __restrict__ total, int64_t M, int64_t K) {
  const int64_t begin = *total * K, end = M * K;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x) {
    d[i] = from_float<T>(0.f);
  }
}

template <typename T>
__global__ void zero_empty_groups_kernel(T* __restrict__ d, const GroupInfo* __restrict__ groups, int64_t NK) {
  if (groups[blockIdx.y].rows > 0) return;  // clamped rows: a group pushed past M is empty too
  T* out = d + int64_t(blockIdx.y) * NK;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < NK; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = from_float<T>(0.f);
  }
}

template <typename F>
void by_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f.template operator()<float>();
    case DType::kFloat16: return f.template operator()<__half>();
    case DType::kBFloat16: return f.template operator()<__nv_bfloat16>();
    default: throw std::invalid_argument("grouped_mm: dtype must be float32, float16 or bfloat16");
  }
}

int64_t max_row_tiles(const GroupedParams& p, int tile_rows = kBM) {
  if (p.op == GemmOp::kWgrad) return int64_t(p.num_groups) * ((p.N + tile_rows - 1) / tile_rows);
  return (p.M + tile_rows - 1) / tile_rows + p.num_groups;  // each group adds at most one partial tile
}

size_t prepared_bytes(int E) { return size_t(E) * sizeof(GroupInfo) + 16 + size_t(E) * sizeof(int32_t); }

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0;
  // Bytes of shared memory: an SM's, the most one block may opt in to, and what the system reserves of each block's.
  int smem_per_sm = 0, smem_optin = 0, smem_reserved = 0;
};

DeviceInfo device_info(int device) {
  static std::mutex mu;
  static DeviceInfo cache[64];
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& info = cache[device & 63];
  if (info.sms == 0) {
    check_cuda(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device), "grouped_mm");
    check_cuda(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device), "grouped_mm");
    check_cuda(cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
               "grouped_mm");
    check_cuda(cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "grouped_mm");
    check_cuda(cudaDeviceGetAttribute(&info.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device),
               "grouped_mm");
    check_cuda(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device), "grouped_mm");
  }
  return info;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The GPUs the sm_100f family cubins load on: 10.0 (B200) and 10.3 (B300).
bool sm100_family(const DeviceInfo& d) { return d.major == 10 && (d.minor == 0 || d.minor == 3); }

}  // namespace

// The FP8 blockwise kernel for p (sm_90a, or sm_100f when opted in), or the portable path.
static Path fp8_blockwise_path(const GroupedParams& p) {
  const DeviceInfo d = device_info(p.device);
  const Path kernel = d.major == 9 && sm90::compiled()           ? Path::kSm90Fp8Blockwise
                      : sm100_family(d) && sm100::enabled() ? Path::kSm100Fp8Blockwise
                                                            : Path::kPortable;
  if (kernel == Path::kPortable) return kernel;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d) || p.sfa == nullptr || p.sfb == nullptr) {
    return Path::kPortable;
  }
  if (p.op == GemmOp::kFwd) return p.K > 0 && p.K % 128 == 0 && p.N % 8 == 0 ? kernel : Path::kPortable;
  if (p.op == GemmOp::kWgrad) {  // d's rows are K elements: 16-byte stores need K % 4 (fp32), K % 8 (bf16)
    const bool fits = p.M > 0 && p.M % 16 == 0 && p.K % (p.fp8_wgrad_out == DType::kBFloat16 ? 8 : 4) == 0;
    return fits ? kernel : Path::kPortable;
  }
  return Path::kPortable;
}

// wgrad with group_align: a group whose rows do not start and end on multiples of `align` gets NaN (the
// FP8 kernel skipped it: its scale blocks would straddle two experts), never stale memory.
template <typename T>
__global__ void nan_misaligned_groups_kernel(T* __restrict__ d, const GroupInfo* __restrict__ groups, int64_t NK,
                                             int32_t align) {
  const GroupInfo g = groups[blockIdx.y];
  if (g.rows == 0 || (g.row_start % align == 0 && g.rows % align == 0)) return;
  T* out = d + int64_t(blockIdx.y) * NK;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < NK; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = from_float<T>(__int_as_float(0x7fc00000));
  }
}

namespace {

// NVFP4: the sm_100f block-scaled forward where opted in and it fits, else none (the Python layer runs the
// exact emulation: dequantize + the fp32 grouped GEMM).
Path nvfp4_path(const GroupedParams& p) {
  if (p.op != GemmOp::kFwd || !sm100_family(device_info(p.device)) || !sm100::enabled()) return Path::kPortable;
  if (p.sfa == nullptr || p.sfb == nullptr || p.a_global == nullptr || p.b_global == nullptr) return Path::kPortable;
  if (p.K <= 0 || p.K % 32 || p.N % 8 || !aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d)) return Path::kPortable;
  return Path::kSm100Nvfp4;
}

// The gates every CUTLASS path shares, before any instance is chosen.
Path gate(const GroupedParams& p) {
  if (p.dtype == DType::kFloat8E4M3) return fp8_blockwise_path(p);
  if (p.dtype == DType::kFloat4E2M1) return nvfp4_path(p);
  const bool half = p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16;
  const DeviceInfo d = half ? device_info(p.device) : DeviceInfo{};
  const bool sm90 = d.major == 9 && sm90::compiled();
  const bool sm100 = sm100_family(d) && p.dtype == DType::kBFloat16 && sm100::enabled();
  if (!sm90 && !sm100) return Path::kPortable;
  if (p.N % 8 || p.K % 8 || !aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d)) return Path::kPortable;
  // A zero-length reduction leaves CUTLASS's accumulators unwritten; the portable kernel writes zeros.
  if ((p.op == GemmOp::kFwd && p.K == 0) || (p.op == GemmOp::kDgrad && p.N == 0)) return Path::kPortable;
  return sm100 ? Path::kSm100 : Path::kSm90Cooperative;  // sm_90a: refined by the chosen instance's schedule
}

// p with the sm_90a instance and raster order filled in (the table's choice unless p asks for one).
GroupedParams resolved(const GroupedParams& p) {
  GroupedParams q = p;
  const Choice c = resolve_sm90(p);
  q.kernel = c.kernel;
  q.raster = int32_t(c.raster);
  return q;
}

}  // namespace

static bool fused(const GroupedParams& p) { return p.a_rows != nullptr || p.b_rows != nullptr || p.act != nullptr; }

bool portable_mma_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOE_KERNELS_PORTABLE_MMA");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

// The output's columns per product.
static int64_t output_cols(const GroupedParams& p) { return p.op == GemmOp::kFwd ? p.N : p.K; }

// The tensor-core portable kernel's grid y extent: 128-column tiles of the output, or with the SwiGLU epilogue
// tiles of 64 features (their gate and up columns).
static int64_t mma_col_tiles(const GroupedParams& p) {
  if (p.act != nullptr) return (p.N / 2 + mma::kBN / 2 - 1) / (mma::kBN / 2);
  return (output_cols(p) + mma::kBN - 1) / mma::kBN;
}

// Whether the FP8 tensor-core kernel's code on `device` was compiled for 8.9 or later: a GPU of 8.9 loads an sm_80
// cubin where the build has no sm_89 one (CMakeLists.txt adds it with an 8.x target), and a GPU the build has no
// cubin for runs the driver's compilation of older PTX; in both the kernel is a trap. The PTX version is the
// architecture the code was compiled for (the binary version is the GPU's own when the driver compiled it).
static bool mma_fp8_code_runs(int device) {
  static std::mutex mu;
  static int8_t cache[64] = {};  // 0 not asked yet, 1 runs, -1 does not
  std::lock_guard<std::mutex> lock(mu);
  int8_t& known = cache[device & 63];
  if (known == 0) {
    int current = 0;
    check_cuda(cudaGetDevice(&current), "grouped_mm");
    if (current != device) check_cuda(cudaSetDevice(device), "grouped_mm");
    cudaFuncAttributes attr{};
    const auto kernel = &mma::mma_fp8_kernel<GemmOp::kFwd, __nv_bfloat16>;
    const cudaError_t err = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel));
    if (current != device) check_cuda(cudaSetDevice(current), "grouped_mm");
    if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
      (void)cudaGetLastError();  // no code for this GPU at all: the kernel does not run (the error is ours to clear)
      known = -1;
    } else {
      check_cuda(err, "grouped_mm: cudaFuncGetAttributes");
      known = attr.ptxVersion >= 89 && attr.binaryVersion >= 89 ? 1 : -1;
    }
  }
  return known > 0;
}

// Why the tensor-core portable kernel cannot take p, or null when it can.
static const char* portable_mma_refusal(const GroupedParams& p) {
  if (p.dtype == DType::kFloat8E4M3) {  // gemm/portable_mma_fp8.cuh: the forward and wgrad, blockwise scales
    const DeviceInfo d = device_info(p.device);
    if (d.major * 10 + d.minor < 89) return "FP8 needs compute capability 8.9 or later (E4M3 tensor cores)";
    if (!mma_fp8_code_runs(p.device)) {
      return "the extension holds no FP8 tensor-core code for this GPU (build for sm_89 or later: "
             "MOE_KERNELS_CUDA_ARCHS)";
    }
    if (p.op == GemmOp::kDgrad) return "FP8 has a forward and a wgrad (dgrad is the forward on transposed tiles)";
    if (p.sfa == nullptr || p.sfb == nullptr) return "FP8 needs both scale tensors";
    if (fused(p)) return "FP8 takes no gathered rows or SwiGLU epilogue";
    if (p.accumulate && (p.op != GemmOp::kWgrad || p.fp8_wgrad_out != DType::kFloat32)) {
      return "FP8 accumulates only the wgrad's float32 output";
    }
    if (p.op == GemmOp::kFwd && p.K % 128) return "the FP8 forward needs K a multiple of 128 (one scale per 128)";
    if (mma_col_tiles(p) > 65535) return "the output is too wide";
    return nullptr;
  }
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "it takes bf16, fp16 and E4M3";
  if (p.accumulate) return "it does not accumulate (a float32 output)";
  if (device_info(p.device).major < 8) return "it needs compute capability 8.0 or later";
  if (mma_col_tiles(p) > 65535) return "the output is too wide";
  return nullptr;
}

// Gathered rows or the SwiGLU epilogue: the sm_90a gather kernels where opted in and they fit (bf16, 16-byte rows
// and pointers, the epilogue's tiles of 64 features whole), else the portable kernel.
static Path gather_path(const GroupedParams& p) {
  if (!sm90::gather_enabled() || p.dtype != DType::kBFloat16 || p.accumulate || p.kernel >= 0) return Path::kPortable;
  if (device_info(p.device).major != 9) return Path::kPortable;
  if (p.N % 8 || p.K % 8 || !aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d) || !aligned16(p.act)) {
    return Path::kPortable;
  }
  if ((p.op == GemmOp::kFwd && p.K == 0) || (p.op == GemmOp::kDgrad && p.N == 0)) return Path::kPortable;
  if (p.act != nullptr && (p.N / 2) % 64) return Path::kPortable;
  // The grid's y extent: output column tiles (64 features with the epilogue, else 128 columns).
  const int64_t cols = p.op == GemmOp::kFwd ? (p.act != nullptr ? p.N / 2 : p.N) : p.K;
  if ((cols + 63) / 64 > 65535) return Path::kPortable;
  return Path::kSm90Gather;
}

Path choose_path(const GroupedParams& p) {
  if (p.portable < -1 || p.portable > 1) {
    throw std::invalid_argument("grouped_mm: portable must be -1 (the default), 0 (CUDA cores) or 1 (tensor cores)");
  }
  if (p.portable >= 0 && p.kernel >= 0) {
    throw std::invalid_argument("grouped_mm: a portable kernel and an sm_90a kernel were both requested");
  }
  if (p.portable == 1) {  // the tensor-core portable kernel, asked for by name
    if (const char* why = portable_mma_refusal(p)) {
      throw std::invalid_argument(std::string("grouped_mm: the tensor-core portable kernel was requested, but ") + why);
    }
    return Path::kPortableMma;
  }
  if (p.portable == 0) {
    if (p.dtype == DType::kFloat8E4M3 || p.dtype == DType::kFloat4E2M1) {
      throw std::invalid_argument("grouped_mm: the portable kernel takes bf16, fp16 and fp32");
    }
    return Path::kPortable;
  }
  const Path path = fused(p) ? gather_path(p) : gate(p);
  if (path == Path::kPortable && p.kernel < 0 && portable_mma_enabled() && portable_mma_refusal(p) == nullptr) {
    return Path::kPortableMma;
  }
  if (path == Path::kPortable || path == Path::kSm90Gather) {
    if (p.kernel >= 0) {
      throw std::invalid_argument("grouped_mm: kernel " + std::to_string(p.kernel) +
                                  " requested, but this problem runs the portable kernel (no sm_90a GPU or build, "
                                  "or unaligned sizes or pointers)");
    }
    return path;
  }
  if (path == Path::kSm90Fp8Blockwise) {
    resolve_sm90(p);  // validates a requested kernel
    return path;
  }
  if (path == Path::kSm100 || path == Path::kSm100Fp8Blockwise || path == Path::kSm100Nvfp4) {
    if (p.kernel >= 0 || p.raster > 1) {
      throw std::invalid_argument("grouped_mm: a kernel or raster order was requested, but this problem runs the "
                                  "sm_100f instance (one per product)");
    }
    return path;
  }
  return kSm90Kernels[resolve_sm90(p).kernel].pingpong ? Path::kSm90Pingpong : Path::kSm90Cooperative;
}

int64_t nvfp4_scale_atoms(int64_t atom_rows, int64_t K) { return atom_rows * ((K / 16 + 3) / 4); }

// The blocked NVFP4 scales' sections of the workspace, after the prepared groups: the activations' (at most
// ceil(M / 128) + E atom rows: each group adds at most one partial one) and the weights' (ceil(N / 128) per
// expert).
struct Nvfp4Scales {
  int64_t a_rows, b_rows;
  size_t a_bytes, b_bytes;
};
static Nvfp4Scales nvfp4_scales(const GroupedParams& p) {
  Nvfp4Scales s;
  s.a_rows = (p.M + 127) / 128 + p.num_groups;
  s.b_rows = int64_t(p.num_groups) * ((p.N + 127) / 128);
  s.a_bytes = (size_t(nvfp4_scale_atoms(s.a_rows, p.K)) * 512 + 255) / 256 * 256;
  s.b_bytes = (size_t(nvfp4_scale_atoms(s.b_rows, p.K)) * 512 + 255) / 256 * 256;
  return s;
}

static void launch_blocked_scales(const uint8_t* src, uint8_t* dst, const GroupInfo* groups, const int32_t* tiles,
                                  int E, int64_t N, int64_t K, int64_t atom_rows, cudaStream_t stream) {
  const int64_t cols = (K / 16 + 3) / 4;
  if (atom_rows == 0 || cols == 0) return;
  if (atom_rows > int64_t(0x7fffffff) || cols > 65535) throw std::invalid_argument("grouped_mm nvfp4: scales too large");
  nvfp4_blocked_scales_kernel<<<dim3(unsigned(atom_rows), unsigned(cols)), 128, 0, stream>>>(src, dst, groups, tiles,
                                                                                              E, N, K);
  check_launch("grouped_mm nvfp4_blocked_scales_kernel");
}

void nvfp4_blocked_scales(const uint8_t* src, uint8_t* dst, int E, int64_t N, int64_t K, cudaStream_t stream) {
  launch_blocked_scales(src, dst, nullptr, nullptr, E, N, K, int64_t(E) * ((N + 127) / 128), stream);
}

void nvfp4_blocked_activation_scales(const GroupedParams& p, uint8_t* dst, cudaStream_t stream) {
  if (p.num_groups < 1 || p.num_groups > kMaxGroups) throw std::invalid_argument("grouped_mm: num_groups out of range");
  if (p.K % 16) throw std::invalid_argument("grouped_mm nvfp4: K must be a multiple of 16");
  if (p.workspace_bytes < prepared_bytes(p.num_groups)) throw std::invalid_argument("grouped_mm: workspace too small");
  const Prepared prep = carve(p.workspace, p.num_groups);
  Prepared launch_prep = prep;
  launch_prep.order = nullptr;
  prepare_kernel<<<1, kPrepThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.M, p.N, GemmOp::kFwd, 128, false,
                                                 launch_prep);
  check_launch("grouped_mm prepare_kernel");
  launch_blocked_scales(reinterpret_cast<const uint8_t*>(p.sfa), dst, prep.groups, prep.tiles, p.num_groups, p.N,
                        p.K, (p.M + 127) / 128 + p.num_groups, stream);
}

bool largest_first(const GroupedParams& p) {
  if (p.group_order < -1 || p.group_order > 1) {
    throw std::invalid_argument("grouped_mm: group_order must be -1 (the default), 0 (expert order) or 1 (largest first)");
  }
  const bool want = p.group_order == 1 || (p.group_order == -1 && p.op == GemmOp::kWgrad);
  return want && p.num_groups <= kMaxOrderedGroups;
}

size_t grouped_workspace_bytes(const GroupedParams& p) {
  if (p.num_groups < 1 || p.num_groups > kMaxGroups) throw std::invalid_argument("grouped_mm: num_groups out of range");
  largest_first(p);  // validates group_order
  if (p.fp8_wgrad_out != DType::kFloat32 && p.fp8_wgrad_out != DType::kBFloat16) {
    throw std::invalid_argument("grouped_mm: fp8_wgrad_out must be float32 or bfloat16");
  }
  const Path path = choose_path(p);
  const size_t base = (prepared_bytes(p.num_groups) + 255) / 256 * 256;
  if (path == Path::kPortable || path == Path::kPortableMma || path == Path::kSm90Gather) return base;
  if (path == Path::kSm100Nvfp4) {
    const Nvfp4Scales sc = nvfp4_scales(p);
    return base + sc.a_bytes + sc.b_bytes + sm100::workspace_bytes(p, device_info(p.device).sms);
  }
  if (path == Path::kSm100 || path == Path::kSm100Fp8Blockwise) {
    return base + sm100::workspace_bytes(p, device_info(p.device).sms);
  }
  return base + sm90::workspace_bytes(resolved(p), device_info(p.device).sms);
}

void zero_uncovered(const GroupedParams& p, cudaStream_t stream) {
  const Prepared prep = carve(p.workspace, p.num_groups);
  // FP8 writes bf16 (fwd) or fp8_wgrad_out (wgrad: fp32 or bf16).
  const DType out = p.dtype != DType::kFloat8E4M3 ? p.dtype : (p.op == GemmOp::kWgrad ? p.fp8_wgrad_out : DType::kBFloat16);
  by_dtype(out, [&]<typename T>() {
    if (p.op == GemmOp::kDgrad) {
      zero_tail_rows_kernel<T><<<264, 256, 0, stream>>>(static_cast<T*>(p.d), prep.total, p.M, p.K);
      check_launch("grouped_mm zero_tail_rows_kernel");
    } else if (p.op == GemmOp::kWgrad && p.N * p.K > 0) {
      const int64_t nk = p.N * p.K;
      const unsigned bx = unsigned(std::min<int64_t>((nk + 255) / 256, 64));
      if (!p.accumulate) {  // accumulating, an empty group adds nothing
        zero_empty_groups_kernel<T><<<dim3(bx, p.num_groups), 256, 0, stream>>>(static_cast<T*>(p.d), prep.groups, nk);
        check_launch("grouped_mm zero_empty_groups_kernel");
      }
      const int32_t align = p.dtype == DType::kFloat8E4M3 ? 128 : p.group_align;
      if (align > 1) {
        nan_misaligned_groups_kernel<T><<<dim3(bx, p.num_groups), 256, 0, stream>>>(static_cast<T*>(p.d), prep.groups,
                                                                                     nk, align);
        check_launch("grouped_mm nan_misaligned_groups_kernel");
      }
    }
  });
}

// The tensor-core portable kernels' grid: row tiles of mma::kBM (as prepared) by mma_col_tiles.
static dim3 mma_grid(const GroupedParams& p) {
  const int64_t row_tiles = max_row_tiles(p, mma::kBM);
  if (row_tiles > int64_t(0x7fffffff)) throw std::invalid_argument("grouped_mm: too many row tiles");
  return dim3{unsigned(row_tiles), unsigned(mma_col_tiles(p))};
}

static bool aligned_to(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The shared-memory stages of a tensor-core portable kernel (mma::slice_pipeline) on p's GPU: as many as fit, 2 to
// mma::kMaxStages, while `ctas` CTAs share an SM (beside what the system reserves of each), or
// MOE_KERNELS_MMA_STAGES (2 to 4; read at every call, for tuning and tests) where one CTA may have that many.
static int mma_stages(const GroupedParams& p, int ctas) {
  const DeviceInfo d = device_info(p.device);
  int stages = (d.smem_per_sm / ctas - d.smem_reserved) / mma::kStageBytes;
  if (const char* v = std::getenv("MOE_KERNELS_MMA_STAGES"); v != nullptr && *v != '\0') {
    if (std::strlen(v) != 1 || v[0] < '2' || v[0] > '0' + mma::kMaxStages) {
      throw std::invalid_argument("MOE_KERNELS_MMA_STAGES must be 2, 3 or 4, not '" + std::string(v) + "'");
    }
    stages = v[0] - '0';
  }
  stages = std::clamp(stages, 2, mma::kMaxStages);
  while (stages > 2 && stages * mma::kStageBytes > d.smem_optin) --stages;
  return stages;
}

// Lets kernel have `bytes` of dynamic shared memory on the current device (the launch's: the callers hold its
// DeviceGuard) where that is past the 48 KB every kernel may have (cudaFuncSetAttribute once per kernel, device and
// size).
static void allow_dynamic_smem(const void* kernel, int bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "grouped_mm");
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> granted;
  std::lock_guard<std::mutex> lock(mu);
  int& have = granted[{kernel, device}];
  if (have < bytes) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
               "grouped_mm: the tensor-core portable kernel's shared memory");
    have = bytes;
  }
}

// Launches kernel, a tensor-core portable kernel (mma::kThreads threads), with `stages` shared-memory stages.
template <typename Kernel, typename... Args>
static void launch_staged(Kernel kernel, dim3 grid, int stages, cudaStream_t stream, Args... args) {
  const int bytes = stages * mma::kStageBytes;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
  kernel<<<grid, mma::kThreads, size_t(bytes), stream>>>(args..., stages);
}

// The FP8 tensor-core portable kernel (gemm/portable_mma_fp8.cuh) for p, its groups prepared in tiles of mma::kBM.
static void launch_mma_fp8(const GroupedParams& p, const Prepared& prep, int stages, cudaStream_t stream) {
  const dim3 grid = mma_grid(p);
  const bool wgrad = p.op == GemmOp::kWgrad;
  const DType out = wgrad ? p.fp8_wgrad_out : DType::kBFloat16;
  const int64_t ld = wgrad ? p.M : p.K;  // both operands' rows: the tokens (wgrad) or K
  const int64_t out_bytes = out == DType::kFloat32 ? 4 : 2;
  const mma::Fp8Args args{static_cast<const uint8_t*>(p.a), static_cast<const uint8_t*>(p.b), p.d, p.sfa, p.sfb,
                          aligned16(p.a) && ld % 16 == 0, aligned16(p.b) && ld % 16 == 0,
                          aligned_to(p.d, 2 * out_bytes) && output_cols(p) % 2 == 0, p.accumulate};
  const auto launch = [&]<GemmOp kOp, typename TOut>() {
    launch_staged(&mma::mma_fp8_kernel<kOp, TOut>, grid, stages, stream, args, p.num_groups, p.M, p.N, p.K,
                  prep.groups, prep.tiles);
  };
  if (!wgrad) {
    launch.template operator()<GemmOp::kFwd, __nv_bfloat16>();
  } else if (out == DType::kFloat32) {
    launch.template operator()<GemmOp::kWgrad, float>();
  } else {
    launch.template operator()<GemmOp::kWgrad, __nv_bfloat16>();
  }
  check_launch("grouped_mm mma_fp8_kernel");
}

void grouped_mm(const GroupedParams& p, cudaStream_t stream) {
  const size_t need = grouped_workspace_bytes(p);
  if (p.workspace_bytes < need) throw std::invalid_argument("grouped_mm: workspace too small");
  if (p.M < 0 || p.N < 0 || p.K < 0) throw std::invalid_argument("grouped_mm: negative size");
  if (p.group_sizes == nullptr && p.M > INT32_MAX) {  // one group of every row: its row count is an int32 (GroupInfo)
    throw std::invalid_argument("grouped_mm: without group sizes, M must be below 2^31");
  }
  const int64_t out_rows = p.op == GemmOp::kWgrad ? p.N : p.M;
  const int64_t out_cols = p.op == GemmOp::kFwd ? p.N : p.K;
  if (out_rows == 0 || out_cols == 0) return;  // empty output
  if (reinterpret_cast<uintptr_t>(p.workspace) % 256) throw std::invalid_argument("grouped_mm: workspace must be 256-byte aligned");
  if (p.accumulate) {
    const DType out = p.dtype == DType::kFloat8E4M3 ? p.fp8_wgrad_out : p.dtype;
    if (p.op != GemmOp::kWgrad || out != DType::kFloat32)
      throw std::invalid_argument("grouped_mm: accumulate is for wgrad with a float32 output");
  }
  if (fused(p)) {
    if (p.dtype == DType::kFloat8E4M3) throw std::invalid_argument("grouped_mm: gathered rows and the SwiGLU epilogue take bf16, fp16 or fp32");
    if (p.b_rows != nullptr && p.op != GemmOp::kWgrad) throw std::invalid_argument("grouped_mm: b_rows is for wgrad");
    if (p.gather_rows < 0) throw std::invalid_argument("grouped_mm: negative gather_rows");
    if (p.act != nullptr && (p.op != GemmOp::kFwd || p.N % 2 || p.accumulate)) {
      throw std::invalid_argument("grouped_mm: the SwiGLU epilogue is for the forward with an even N");
    }
  }
  const Path path = choose_path(p);
  if (p.dtype == DType::kFloat4E2M1 && path != Path::kSm100Nvfp4) {
    throw std::invalid_argument("grouped_mm nvfp4: the block-scaled kernel needs a 10.0/10.3 GPU with the sm_100f "
                                "instances opted in (MOE_KERNELS_SM100_CUTLASS=1), the forward, both scale tensors and "
                                "global scales, K % 32 == 0, N % 8 == 0 and 16-byte aligned operands");
  }
  if (p.dtype == DType::kFloat8E4M3 && path != Path::kSm90Fp8Blockwise && path != Path::kSm100Fp8Blockwise &&
      path != Path::kPortableMma) {
    throw std::invalid_argument(
        "grouped_mm fp8: the blockwise kernels need sm_90a (or sm_100f, opted in), 16-byte aligned operands, both "
        "scale tensors, and "
        "for the forward K a multiple of 128 and N a multiple of 8, for wgrad M a multiple of 16 and K of 4; the "
        "tensor-core portable kernel 8.9 or later (MOE_KERNELS_PORTABLE_MMA=1), both scale tensors, and for the "
        "forward K a multiple of 128");
  }
  // The tensor-core portable kernels' shared-memory stages: the FP8 kernel's registers hold one CTA an SM, the bf16
  // kernel's two (__launch_bounds__).
  const int stages = path != Path::kPortableMma ? 0 : mma_stages(p, p.dtype == DType::kFloat8E4M3 ? 1 : 2);
  const Prepared prep = carve(p.workspace, p.num_groups);
  const int tile_rows = path == Path::kSm90Gather    ? sm90::kGatherTileRows
                        : path == Path::kSm100Nvfp4  ? 128
                        : path == Path::kPortableMma ? mma::kBM
                                                     : kBM;
  const bool ordered = path != Path::kPortable && path != Path::kPortableMma && largest_first(p);
  Prepared launch_prep = prep;
  if (!ordered) launch_prep.order = nullptr;
  prepare_kernel<<<1, kPrepThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.M, p.N, p.op, tile_rows, ordered,
                                                 launch_prep);
  check_launch("grouped_mm prepare_kernel");
  GroupedParams v = p;
  v.visit = launch_prep.order;
  if (path == Path::kSm90Gather) {
    const int64_t row_tiles = (p.M + sm90::kGatherTileRows - 1) / sm90::kGatherTileRows + p.num_groups;
    sm90::gather_run(v, prep.groups, prep.tiles, row_tiles, stream);
  } else if (path == Path::kSm100Nvfp4) {
    // The scales into CUTLASS's blocked layout (one run of atoms per group), then the block-scaled GEMM.
    const size_t base = (prepared_bytes(p.num_groups) + 255) / 256 * 256;
    const Nvfp4Scales sc = nvfp4_scales(p);
    auto* sfa = static_cast<uint8_t*>(p.workspace) + base;
    auto* sfb = sfa + sc.a_bytes;
    launch_blocked_scales(reinterpret_cast<const uint8_t*>(p.sfa), sfa, prep.groups, prep.tiles, p.num_groups, p.N,
                          p.K, sc.a_rows, stream);
    launch_blocked_scales(reinterpret_cast<const uint8_t*>(p.sfb), sfb, nullptr, nullptr, p.num_groups, p.N, p.K,
                          sc.b_rows, stream);
    GroupedParams q = v;
    q.sfa = reinterpret_cast<const float*>(sfa);
    q.sfb = reinterpret_cast<const float*>(sfb);
    q.workspace = sfb + sc.b_bytes;
    q.workspace_bytes = p.workspace_bytes - base - sc.a_bytes - sc.b_bytes;
    sm100::run(q, device_info(p.device).sms, prep.groups, stream);
    return;  // rows past the groups are unspecified in the forward
  } else if (path == Path::kSm100 || path == Path::kSm100Fp8Blockwise) {
    GroupedParams q = v;
    const size_t base = (prepared_bytes(p.num_groups) + 255) / 256 * 256;
    q.workspace = static_cast<char*>(p.workspace) + base;
    q.workspace_bytes = p.workspace_bytes - base;
    sm100::run(q, device_info(p.device).sms, prep.groups, stream);
  } else if (path == Path::kPortableMma && p.dtype == DType::kFloat8E4M3) {
    launch_mma_fp8(p, prep, stages, stream);
  } else if (path == Path::kPortableMma) {
    const dim3 grid = mma_grid(p);
    // 16-byte vectors where the base pointer and the leading dimension allow them (the kernel's Operand); 4-byte
    // pairs of outputs where every output row has an even length and a 4-byte aligned start.
    const int64_t lda = p.op == GemmOp::kFwd ? p.K : p.N;
    const int64_t ldb = p.K;  // w [E, N, K] (fwd, dgrad), x [M, K] (wgrad)
    const bool vec_a = aligned16(p.a) && lda % 8 == 0, vec_b = aligned16(p.b) && ldb % 8 == 0;
    const bool vec_d = aligned_to(p.d, 4) && output_cols(p) % 2 == 0 &&
                       (p.act == nullptr || (aligned_to(p.act, 4) && (p.N / 2) % 2 == 0));
    const Fusion fu{p.a_rows, p.b_rows, p.gather_rows, p.act, p.act_weights};
    by_dtype(p.dtype, [&]<typename T>() {
      if constexpr (std::is_same_v<T, float>) {
        throw std::logic_error("grouped_mm: the tensor-core portable kernel takes bf16 and fp16");
      } else {
        const auto launch = [&]<GemmOp kOp, bool kFused>() {
          launch_staged(&mma::mma_kernel<T, kOp, kFused>, grid, stages, stream, static_cast<const T*>(p.a),
                        static_cast<const T*>(p.b), static_cast<T*>(p.d), p.num_groups, p.N, p.K, prep.groups,
                        prep.tiles, vec_a, vec_b, vec_d, fu);
        };
        const auto for_op = [&]<bool kFused>() {
          switch (p.op) {
            case GemmOp::kFwd: return launch.template operator()<GemmOp::kFwd, kFused>();
            case GemmOp::kDgrad: return launch.template operator()<GemmOp::kDgrad, kFused>();
            default: return launch.template operator()<GemmOp::kWgrad, kFused>();
          }
        };
        if (fused(p)) {
          for_op.template operator()<true>();
        } else {
          for_op.template operator()<false>();
        }
      }
    });
    check_launch("grouped_mm mma_kernel");
  } else if (path != Path::kPortable) {
    GroupedParams q = resolved(v);
    const size_t base = (prepared_bytes(p.num_groups) + 255) / 256 * 256;
    q.workspace = static_cast<char*>(p.workspace) + base;
    q.workspace_bytes = p.workspace_bytes - base;
    sm90::run(q, device_info(p.device).sms, prep.groups, stream);
    if (p.dtype == DType::kFloat8E4M3 && p.op == GemmOp::kFwd) return;  // nothing past the groups to zero
  } else {
    const bool dual = p.act != nullptr;
    const int64_t ng = p.op == GemmOp::kFwd ? (dual ? p.N / 2 : p.N) : p.K;
    const int64_t ytiles = max_row_tiles(p);
    const int64_t col_tiles = (ng + kBN - 1) / kBN;
    if (col_tiles > 65535) throw std::invalid_argument("grouped_mm: output too wide for the portable kernel");
    const dim3 grid{unsigned(ytiles), unsigned(col_tiles)};
    const Fusion fu{p.a_rows, p.b_rows, p.gather_rows, p.act, p.act_weights};
    by_dtype(p.dtype, [&]<typename T>() {
      auto* kernel = dual ? portable_kernel<T, true> : portable_kernel<T, false>;
      kernel<<<grid, kThreads, 0, stream>>>(p.op, static_cast<const T*>(p.a), static_cast<const T*>(p.b),
                                            static_cast<T*>(p.d), p.num_groups, p.N, p.K, prep, p.accumulate, fu);
    });
    check_launch("grouped_mm portable_kernel");
  }
  zero_uncovered(p, stream);
}

void group_visit_order(const GroupedParams& p, int32_t* order, cudaStream_t stream) {
  if (p.workspace_bytes < grouped_workspace_bytes(p)) throw std::invalid_argument("grouped_mm: workspace too small");
  Prepared prep = carve(p.workspace, p.num_groups);
  const bool ordered = largest_first(p);
  prep.order = order;
  prepare_kernel<<<1, kPrepThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.M, p.N, p.op, kBM, ordered, prep);
  check_launch("grouped_mm prepare_kernel");
}

}  // namespace moe::gemm
