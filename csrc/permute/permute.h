// Token permute / unpermute: host launchers. Semantics: specs/ops.md, "Permute / unpermute".
// All pointers are device pointers; sizes are validated by the Python layer before these run.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace moe::permute {

// Largest expert count the CUDA kernels take (per-warp histograms live in shared memory).
constexpr int kMaxExperts = 8192;

struct PermuteParams {
  const void* x;             // [T, row_bytes] any element type: the copy moves bytes
  const int32_t* indices;    // [T, k], -1 = dropped; values outside [-1, E) are treated as dropped
  void* x_perm;              // [R, row_bytes]
  int32_t* row_map;          // [T, k]
  int32_t* group_sizes;      // [E] padded counts
  void* workspace;           // permute_workspace_bytes(T * k, E) bytes
  int64_t num_tokens;
  int64_t k;
  int64_t row_bytes;
  int32_t num_experts;
  int32_t align;
  // permute_quantize_fp8: with fp8_codes set, each token's row (`dtype` elements) is also quantized to
  // E4M3 in 1x128 blocks (quantize_fp8's "block" granularity, bit for bit) straight into the permuted
  // rows: fp8_codes [R, H] and fp8_scales [R, ceil(H / 128)]. x_perm may then be null (no copy in the
  // input precision); when set, it receives the same rows as plain permute from the same read of x.
  // Padding rows get zero codes and scale 0 (a block of zeros, as grouped_mm_fp8 reads it).
  uint8_t* fp8_codes = nullptr;
  float* fp8_scales = nullptr;
  DType dtype = DType::kFloat32;
  bool pow2 = false;
};

size_t permute_workspace_bytes(int64_t num_slots, int32_t num_experts);
// With row_bytes == 0 only the routing runs (row_map, group_sizes, starts), nothing is copied.
void permute_fwd(const PermuteParams& p, cudaStream_t stream);
// After permute_fwd: each expert's first row, [E] int32 inside the workspace.
const int32_t* permute_expert_starts(const void* workspace, int64_t num_slots, int32_t num_experts);
// Byte offset of those starts in the workspace; each expert's unpadded row count follows them ([E] int32).
int64_t permute_starts_offset(int64_t num_slots, int32_t num_experts);

// counts[e] = number of slots with indices == e (slots outside [0, E) ignored).
void tokens_per_expert(const int32_t* indices, int64_t num_slots, int32_t num_experts, int32_t* counts,
                       cudaStream_t stream);

// row_token[r] = the token t whose slot (t, j) row_map sends to row r, -1 for rows no slot maps to (padding);
// row_map values outside [0, R) are skipped. Each row receives at most one slot (permute's row_map).
void rows_to_tokens(const int32_t* row_map, int64_t num_tokens, int64_t k, int64_t num_rows, int32_t* row_token,
                    cudaStream_t stream);

// Per-slot values [num_slots] (e.g. the routing weights [T, k]) moved to the rows row_map sends the slots to:
// rows[row_map[s]] = values[s], every other row of rows [num_rows] zero (padding, dropped slots' rows, rows past the
// groups). row_map values outside [0, num_rows) are skipped.
void slot_values_to_rows(const int32_t* row_map, const float* values, int64_t num_slots, int64_t num_rows, float* rows,
                         cudaStream_t stream);
// Its adjoint: values[s] = rows[row_map[s]], zero for a slot row_map sends nowhere (-1, or outside [0, num_rows)).
void rows_to_slot_values(const int32_t* row_map, const float* rows, int64_t num_slots, int64_t num_rows, float* values,
                         cudaStream_t stream);

struct UnpermuteParams {
  const void* y;           // [R, H]
  const int32_t* row_map;  // [T, k]; rows outside [0, R) are treated as dropped
  const float* weights;    // [T, k] or nullptr (plain sum)
  void* out;               // [T, H]
  int64_t num_tokens;
  int64_t k;
  int64_t hidden;
  int64_t num_rows;
  DType dtype;             // of y and out: float32, float16 or bfloat16
};
void unpermute_fwd(const UnpermuteParams& p, cudaStream_t stream);

struct UnpermuteBwdParams {
  const void* dout;        // [T, H]
  const void* y;           // [R, H]; read only when dweights != nullptr
  const int32_t* row_map;  // [T, k]
  const float* weights;    // [T, k] or nullptr
  void* dy;                // [R, H]: every row written (unmapped rows get zeros); nullptr: dweights only
  float* dweights;         // [T, k] or nullptr
  uint8_t* row_mask;       // [R] zero-filled scratch; may be nullptr when dy is (no zero pass)
  int64_t num_tokens;
  int64_t k;
  int64_t hidden;
  int64_t num_rows;
  DType dtype;
};
void unpermute_bwd(const UnpermuteBwdParams& p, cudaStream_t stream);

// The backward's dy written in E4M3 only, in both layouts the down projection's FP8 backward reads (bit for
// bit quantize_fp8(dy, "block", pad_to_block=True) and quantize_fp8_tokens(dy) of unpermute_bwd's dy): 1x128
// blocks along H for dgrad (H zero-padded to Hp, a multiple of 128), 1x128 blocks along the rows, transposed, for
// wgrad. Row-driven: each row gathers its slot's dout (slot_of_row, the inverse of row_map; -1: a row no slot
// maps to, zeros). dweights are not computed here (unpermute_bwd with dy null gives them in its own reduction
// order). H % 8 == 0, dout 16-byte aligned, fp16 or bf16.
struct UnpermuteBwdFp8Params {
  const void* dout;              // [T, H]
  const int32_t* slot_of_row;    // [R]: t * k + j of the slot mapped to the row, or -1
  const float* weights;          // [T, k] or nullptr
  uint8_t* q;                    // [R, Hp], codes past H zero
  float* scale;                  // [R, Hp / 128]
  uint8_t* q_t;                  // [H, Rp], Rp = R rounded up to 128; 16-byte aligned
  float* scale_t;                // [H, Rp / 128]
  int64_t num_tokens;
  int64_t k;
  int64_t hidden;
  int64_t num_rows;
  bool pow2;
  DType dtype;
};
void unpermute_bwd_fp8(const UnpermuteBwdFp8Params& p, cudaStream_t stream);

}  // namespace moe::permute
