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

}  // namespace moe::router
