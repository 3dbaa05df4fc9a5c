// Grouped GEMM for MoE experts: host launchers. Semantics: specs/ops.md, "Grouped GEMM".
//
// Three products over groups of consecutive rows (group e = rows [off_e, off_e + sizes[e])):
//   fwd:   d[M, N]    = a[M, K] (x)    @ b[e]^T  with b = w [E, N, K]
//   dgrad: d[M, K]    = a[M, N] (dout) @ b[e]    with b = w [E, N, K]; rows past the groups are zeroed
//   wgrad: d[E, N, K] = a_e^T (dout)   @ b_e     with b = x [M, K]; empty groups get zeros
//          (accumulate, fp32 output: d[E, N, K] += the product; empty groups keep d)
// FP8 (dtype float8_e4m3: the sm_90a kernels, the sm_100f ones where opted in, and the tensor-core portable kernel on
// 8.9 and later where opted in), E4M3 operands with fp32 blockwise dequantization scales:
//   fwd:   a = x [M, K], sfa [M, K / 128]; b = w [E, N, K], sfb [E, ceil(N / 128), K / 128]; d bf16 [M, N]
//   wgrad: a = dout^T [N, M], sfa [ceil(M / 128), N]; b = x^T [K, M], sfb [ceil(M / 128), K] (both
//          quantized along the tokens in 1x128 blocks, scales token-block-major); d fp32 [E, N, K].
//          Every group's rows must start and end on multiples of 128; a group that does not gets NaN
//          (group_align below, on every path).
// Problem shapes and pointers are built on the device from `group_sizes` (no host sync).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace moe::gemm {

constexpr int kMaxGroups = 4096;
constexpr int kMaxOrderedGroups = 512;  // GroupedParams::group_order: a rank count, O(E^2 / threads)

enum class GemmOp : int32_t { kFwd = 0, kDgrad = 1, kWgrad = 2 };

struct GroupedParams {
  GemmOp op;
  const void* a;
  const void* b;
  void* d;
  const int32_t* group_sizes;  // [E]; a sum past M is clamped (memory-safe); null: one group of all M rows (a
                               // dense GEMM; groups past the first are empty)
  int32_t num_groups;
  int64_t M, N, K;
  DType dtype;
  void* workspace;
  size_t workspace_bytes;
  int device;
  const float* sfa = nullptr;  // FP8 only
  const float* sfb = nullptr;  // FP8 only
  // wgrad: a group whose rows do not start and end on multiples of this gets NaN (blocks of tokens that
  // would straddle two experts); 0: any rows. The FP8 wgrad always uses 128.
  int32_t group_align = 0;
  // FP8 wgrad: the output's dtype, float32 or bfloat16 (the epilogue rounds the fp32 accumulators once).
  DType fp8_wgrad_out = DType::kFloat32;
  // wgrad with a float32 output (the FP8 wgrad's, or float32 inputs): d += the product, d read first (an fp32
  // main gradient accumulated in the epilogue); empty groups keep d, misaligned ones still get NaN.
  bool accumulate = false;
  // sm_90a only: the instance (an index into kSm90Kernels, sm90_kernels.h) and raster order (0 along M,
  // 1 along N) to run; -1 lets the tuning table choose. The tuning sweep sets them; the ops leave them.
  int32_t kernel = -1;
  int32_t raster = -1;
  // Where no CUTLASS kernel takes the problem, the portable kernel: 0 the CUDA-core one, 1 the tensor-core one
  // (gemm/portable_mma.cuh: bf16 and fp16 on sm_80 and later, the gathered products and the SwiGLU epilogue
  // included; gemm/portable_mma_fp8.cuh: E4M3 blockwise fwd and wgrad on 8.9 and later), -1 the default (the tensor-core one where MOE_KERNELS_PORTABLE_MMA=1 and it fits, else the
  // CUDA-core one). 0 and 1 also replace a CUTLASS kernel (tests and benches compare the paths on one GPU).
  int32_t portable = -1;
  // The order in which the CUTLASS and gather kernels' schedulers visit the groups: 1 the largest groups first
  // (sizes read on the device by the prepare kernel; ties in expert order), 0 expert order, -1 the default:
  // largest first for wgrad, expert order for fwd and dgrad. A wgrad tile's cost grows with its group's rows,
  // and the persistent schedulers hand out tiles round-robin in the visiting order, so largest first bounds
  // the spread of work between CTAs by one tile of the largest group, whatever the routing's skew; a forward
  // or dgrad tile costs the same in every group. More than kMaxOrderedGroups groups keep expert order.
  // The output is the same in either order (each group's tiles are computed alone).
  int32_t group_order = -1;
  // Set by grouped_mm, not by callers: the visiting order on the device ([E], group indices), null for expert
  // order.
  const int32_t* visit = nullptr;
  // Gathered operand rows (the gather-fused expert MLP, ops/expert_mlp.py): the group-ordered row r of an
  // operand is its row a_rows[r] (b_rows[r]); an index outside [0, gather_rows) reads a row of zeros, so the
  // permuted copy is never written. a_rows: the A operand of every product (fwd's x, dgrad's and wgrad's
  // dout); b_rows: wgrad's B (x). The portable kernel runs gathered products everywhere, the sm_90a gather kernels
  // where opted in (sm90::gather_enabled).
  const int32_t* a_rows = nullptr;
  const int32_t* b_rows = nullptr;
  int64_t gather_rows = 0;
  // Forward only, the SwiGLU epilogue: d = h [M, N] = [gate | up] (N = 2F) exactly as without it, and
  // act [M, F] = silu(gate) * up * act_weights[row] (1 when null) from h's rounded values: swiglu_fwd's
  // math (activation/swiglu_math.cuh), bit for bit; N / 2 a multiple of 64 for the sm_90a gather kernels.
  void* act = nullptr;
  const float* act_weights = nullptr;
  // NVFP4 (dtype float4_e2m1, the forward, sm_100f only where opted in): a = x codes [M, K / 2] and b = w codes
  // [E, N, K / 2] (two E2M1 codes a byte, the first element in the low nibble), sfa / sfb their E4M3 block scales
  // (one per 16 elements along K) in quantize_nvfp4's row-major layout, [M, K / 16] and [E, N, K / 16] (the
  // `const float*` fields hold their byte addresses), a_global / b_global the fp32 global scales on the device;
  // d bf16 [M, N] = dequant(a) @ dequant(b[e])^T per group (specs/lowprec.md). K % 32 == 0, N % 8 == 0.
  const float* a_global = nullptr;
  const float* b_global = nullptr;
};

// Row range of each group inside [0, M), written on the device by the prepare kernel.
struct GroupInfo {
  int64_t row_start;   // first row of the group in x / dout (clamped to M)
  int32_t rows;        // rows of the group inside [0, M)
  int32_t tile_start;  // first row-tile of the group in the kernel's grid (tiles of kBM rows, of
                       // sm90::kGatherTileRows for the gather kernels, of 128 for the NVFP4 scales' atoms)
};

// Gathered rows and the SwiGLU epilogue, as the portable kernels take them (GroupedParams' fields of the names).
struct Fusion {
  const int32_t* a_rows;
  const int32_t* b_rows;
  int64_t gather_rows;
  void* act;
  const float* act_weights;
};

// Which kernel runs: the portable tiled kernel, or a CUTLASS sm_90a warp-specialised persistent
// kernel, ping-pong or cooperative, its instance chosen per shape (sm90_kernels.h). See grouped_mm.cu.
// FP8 runs on the blockwise kernels (sm_90a; sm_100f and the tensor-core portable one where opted in); where none
// can run, the Python layer falls back to dequantize + the fp32 path before calling here.
enum class Path : int32_t {
  kPortable = 0,
  kSm90Pingpong = 1,
  kSm90Cooperative = 2,
  kSm90Fp8Blockwise = 3,
  kSm100 = 4,  // bf16 on a 10.x GPU, opted in (sm100::enabled)
  kSm100Fp8Blockwise = 5,  // E4M3 blockwise on a 10.x GPU, opted in
  kSm90Gather = 6,  // gathered rows / the SwiGLU epilogue on sm_90a (gemm/sm90/gather_sm90.cuh), opted in
  kSm100Nvfp4 = 7,  // NVFP4 block-scaled on a 10.x GPU, opted in (gemm/sm100/nvfp4_sm100.cuh)
  kPortableMma = 8,  // the portable kernel on tensor cores: bf16 / fp16 on sm_80+ (gemm/portable_mma.cuh), E4M3
                     // blockwise (fwd, wgrad) on 8.9+ (gemm/portable_mma_fp8.cuh)
};
// Whether the tensor-core portable kernel is the default where it fits: MOE_KERNELS_PORTABLE_MMA=1 when first
// asked (read once per process). Opt-in until its GPU tests have passed on a GPU.
bool portable_mma_enabled();
Path choose_path(const GroupedParams& p);

size_t grouped_workspace_bytes(const GroupedParams& p);
void grouped_mm(const GroupedParams& p, cudaStream_t stream);
// GroupedParams::group_order resolved: true when the schedulers visit the groups largest first (the portable
// kernel, which maps its blocks to groups by their tile offsets, has no order and ignores it).
bool largest_first(const GroupedParams& p);
// The visiting order that grouped_mm(p) gives the CUTLASS and gather schedulers (order[s] = the group visited
// s-th), written to order[E] by grouped_mm's own prepare kernel in p.workspace (sized by grouped_workspace_bytes);
// expert order where largest_first(p) is false. Computed whatever the path (the portable kernel, which has no
// scheduler, ignores it), so the CPU-executed build checks it (tests).
void group_visit_order(const GroupedParams& p, int32_t* order, cudaStream_t stream);

// Shared by both paths: zero dgrad rows past the groups and wgrad outputs of empty groups; NaN in wgrad
// outputs of groups that break group_align.
void zero_uncovered(const GroupedParams& p, cudaStream_t stream);

namespace sm90 {
bool compiled();  // false when the build has no sm_90a target
// p.kernel and p.raster resolved (>= 0).
size_t workspace_bytes(const GroupedParams& p, int sm_count);
void run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
// The gathered products (a_rows, b_rows, the SwiGLU epilogue) on WGMMA with cp.async gathers, bf16: fwd, dgrad,
// wgrad. Opt-in until they have run on a GPU: gather_enabled() needs the build to hold them and
// MOE_KERNELS_GATHER_CUTLASS=1. `tiles` / `row_tiles`: the prepare kernel's row-tiles of kGatherTileRows (fwd, dgrad).
constexpr int kGatherTileRows = 128;
bool gather_enabled();
void gather_run(const GroupedParams& p, const GroupInfo* groups, const int32_t* tiles, int64_t row_tiles,
                cudaStream_t stream);
}  // namespace sm90

// NVFP4 scales into CUTLASS's blocked layout (gemm/sm100/nvfp4_sm100.cuh): row-major E4M3 `src` [rows, K / 16]
// -> `dst`, for each group its rows padded to 128 (the padding scales 0), atoms of 128 rows x 4 scales (512
// bytes, K-block-major), group g's atom rows starting at groups[g].tile_start. nvfp4_blocked_scales: E groups
// of N rows each (an expert weight [E, N, K / 16]), expert e's atom rows at e * ceil(N / 128). Runs on every
// build (the CPU-executed one included); nvfp4_scale_atoms sizes dst (in atoms of 512 bytes) without a sync.
int64_t nvfp4_scale_atoms(int64_t atom_rows, int64_t K);
void nvfp4_blocked_scales(const uint8_t* src, uint8_t* dst, int E, int64_t N, int64_t K, cudaStream_t stream);
// nvfp4_blocked_scales for the activations of p, through grouped_mm's own prepare kernel (tiles of 128 rows):
// writes dst (nvfp4_scale_atoms(ceil(M / 128) + E, K) atoms) from p.sfa. For tests on every build; p.workspace
// holds the prepared groups (grouped_workspace_bytes of any problem with E groups is enough).
void nvfp4_blocked_activation_scales(const GroupedParams& p, uint8_t* dst, cudaStream_t stream);

// Blackwell (sm_100f: B200, B300) instances, one per product and dtypes (sm100_dispatch.cu): bf16 forward,
// dgrad and wgrad; E4M3 blockwise forward and wgrad (fp32 or bf16 out); NVFP4 block-scaled forward (p.sfa /
// p.sfb already blocked, grouped_mm.cu's conversion). Opt-in until they have run on a
// Blackwell GPU: enabled() needs the build to hold them and MOE_KERNELS_SM100_CUTLASS=1.
namespace sm100 {
bool compiled();
bool enabled();
size_t workspace_bytes(const GroupedParams& p, int sm_count);
void run(const GroupedParams& p, int sm_count, const GroupInfo* groups, cudaStream_t stream);
}  // namespace sm100

}  // namespace moe::gemm
