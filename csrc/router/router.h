// Fused router: top-k selection with weights, scores for balancing losses, and their backward.
// Semantics: specs/ops.md, "Router". One warp per token; all math in fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace moe::router {

constexpr int kMaxExperts = 4096;  // a token's logits and keys live in shared memory
constexpr int kMaxK = 32;          // one selected expert per lane
constexpr int kMaxGroups = 32;     // one group score per lane

// Launch geometry: one warp per token, `router_fwd_warps(E)` warps per block in the forward kernels (their
// logits and keys fill 48 KB of shared memory), kRouterBwdWarps in the backward ones. The grid is capped at
// kMaxRouterBlocks (more than any GPU holds at once at these sizes) and the kernels stride over the tokens
// past it: ceil(T / W) blocks would exceed gridDim.x's 2^31 - 1 for very large T when W = 1 (E = 4096).
constexpr int kRouterBwdWarps = 8;
constexpr int64_t kMaxRouterBlocks = 4096;
int router_fwd_warps(int num_experts);
int64_t router_blocks(int64_t num_tokens, int warps_per_block);

enum class Score : int32_t { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };

struct TopkParams {
  const void* logits;   // [T, E], dtype
  const float* bias;    // [E] or nullptr: added to the selection score only
  float* weights;       // [T, k]
  int32_t* indices;     // [T, k]
  int64_t num_tokens;
  int32_t num_experts;
  int32_t k;
  Score score;
  bool pre_softmax;
  int32_t num_groups;        // 1 = no group limit
  int32_t group_topk;
  int32_t group_score_topk;
  bool normalize;
  float scaling_factor;
  DType dtype;
};
void topk_fwd(const TopkParams& p, cudaStream_t stream);

struct TopkBwdParams {
  const float* grad_weights;  // [T, k]
  const void* logits;         // [T, E]
  const int32_t* indices;     // [T, k] from topk_fwd
  float* grad_logits;         // [T, E]
  int64_t num_tokens;
  int32_t num_experts;
  int32_t k;
  Score score;
  bool pre_softmax;
  bool normalize;
  float scaling_factor;
  DType dtype;
};
void topk_bwd(const TopkBwdParams& p, cudaStream_t stream);

struct AuxScoresParams {
  const void* logits;  // [T, E]
  float* scores;       // [T, E]
  int32_t* indices;    // [T, k]
  int64_t num_tokens;
  int32_t num_experts;
  int32_t k;
  Score score;
  DType dtype;
};
void aux_scores_fwd(const AuxScoresParams& p, cudaStream_t stream);

struct AuxScoresBwdParams {
  const float* grad_scores;  // [T, E]
  const void* logits;        // [T, E]
  float* grad_logits;        // [T, E]
  int64_t num_tokens;
  int32_t num_experts;
  Score score;
  DType dtype;
};
void aux_scores_bwd(const AuxScoresBwdParams& p, cudaStream_t stream);

// The router of an MoE layer in one pass each way: top-k with its weights, the per-expert counts and the
// statistics of every configured balancing loss in the forward; the losses' gradients folded into the top-k
// backward. Semantics: specs/ops.md "Router"; the composition it fuses is router_topk, tokens_per_expert,
// router_aux_scores, aux_loss, seq_aux_loss and z_loss, summed in that order (moe_kernels/ops/router.py,
// router_fused_reference).
//
// Every float sum has a fixed order, whatever the GPU: rows are cut into chunks of kFusedChunkRows inside
// each sequence; a chunk's sums are per warp in row order, then over the warps in order; the chunks are
// added in an order fixed by the shapes (common/chunk_sums.cuh). The forward's last block (an atomic ticket
// on `counter`, which it leaves at zero) adds the chunks' partials and writes the counts and the loss, so
// the forward is one launch.
constexpr int kFusedMaxExperts = 1024;  // per-warp score sums and the chunk's counts live in shared memory
constexpr int kFusedChunkRows = 64;

struct FusedParams {
  TopkParams topk;
  int32_t* counts;      // [E] top-k picks per expert, or nullptr (capacity follows and counts after it)
  int32_t* aux_counts;  // [E] picks of the top-k over the aux scores (aux or sequence loss on)
  int32_t* seq_counts;  // [B, E] the same per sequence (sequence loss on)
  float* loss;          // [] aux + sequence + z loss (0 when none is on)
  void* workspace;
  size_t workspace_bytes;
  uint32_t* counter;    // zero before the launch, zero after (one per stream)
  float aux_scale;      // coeff * E / (k * T^2); 0: off
  int64_t seq_len;      // S, with B = T / S sequences (sequence loss on)
  float seq_scale;      // coeff * E / (k * S^2) / B; 0: off
  float z_coeff;        // 0: off
};
int router_fused_warps(int num_experts);
size_t fused_workspace_bytes(const FusedParams& p);
void fused_fwd(const FusedParams& p, cudaStream_t stream);

struct FusedBwdParams {
  TopkBwdParams topk;         // grad_weights [T, k], logits, indices [T, k] from fused_fwd (before any capacity)
  const float* grad_loss;     // [] on the device, or nullptr (no gradient reached the loss)
  const int32_t* aux_counts;  // [E] (aux loss on)
  const int32_t* seq_counts;  // [B, E] (sequence loss on)
  float aux_scale;
  int64_t seq_len;
  float seq_scale;
  float z_coeff;
};
void fused_bwd(const FusedBwdParams& p, cudaStream_t stream);

}  // namespace moe::router
