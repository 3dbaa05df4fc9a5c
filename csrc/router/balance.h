// Load-balancing losses, capacity and the expert-bias update. Semantics: specs/ops.md, "Router".
//
// Every reduction here is deterministic: partial results per fixed chunk of rows, then one block that
// adds them in a fixed order (the aux losses: the launch's last block, picked by an atomic ticket). Scalars that come from autograd (the incoming gradient) are read on the
// device, so nothing syncs with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace moe::router {

// Largest expert count of the kernels that count per expert in shared memory (seq_aux_loss, capacity);
// aux_loss, z_loss, the backward kernels and the bias update take any E.
constexpr int kBalanceMaxExperts = 8192;

// apply_capacity's per-expert loops take kCapacitySelectThreads pairs a pass over a segment of n pairs (up
// to 2^31 - 1): counted in 64 bits, where an int32 index stepping by 512 would overflow and never end.
constexpr int kCapacitySelectThreads = 512;
__host__ __device__ constexpr int64_t capacity_select_passes(int64_t n) {
  return (n + kCapacitySelectThreads - 1) / kCapacitySelectThreads;
}

// aux_loss (counts given, one sequence of T rows) and seq_aux_loss (counts per sequence of `seq_len`
// rows, taken from `indices`):  loss = scale * sum_b sum_e (sum_{t in b} scores[t, e]) * c_{b,e}.
struct BalanceParams {
  const void* scores;        // [T, E], dtype
  const int32_t* indices;    // [T, k]: counts per sequence (seq_aux_loss), or nullptr
  const void* counts;        // [E] int32 or int64 (aux_loss), or nullptr
  bool counts_int64;
  float* partial_sums;       // workspace [balance_chunks(T, seq_len), E]
  int32_t* partial_counts;   // workspace [balance_chunks(T, seq_len), E] (seq_aux_loss only)
  int32_t* seq_counts;       // [B, E] out (seq_aux_loss only): saved for the backward
  float* loss;               // [] out
  uint32_t* counter;         // zero at launch; the last block's ticket, left at zero
  int64_t num_tokens;
  int32_t num_experts;
  int32_t k;
  int64_t seq_len;           // = num_tokens for aux_loss
  float scale;               // coeff * E / (k * S^2) / B
  DType dtype;
};
int64_t balance_chunks(int64_t num_tokens, int64_t seq_len);
void balance_loss_fwd(const BalanceParams& p, cudaStream_t stream);

// grad_scores[t, e] = grad * scale * c_{b(t), e}; c from `counts` ([B, E], int32 or int64).
struct BalanceBwdParams {
  const float* grad;     // [] incoming gradient of the loss
  const void* counts;    // [B, E]
  bool counts_int64;
  void* grad_scores;     // [T, E], dtype
  int64_t num_tokens;
  int32_t num_experts;
  int64_t seq_len;
  float scale;
  DType dtype;
};
void balance_loss_bwd(const BalanceBwdParams& p, cudaStream_t stream);

// z_loss = coeff * mean_t lse_t^2 with lse_t = logsumexp_e logits[t, e] (kept for the backward).
struct ZLossParams {
  const void* logits;    // [T, E], dtype
  float* lse;            // [T] out
  float* partials;       // workspace [z_loss_chunks(T)]
  float* loss;           // [] out
  int64_t num_tokens;
  int32_t num_experts;
  float coeff;
  DType dtype;
};
int64_t z_loss_chunks(int64_t num_tokens);
void z_loss_fwd(const ZLossParams& p, cudaStream_t stream);

// grad_logits[t, e] = grad * coeff * 2 / T * lse_t * exp(logits[t, e] - lse_t).
struct ZLossBwdParams {
  const float* grad;     // []
  const void* logits;    // [T, E], dtype
  const float* lse;      // [T]
  void* grad_logits;     // [T, E], dtype
  int64_t num_tokens;
  int32_t num_experts;
  float coeff;
  DType dtype;
};
void z_loss_bwd(const ZLossBwdParams& p, cudaStream_t stream);

// In place: bias[e] += rate * sign(mean(c) - c_e), the sign taken exactly as sign(sum(c) - E * c_e).
void update_expert_bias(float* bias, const void* counts, bool counts_int64, int32_t num_experts, float rate,
                        cudaStream_t stream);

// Capacity: each expert keeps at most `capacity` of its (token, slot) pairs, the largest weights
// (ties to the earlier pair) or the earliest pairs; the others get index -1 and weight 0.
struct CapacityParams {
  const void* weights;     // [T * k], dtype
  const int32_t* indices;  // [T * k]; values outside [0, E) count as dropped
  void* weights_out;       // [T * k], dtype
  int32_t* indices_out;    // [T * k]
  void* workspace;         // capacity_workspace_bytes(num_slots, E)
  int64_t num_slots;
  int32_t num_experts;
  int64_t capacity;
  bool by_probs;
  DType dtype;
};
size_t capacity_workspace_bytes(int64_t num_slots, int32_t num_experts);
void apply_capacity(const CapacityParams& p, cudaStream_t stream);

}  // namespace moe::router
