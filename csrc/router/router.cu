// Fused router kernels: one warp per token, fp32 math.
//
// Ranking uses 32-bit order keys: the float's bits mapped so that unsigned comparison orders values,
// with NaN mapped to -inf and -0 to +0 (they compare equal in the reference). Key 0 lies below every
// real key and marks an expert already taken. A warp-wide argmax is two redux.sync max reductions:
// the largest key, then the largest ~index among lanes holding it (ties go to the lower index).
// Each lane owns experts e = lane + 32 i, keeps its own best candidate, and rescans when its candidate
// was taken, so a top-k costs k rounds of two reductions plus a rescan. Up to 256 experts the forward keeps
// a token's logits and keys in registers (RegRow: 1 to 8 a lane, no shared memory, no warp barriers, the
// group limit of 32-expert groups without rescans); past it in shared memory (SmemRow). One code serves
// both, so their results are the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>

#include "common/check.h"
#include "common/chunk_sums.cuh"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "router/router.h"

namespace moe::router {
namespace {

constexpr uint32_t kTaken = 0u;
constexpr float kNormEps = 1e-20f;
constexpr int kSmemBytes = 48 * 1024;
constexpr int kRouterRegWarps = 8;  // warps per block of the register-row forward kernels
constexpr float kSqrtSoftplusTail = -40.f;  // below it e^x < 5e-18: sqrt(softplus(x)) = sqrt(e^x) to rounding

__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) f = -INFINITY;
  if (f == 0.f) f = 0.f;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

struct Best {
  uint32_t key;
  int32_t e;
};

__device__ __forceinline__ Best warp_best(Best b) {
  const uint32_t top = __reduce_max_sync(0xffffffffu, b.key);
  const uint32_t pick = __reduce_max_sync(0xffffffffu, b.key == top ? ~uint32_t(b.e) : 0u);
  return {top, int32_t(~pick)};
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// s = sigmoid(x) or sqrt(softplus(x)), softplus(x) = x above 20 as in torch.
__device__ __forceinline__ float activation(Score score, float x) {
  if (score == Score::kSigmoid) return sigmoid(x);
  return sqrtf(x > 20.f ? x : log1pf(expf(x)));
}

// Softmax weights: over the k chosen logits (selection by logit, or by probability with `normalize`: the chosen
// probabilities over their sum, which is the softmax over the chosen logits), or the probabilities over all E.
__device__ __forceinline__ bool chosen_softmax(Score score, bool pre_softmax, bool normalize) {
  return score == Score::kSoftmax && (!pre_softmax || normalize);
}
__device__ __forceinline__ bool softmax_over_all(Score score, bool pre_softmax, bool normalize) {
  return score == Score::kSoftmax && pre_softmax && !normalize;
}

// ds/dx given s = activation(x). sqrt-softplus: sigmoid(x) / (2 s), and sqrt(e^x) / 2 below -40 (the same
// to fp64 rounding there), as the quotient is 0 / 0 where softplus underflows (about -104, or -inf).
__device__ __forceinline__ float activation_grad(Score score, float x, float s) {
  if (score == Score::kSigmoid) return s * (1.f - s);
  if (x < kSqrtSoftplusTail) return 0.5f * expf(0.5f * x);
  return (x > 20.f ? 1.f : sigmoid(x)) / (2.f * s);
}

template <typename T>
__device__ __forceinline__ float load(const T* row, int e) {
  return to_float(row[e]);
}

// A token's row as its warp holds it: lane `lane` owns experts e = lane + 32 i, i < slots(). One top-k code
// (topk_fwd_row, the aux scores and the fused forward) runs on two layouts:
// - RegRow<N>: the logits and keys in registers, E <= 32 N (every loop over the slots unrolled, so the arrays
//   stay in registers; a rescan is N compares on every lane, no branch);
// - SmemRow: the warp's slice of shared memory, any E up to kMaxExperts (only the owner of a taken expert
//   rescans its slots).
// A lane reads and writes only its own slots, so no warp barrier is needed between steps, except before
// SmemRow::value reads another lane's logit (sync()).
template <int N>
struct RegRow {
  static constexpr bool kRegs = true;
  float x[N];
  uint32_t key[N];
  int E, lane;
  __device__ __forceinline__ RegRow(int E_, int lane_) : E(E_), lane(lane_) {}
  __device__ __forceinline__ constexpr int slots() const { return N; }
  __device__ __forceinline__ bool has(int i) const { return lane + 32 * i < E; }
  __device__ __forceinline__ float& xs(int i) { return x[i]; }
  __device__ __forceinline__ uint32_t& keys(int i) { return key[i]; }
  // The logit of expert e, the same e on every lane (a warp collective).
  __device__ __forceinline__ float value(int e) const {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (lane + 32 * i == e) v = x[i];
    }
    return __shfl_sync(0xffffffffu, v, e & 31);
  }
  __device__ __forceinline__ void take(int e) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (lane + 32 * i == e) key[i] = kTaken;
    }
  }
  __device__ __forceinline__ void sync() const {}
};

struct SmemRow {
  static constexpr bool kRegs = false;
  float* x;       // [E] logits
  uint32_t* key;  // [E] keys
  int E, lane;
  __device__ __forceinline__ SmemRow(float* x_, uint32_t* key_, int E_, int lane_)
      : x(x_), key(key_), E(E_), lane(lane_) {}
  __device__ __forceinline__ int slots() const { return lane < E ? (E - lane + 31) / 32 : 0; }
  __device__ __forceinline__ bool has(int) const { return true; }
  __device__ __forceinline__ float& xs(int i) { return x[lane + 32 * i]; }
  __device__ __forceinline__ uint32_t& keys(int i) { return key[lane + 32 * i]; }
  __device__ __forceinline__ float value(int e) const { return x[e]; }  // after sync()
  __device__ __forceinline__ void take(int e) {
    if (e >= 0 && (e & 31) == lane) key[e] = kTaken;
  }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
};

// Best of the lane's own experts in [lo, hi) (the lower index on ties): visited in ascending e.
template <class Row>
__device__ __forceinline__ Best row_best(Row& row, int lo, int hi) {
  Best b{kTaken, -1};
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    const int e = row.lane + 32 * i;
    if (row.has(i) && e >= lo && e < hi) {
      const uint32_t k = row.keys(i);
      if (k > b.key) b = {k, e};
    }
  }
  return b;
}

// Top-k of the row's keys into lane r's `chosen` for r < k (and, with kValue, its logit in *chosen_x); consumes
// the keys (marks them taken). The warp's picks are the same whatever lane examined which expert: the largest
// key, the lower index on ties.
template <bool kValue, class Row>
__device__ __forceinline__ int32_t row_select_topk(Row& row, int k, float* chosen_x) {
  const int lane = row.lane;
  Best mine = row_best(row, 0, row.E);
  int32_t chosen = -1;
  float cx = 0.f;
  for (int r = 0; r < k; ++r) {
    const Best b = warp_best(mine);
    if (lane == r) chosen = b.e;
    if (b.e < 0) continue;  // (uniform) every expert taken
    if constexpr (kValue) {
      const float v = row.value(b.e);
      if (lane == r) cx = v;
    }
    row.take(b.e);
    if (Row::kRegs || (b.e & 31) == lane) mine = row_best(row, 0, row.E);
  }
  if constexpr (kValue) *chosen_x = cx;
  return chosen;
}

// Calls token(t, lane) for each token this warp owns (a grid stride past the capped grid); `sync` after each
// (a shared-memory row is reused by the next token).
template <bool kSync, typename F>
__device__ __forceinline__ void for_each_token(int64_t num_tokens, F&& token) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t t = int64_t(blockIdx.x) * warps + warp; t < num_tokens; t += int64_t(gridDim.x) * warps) {
    token(t, lane);
    if (kSync) __syncwarp();
  }
}

// The warp's row in dynamic shared memory: 2 * E words a warp (logits, then keys).
__device__ __forceinline__ SmemRow smem_row(int E, int lane) {
  extern __shared__ float smem[];
  float* xs = smem + size_t(threadIdx.x / 32) * 2 * E;
  return SmemRow(xs, reinterpret_cast<uint32_t*>(xs + E), E, lane);
}

// Each kernel strides over the tokens, one warp per token (router_blocks caps the grid, so any T fits
// gridDim.x); whole warps only, so no block-wide barriers.
// Loads token t's logits into `row` and returns their maximum (every lane).
template <typename T, class Row>
__device__ __forceinline__ float load_row(const void* logits, int64_t t, Row& row) {
  const T* src = static_cast<const T*>(logits) + t * row.E;
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    if (row.has(i)) {
      const float x = load(src, row.lane + 32 * i);
      row.xs(i) = x;
      m = fmaxf(m, x);
    }
  }
  return warp_max(m);
}

// The group limit: a group's score is the sum of its group_score_topk best selection keys' values (largest
// first); experts outside the group_topk best groups get the key of -inf (still above taken). `selection(x, e)`
// rebuilds a key consumed while scoring.
template <class Row, typename Sel>
__device__ __forceinline__ void limit_groups(const TopkParams& p, Row& row, Sel&& selection) {
  const int E = row.E, G = p.num_groups, lane = row.lane;
  const int gsize = E / G;
  uint32_t group_key = kTaken;  // lane gi holds group gi's key
  bool by_slot = false;
  if constexpr (Row::kRegs) {
    by_slot = gsize == 32 && G == row.slots();
    if (by_slot) {  // group i is slot i (DeepSeek-V3: 256 experts in 8 groups): no rescans, no restores
#pragma unroll
      for (int i = 0; i < row.slots(); ++i) {
        uint32_t mine = row.keys(i);
        float group_score = 0.f;
        for (int r = 0; r < p.group_score_topk; ++r) {
          const Best b = warp_best({mine, lane + 32 * i});
          const float v = key_value(b.key);
          group_score = r == 0 ? v : group_score + v;
          if (b.e == lane + 32 * i) mine = kTaken;
        }
        if (lane == i) group_key = order_key(group_score);
      }
    }
  }
  for (int gi = 0; !by_slot && gi < G; ++gi) {
    const int lo = gi * gsize, hi = lo + gsize;
    float group_score = 0.f;
    for (int r = 0; r < p.group_score_topk; ++r) {  // sum of the group's best scores, largest first
      const Best b = warp_best(row_best(row, lo, hi));
      const float v = key_value(b.key);
      group_score = r == 0 ? v : group_score + v;
      row.take(b.e);
    }
#pragma unroll
    for (int i = 0; i < row.slots(); ++i) {  // the taken keys back
      const int e = lane + 32 * i;
      if (row.has(i) && e >= lo && e < hi && row.keys(i) == kTaken) row.keys(i) = order_key(selection(row.xs(i), e));
    }
    if (lane == gi) group_key = order_key(group_score);
  }
  uint32_t kept = 0u;
  for (int r = 0; r < p.group_topk; ++r) {
    const Best b = warp_best({group_key, lane < G ? lane : -1});
    kept |= 1u << b.e;
    if (lane == b.e) group_key = kTaken;
  }
  const uint32_t masked = order_key(-INFINITY);
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    const int e = lane + 32 * i;
    if (row.has(i) && !((kept >> (e / gsize)) & 1u)) row.keys(i) = masked;
  }
}

// Returns the expert lane r < k chose (-1 on the other lanes); the row keeps the token's logits.
template <typename T, class Row>
__device__ __forceinline__ int32_t topk_fwd_row(const TopkParams& p, int64_t t, Row& row) {
  const int k = p.k, lane = row.lane;
  const float m = load_row<T>(p.logits, t, row);
  float denom = 1.f;
  if (p.pre_softmax) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < row.slots(); ++i) {
      if (row.has(i)) s += expf(row.xs(i) - m);
    }
    denom = warp_sum(s);
  }
  auto selection = [&](float x, int e) {
    if (p.score == Score::kSoftmax && !p.pre_softmax) return x;
    const float s = p.score == Score::kSoftmax ? expf(x - m) / denom : activation(p.score, x);
    return p.bias != nullptr ? s + p.bias[e] : s;
  };
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    row.keys(i) = row.has(i) ? order_key(selection(row.xs(i), lane + 32 * i)) : kTaken;
  }
  if (p.num_groups > 1) limit_groups(p, row, selection);
  row.sync();  // SmemRow::value reads other lanes' logits

  float x;
  const int32_t chosen = row_select_topk<true>(row, k, &x);
  const bool live = lane < k;
  if (!live) x = 0.f;
  float w;
  if (chosen_softmax(p.score, p.pre_softmax, p.normalize)) {
    const float mk = warp_max(live ? x : -INFINITY);
    const float ex = live ? expf(x - mk) : 0.f;
    w = ex / warp_sum(ex);
  } else if (p.score == Score::kSoftmax) {
    w = expf(x - m) / denom;
  } else {
    w = activation(p.score, x);
    if (p.normalize) w = w / (warp_sum(live ? w : 0.f) + kNormEps);
  }
  if (live) {
    p.weights[t * k + lane] = w * p.scaling_factor;
    p.indices[t * k + lane] = chosen;
  }
  return live ? chosen : -1;
}

// Register rows up to kRegExperts experts (N = 1, 2, 4 or 8 slots), shared-memory rows past it.
constexpr int kRegExperts = 256;

// Calls f(t, row) for each token this warp owns, its row a RegRow<N> (N > 0) or the warp's SmemRow (N = 0).
template <int N, typename F>
__device__ __forceinline__ void for_each_row(int64_t num_tokens, int E, F&& f) {
  for_each_token<N == 0>(num_tokens, [&](int64_t t, int lane) {
    if constexpr (N > 0) {
      RegRow<N> row(E, lane);
      f(t, row);
    } else {
      SmemRow row = smem_row(E, lane);
      f(t, row);
    }
  });
}

// N > 0: register rows (kRouterRegWarps warps a block); N = 0: shared-memory rows (router_fwd_warps(E) warps).
template <typename T, int N>
__global__ void __launch_bounds__(kRouterRegWarps * 32) topk_fwd_kernel(TopkParams p) {
  for_each_row<N>(p.num_tokens, p.num_experts, [&](int64_t t, auto& row) { topk_fwd_row<T>(p, t, row); });
}

// d loss / d x of lane's chosen expert (x its logit, g = d loss / d weight * scaling) when the weights come
// from the k chosen logits alone: softmax over them, or the activation (normalised over the k when asked).
// Every lane calls it (warp collectives); 0 on lanes without a chosen expert.
__device__ __forceinline__ float chosen_grad(Score score, bool normalize, bool live, float x, float g) {
  if (score == Score::kSoftmax) {  // w = softmax over the k chosen logits
    const float mk = warp_max(live ? x : -INFINITY);
    const float ex = live ? expf(x - mk) : 0.f;
    const float w = ex / warp_sum(ex);
    return w * (g - warp_sum(g * w));
  }
  const float s = live ? activation(score, x) : 0.f;
  float ds = g;
  if (normalize) {
    const float denom = warp_sum(s) + kNormEps;
    const float dot = warp_sum(g * (s / denom));
    ds = (g - dot) / denom;
  }
  return live ? ds * activation_grad(score, x, s) : 0.f;
}

template <typename T>
__device__ __forceinline__ void topk_bwd_token(const TopkBwdParams& p, int64_t t, int lane) {
  const int E = p.num_experts, k = p.k;
  const T* row = static_cast<const T*>(p.logits) + t * E;
  float* grad = p.grad_logits + t * E;
  int32_t e = lane < k ? p.indices[t * k + lane] : -1;
  if (e >= E) e = -1;  // never out of bounds, whatever the indices hold
  const bool live = e >= 0;
  const float x = live ? load(row, e) : 0.f;
  const float g = live ? p.grad_weights[t * k + lane] * p.scaling_factor : 0.f;

  if (softmax_over_all(p.score, p.pre_softmax, p.normalize)) {
    // w = softmax(x)[chosen]: every logit gets s_e * (G_e - sum_r g_r w_r).
    float m = -INFINITY;
    for (int i = lane; i < E; i += 32) m = fmaxf(m, load(row, i));
    m = warp_max(m);
    float s = 0.f;
    for (int i = lane; i < E; i += 32) s += expf(load(row, i) - m);
    const float denom = warp_sum(s);
    const float w = live ? expf(x - m) / denom : 0.f;
    const float dot = warp_sum(g * w);
    for (int i = lane; i < E; i += 32) grad[i] = -(expf(load(row, i) - m) / denom) * dot;
    __syncwarp();
    if (live) grad[e] = w * (g - dot);
    return;
  }
  for (int i = lane; i < E; i += 32) grad[i] = 0.f;
  __syncwarp();
  const float dx = chosen_grad(p.score, p.normalize, live, x, g);
  if (live) grad[e] = dx;
}

template <typename T>
__global__ void topk_bwd_kernel(TopkBwdParams p) {
  for_each_token<false>(p.num_tokens, [&](int64_t t, int lane) { topk_bwd_token<T>(p, t, lane); });
}

// ---------------------------------------------------------------------------------------------------
// Few experts (E <= 16: Mixtral's and Grok's 8, DBRX's and Phi-3.5-MoE's 16) without a group limit: one
// thread per token, the row in registers (N = 8 or 16 slots). A warp per token left 32 - E lanes idle and
// spent each of the k picks on two warp reductions. The results are the warp kernels' bit for bit: every
// order-dependent sum is the warp's xor butterfly, replayed on N slots (the lanes past them hold +0), and
// every pick takes the largest key, the lower index on ties.

constexpr int kSmallExperts = 16;
constexpr int kSmallThreads = 256;

// The sum warp_sum gives when lanes [0, n) hold v and the others +0 (n <= N <= 16): the offsets past N add
// +0 (once is enough: x + 0 + 0 = x + 0), then the butterfly over the N slots.
template <int N>
__device__ __forceinline__ float butterfly_sum(const float (&v)[N], int n) {
  float a[N];
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = (i < n ? v[i] : 0.f) + 0.f;
#pragma unroll
  for (int off = N / 2; off > 0; off /= 2) {
#pragma unroll
    for (int i = 0; i < off; ++i) a[i] = a[i] + a[i + off];
  }
  return a[0];
}

// Largest key among [lo, hi) (lower index on ties); {kTaken, -1} if every one is taken.
template <int N>
__device__ __forceinline__ Best small_best(const uint32_t (&key)[N], int lo, int hi) {
  Best b{kTaken, -1};
#pragma unroll
  for (int e = 0; e < N; ++e) {
    if (e >= lo && e < hi && key[e] > b.key) b = {key[e], e};
  }
  return b;
}

template <typename T, int N>
__device__ __forceinline__ void topk_fwd_small_token(const TopkParams& p, int64_t t) {
  const int E = p.num_experts, k = p.k;
  const T* row = static_cast<const T*>(p.logits) + t * E;
  float x[N];
  float m = -INFINITY;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    x[e] = e < E ? load(row, e) : 0.f;
    if (e < E) m = fmaxf(m, x[e]);
  }
  float denom = 1.f;
  if (p.pre_softmax) {
    float s[N];
#pragma unroll
    for (int e = 0; e < N; ++e) s[e] = e < E ? expf(x[e] - m) : 0.f;
    denom = butterfly_sum(s, E);
  }
  auto selection = [&](int e) {
    if (p.score == Score::kSoftmax && !p.pre_softmax) return x[e];
    const float s = p.score == Score::kSoftmax ? expf(x[e] - m) / denom : activation(p.score, x[e]);
    return p.bias != nullptr ? s + p.bias[e] : s;
  };
  uint32_t key[N];
#pragma unroll
  for (int e = 0; e < N; ++e) key[e] = e < E ? order_key(selection(e)) : kTaken;

  float xc[N];  // the chosen logits, pick order
#pragma unroll
  for (int r = 0; r < N; ++r) {
    xc[r] = 0.f;
    if (r < k) {
      const Best b = small_best(key, 0, E);
      p.indices[t * k + r] = b.e;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (e == b.e) key[e] = kTaken, xc[r] = x[e];
      }
    }
  }
  float w[N];
  if (chosen_softmax(p.score, p.pre_softmax, p.normalize)) {
    float mk = -INFINITY;
#pragma unroll
    for (int r = 0; r < N; ++r) mk = r < k ? fmaxf(mk, xc[r]) : mk;
    float ex[N];
#pragma unroll
    for (int r = 0; r < N; ++r) ex[r] = r < k ? expf(xc[r] - mk) : 0.f;
    const float sum = butterfly_sum(ex, k);
#pragma unroll
    for (int r = 0; r < N; ++r) w[r] = ex[r] / sum;
  } else if (p.score == Score::kSoftmax) {
#pragma unroll
    for (int r = 0; r < N; ++r) w[r] = expf(xc[r] - m) / denom;
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) w[r] = activation(p.score, xc[r]);
    if (p.normalize) {
      const float total = butterfly_sum(w, k) + kNormEps;
#pragma unroll
      for (int r = 0; r < N; ++r) w[r] = w[r] / total;
    }
  }
#pragma unroll
  for (int r = 0; r < N; ++r) {
    if (r < k) p.weights[t * k + r] = w[r] * p.scaling_factor;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kSmallThreads) topk_fwd_small_kernel(TopkParams p) {
  for (int64_t t = int64_t(blockIdx.x) * kSmallThreads + threadIdx.x; t < p.num_tokens;
       t += int64_t(gridDim.x) * kSmallThreads) {
    topk_fwd_small_token<T, N>(p, t);
  }
}

template <typename T, int N>
__device__ __forceinline__ void topk_bwd_small_token(const TopkBwdParams& p, int64_t t) {
  const int E = p.num_experts, k = p.k;
  const T* row = static_cast<const T*>(p.logits) + t * E;
  float* grad = p.grad_logits + t * E;
  int32_t e_r[N];
  float x[N], g[N];
#pragma unroll
  for (int r = 0; r < N; ++r) {
    int32_t e = r < k ? p.indices[t * k + r] : -1;
    if (e >= E) e = -1;  // never out of bounds, whatever the indices hold
    e_r[r] = e;
    x[r] = e >= 0 ? load(row, e) : 0.f;
    g[r] = e >= 0 ? p.grad_weights[t * k + r] * p.scaling_factor : 0.f;
  }
  float out[N];
  float dx[N];
  if (softmax_over_all(p.score, p.pre_softmax, p.normalize)) {  // as topk_bwd_token
    float xs[N];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      xs[i] = i < E ? load(row, i) : 0.f;
      if (i < E) m = fmaxf(m, xs[i]);
    }
    float s[N];
#pragma unroll
    for (int i = 0; i < N; ++i) s[i] = i < E ? expf(xs[i] - m) : 0.f;
    const float denom = butterfly_sum(s, E);
    float w[N], gw[N];
#pragma unroll
    for (int r = 0; r < N; ++r) {
      w[r] = e_r[r] >= 0 ? expf(x[r] - m) / denom : 0.f;
      gw[r] = g[r] * w[r];
    }
    const float dot = butterfly_sum(gw, k);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = -(expf(xs[i] - m) / denom) * dot;
#pragma unroll
    for (int r = 0; r < N; ++r) dx[r] = w[r] * (g[r] - dot);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = 0.f;
    if (p.score == Score::kSoftmax) {  // as chosen_grad: softmax over the k chosen logits
      float mk = -INFINITY;
#pragma unroll
      for (int r = 0; r < N; ++r) mk = e_r[r] >= 0 ? fmaxf(mk, x[r]) : mk;
      float ex[N], w[N], gw[N];
#pragma unroll
      for (int r = 0; r < N; ++r) ex[r] = e_r[r] >= 0 ? expf(x[r] - mk) : 0.f;
      const float sum = butterfly_sum(ex, k);
#pragma unroll
      for (int r = 0; r < N; ++r) w[r] = ex[r] / sum, gw[r] = g[r] * w[r];
      const float dot = butterfly_sum(gw, k);
#pragma unroll
      for (int r = 0; r < N; ++r) dx[r] = w[r] * (g[r] - dot);
    } else {
      float s[N], ds[N];
#pragma unroll
      for (int r = 0; r < N; ++r) s[r] = e_r[r] >= 0 ? activation(p.score, x[r]) : 0.f, ds[r] = g[r];
      if (p.normalize) {
        const float denom = butterfly_sum(s, k) + kNormEps;
        float gs[N];
#pragma unroll
        for (int r = 0; r < N; ++r) gs[r] = g[r] * (s[r] / denom);
        const float dot = butterfly_sum(gs, k);
#pragma unroll
        for (int r = 0; r < N; ++r) ds[r] = (g[r] - dot) / denom;
      }
#pragma unroll
      for (int r = 0; r < N; ++r) {
        dx[r] = e_r[r] >= 0 ? ds[r] * activation_grad(p.score, x[r], s[r]) : 0.f;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i < E) grad[i] = out[i];
  }
#pragma unroll
  for (int r = 0; r < N; ++r) {  // the chosen experts' entries, after the row's (the thread's own stores, in order)
    if (e_r[r] >= 0) grad[e_r[r]] = dx[r];
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kSmallThreads) topk_bwd_small_kernel(TopkBwdParams p) {
  for (int64_t t = int64_t(blockIdx.x) * kSmallThreads + threadIdx.x; t < p.num_tokens;
       t += int64_t(gridDim.x) * kSmallThreads) {
    topk_bwd_small_token<T, N>(p, t);
  }
}

template <typename T, class Row>
__device__ __forceinline__ void aux_scores_fwd_row(const AuxScoresParams& p, int64_t t, Row& row) {
  const int E = p.num_experts, lane = row.lane;
  const T* src = static_cast<const T*>(p.logits) + t * E;
  float* scores = p.scores + t * E;

  float m = -INFINITY, total = 0.f;
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    if (!row.has(i)) continue;
    const float x = load(src, lane + 32 * i);
    if (p.score == Score::kSoftmax) {
      row.xs(i) = x;
      m = fmaxf(m, x);
    } else {
      row.xs(i) = activation(p.score, x);
      total += row.xs(i);
    }
  }
  if (p.score == Score::kSoftmax) {
    m = warp_max(m);
#pragma unroll
    for (int i = 0; i < row.slots(); ++i) {
      if (row.has(i)) total += expf(row.xs(i) - m);
    }
  }
  const float denom = p.score == Score::kSoftmax ? warp_sum(total) : warp_sum(total) + kNormEps;
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    if (!row.has(i)) {
      row.keys(i) = kTaken;
      continue;
    }
    const float s = (p.score == Score::kSoftmax ? expf(row.xs(i) - m) : row.xs(i)) / denom;
    scores[lane + 32 * i] = s;
    row.keys(i) = order_key(s);
  }
  const int32_t chosen = row_select_topk<false>(row, p.k, nullptr);
  if (lane < p.k) p.indices[t * p.k + lane] = chosen;
}

template <typename T, int N>
__global__ void __launch_bounds__(kRouterRegWarps * 32) aux_scores_fwd_kernel(AuxScoresParams p) {
  for_each_row<N>(p.num_tokens, p.num_experts, [&](int64_t t, auto& row) { aux_scores_fwd_row<T>(p, t, row); });
}

template <typename T>
__device__ __forceinline__ void aux_scores_bwd_token(const AuxScoresBwdParams& p, int64_t t, int lane) {
  const int E = p.num_experts;
  const T* row = static_cast<const T*>(p.logits) + t * E;
  const float* g = p.grad_scores + t * E;
  float* grad = p.grad_logits + t * E;
  if (p.score == Score::kSoftmax) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, load(row, e));
    m = warp_max(m);
    float s = 0.f;
    for (int e = lane; e < E; e += 32) s += expf(load(row, e) - m);
    const float denom = warp_sum(s);
    float dot = 0.f;
    for (int e = lane; e < E; e += 32) dot += g[e] * (expf(load(row, e) - m) / denom);
    dot = warp_sum(dot);
    for (int e = lane; e < E; e += 32) {
      const float pe = expf(load(row, e) - m) / denom;
      grad[e] = pe * (g[e] - dot);
    }
    return;
  }
  float total = 0.f;
  for (int e = lane; e < E; e += 32) total += activation(p.score, load(row, e));
  const float denom = warp_sum(total) + kNormEps;
  float dot = 0.f;
  for (int e = lane; e < E; e += 32) dot += g[e] * (activation(p.score, load(row, e)) / denom);
  dot = warp_sum(dot);
  for (int e = lane; e < E; e += 32) {
    const float x = load(row, e);
    const float s = activation(p.score, x);
    grad[e] = (g[e] - dot) / denom * activation_grad(p.score, x, s);
  }
}

template <typename T>
__global__ void aux_scores_bwd_kernel(AuxScoresBwdParams p) {
  for_each_token<false>(p.num_tokens, [&](int64_t t, int lane) { aux_scores_bwd_token<T>(p, t, lane); });
}

// ---------------------------------------------------------------------------------------------------
// The fused router (router.h, FusedParams): top-k, counts and the losses' statistics in one launch.

struct FusedLayout {
  int64_t seq;            // rows per sequence (T when the sequence loss is off)
  int64_t chunks_per_seq;
  int64_t chunks;
  bool stats;             // aux or sequence loss on: aux scores, their top-k and sums
  bool z;
};

FusedLayout fused_layout(const FusedParams& p) {
  const int64_t T = p.topk.num_tokens;
  FusedLayout L{};
  L.seq = p.seq_scale != 0.f ? p.seq_len : (T > 0 ? T : 1);
  L.chunks_per_seq = (L.seq + kFusedChunkRows - 1) / kFusedChunkRows;
  L.chunks = (T / L.seq) * L.chunks_per_seq;
  L.stats = p.aux_scale != 0.f || p.seq_scale != 0.f;
  L.z = p.z_coeff != 0.f;
  return L;
}

// The workspace: per chunk, the aux scores' sums [E] (stats), the top-k picks [E], the aux picks [E] (stats)
// and the sum of lse^2 (z); each region 256-byte aligned.
struct FusedPartials {
  float* sums;
  int32_t* picks;
  int32_t* aux_picks;
  float* lse2;
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t fused_partials_bytes(const FusedLayout& L, int E) {
  const size_t n = size_t(L.chunks) * E;
  return align256(n * 4) * (L.stats ? 3 : 1) + align256(size_t(L.chunks) * 4);
}

FusedPartials fused_partials(void* ws, const FusedLayout& L, int E) {
  char* b = static_cast<char*>(ws);
  const size_t n = align256(size_t(L.chunks) * E * 4);
  FusedPartials q{};
  q.picks = reinterpret_cast<int32_t*>(b);
  b += n;
  if (L.stats) {
    q.sums = reinterpret_cast<float*>(b);
    q.aux_picks = reinterpret_cast<int32_t*>(b + n);
    b += 2 * n;
  }
  q.lse2 = reinterpret_cast<float*>(b);
  return q;
}

// Warps per block of the fused forward: each warp's logits, keys and score sums (12 E bytes) and the block's
// two count arrays (8 E bytes) within 48 KB.
int fused_warps(int E) {
  const int w = (kSmemBytes - 8 * E - 128) / (12 * E);  // 128: the W-float arrays and static shared memory
  return w < 1 ? 1 : (w > 8 ? 8 : w);
}

// Deterministic block sum: warps in order. `red` holds one float per warp. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < W; ++w) total += red[w];
  return total;
}

// The forward's last block: the counts over every chunk, the aux scores' sums and picks per sequence, and the
// loss. `lanes` reuses the dynamic shared memory (fused_fwd sizes it for both uses); `red` holds one float a
// warp. With several sequences, each sequence's sums go back into its first chunk's row of the workspace and
// are added per expert in sequence order.
template <int VEC>
__device__ void fused_finish(const FusedParams& p, const FusedLayout& L, const FusedPartials& q, ChunkLane<VEC>* lanes,
                             float* red) {
  constexpr int kAcc = 4;  // loads in flight a lane; the kernel's registers stay those of its chunk loop
  const int E = p.topk.num_experts;
  if (p.counts != nullptr) {
    chunk_column_sums<VEC, kAcc>(nullptr, q.picks, E, 1, L.chunks, lanes,
                                 [&](int64_t, int64_t e, float, int32_t n) { p.counts[e] = n; });
  }
  float aux_part = 0.f, seq_part = 0.f, z = 0.f;
  if (L.stats) {
    const int64_t B = L.chunks / (L.chunks_per_seq > 0 ? L.chunks_per_seq : 1);
    chunk_column_sums<VEC, kAcc>(q.sums, q.aux_picks, E, B, L.chunks_per_seq, lanes,
                                 [&](int64_t b, int64_t e, float sb, int32_t nb) {
                                   if (p.seq_scale != 0.f) {
                                     p.seq_counts[b * E + e] = nb;
                                     seq_part += sb * float(nb);
                                   }
                                   if (B == 1) {
                                     if (p.aux_scale != 0.f) p.aux_counts[e] = nb, aux_part += sb * float(nb);
                                   } else {
                                     const int64_t at = b * L.chunks_per_seq * E + e;
                                     q.sums[at] = sb;
                                     q.aux_picks[at] = nb;
                                   }
                                 });
    if (B != 1 && p.aux_scale != 0.f) {  // (no sequence: zero counts)
      __syncthreads();  // the per-sequence sums above, written by other threads of this block
      for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float total = 0.f;
        int32_t n_aux = 0;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t at = b * L.chunks_per_seq * E + e;
          total += __ldcg(&q.sums[at]);
          n_aux += __ldcg(&q.aux_picks[at]);
        }
        p.aux_counts[e] = n_aux;
        aux_part += total * float(n_aux);
      }
    }
    aux_part = block_sum(aux_part, red);
    seq_part = block_sum(seq_part, red);
  }
  if (L.z) {
    __syncthreads();  // block_sum's last reads of `red`, which the lanes overlap
    chunk_column_sums<1, 4>(q.lse2, nullptr, 1, 1, L.chunks, reinterpret_cast<ChunkLane<1>*>(lanes),
                            [&](int64_t, int64_t, float s, int32_t) { z = s; });
  }
  if (threadIdx.x == 0) {  // the thread that took the z sum (item 0, lane 0)
    bool any = false;
    float loss = 0.f;
    if (p.aux_scale != 0.f) loss = p.aux_scale * aux_part, any = true;
    if (p.seq_scale != 0.f) loss = any ? loss + p.seq_scale * seq_part : p.seq_scale * seq_part, any = true;
    if (L.z) {
      const float zl = p.topk.num_tokens > 0 ? p.z_coeff * (z / float(p.topk.num_tokens)) : 0.f;
      loss = any ? loss + zl : zl;
    }
    *p.loss = loss;
    *p.counter = 0u;  // ready for the next launch on this stream
  }
}

// One token of the fused forward: its top-k (counted in `picks`), then, with a loss on, the statistics: the
// aux scores summed per expert into `my_acc` and their top-k counted in `aux_picks` (stats), lse^2 (z).
template <typename T, class Row>
__device__ __forceinline__ void fused_fwd_row(const FusedParams& p, const FusedLayout& L, int64_t t, Row& row,
                                              float* my_acc, int32_t* picks, int32_t* aux_picks, float* lse2) {
  const TopkParams& tp = p.topk;
  const int k = tp.k, lane = row.lane;
  const int32_t chosen = topk_fwd_row<T>(tp, t, row);
  if (chosen >= 0) atomicAdd(&picks[chosen], 1);  // integer counts: exact in any order
  row.sync();
  if (!L.stats && !L.z) return;
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    if (row.has(i)) m = fmaxf(m, row.xs(i));
  }
  m = warp_max(m);
  float se = 0.f;
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    if (row.has(i)) se += expf(row.xs(i) - m);
  }
  se = warp_sum(se);  // sum of exp(x - m): softmax's denominator, and lse = m + log(se)
  if (L.z && lane == 0) {
    const float lse = m + logf(se);
    lse2[threadIdx.x / 32] += lse * lse;
  }
  if (!L.stats) return;
  float denom = se;
  if (tp.score != Score::kSoftmax) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < row.slots(); ++i) {
      if (row.has(i)) total += activation(tp.score, row.xs(i));
    }
    denom = warp_sum(total) + kNormEps;
  }
#pragma unroll
  for (int i = 0; i < row.slots(); ++i) {
    if (!row.has(i)) {
      row.keys(i) = kTaken;
      continue;
    }
    const float x = row.xs(i);
    const float s = (tp.score == Score::kSoftmax ? expf(x - m) : activation(tp.score, x)) / denom;
    my_acc[lane + 32 * i] += s;
    row.keys(i) = order_key(s);
  }
  const int32_t aux = row_select_topk<false>(row, k, nullptr);
  if (lane < k && aux >= 0) atomicAdd(&aux_picks[aux], 1);
}

// N > 0: register rows (E <= 32 N); N = 0: shared-memory rows (the first 8 E bytes a warp of the dynamic shared
// memory).
template <typename T, int N>
__global__ void __launch_bounds__(256, N > 0 ? 3 : 4) fused_fwd_kernel(FusedParams p, FusedLayout L, FusedPartials q) {
  extern __shared__ float smem[];
  const TopkParams& tp = p.topk;
  const int E = tp.num_experts;
  const int W = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* acc = smem + (N > 0 ? 0 : size_t(W) * 2 * E);  // [W, E] this chunk's aux scores summed per warp
  float* my_acc = acc + size_t(warp) * E;
  int32_t* picks = reinterpret_cast<int32_t*>(acc + size_t(W) * E);  // [E]
  int32_t* aux_picks = picks + E;                                     // [E]
  float* lse2 = reinterpret_cast<float*>(aux_picks + E);              // [W]
  float* red = lse2 + W;                                              // [W]

  for (int64_t c = blockIdx.x; c < L.chunks; c += gridDim.x) {
    for (int i = threadIdx.x; i < W * E; i += blockDim.x) acc[i] = 0.f;
    for (int i = threadIdx.x; i < 2 * E; i += blockDim.x) picks[i] = 0;
    if (threadIdx.x < W) lse2[threadIdx.x] = 0.f;
    __syncthreads();
    const int64_t b = c / L.chunks_per_seq, j = c % L.chunks_per_seq;
    const int64_t r0 = b * L.seq + j * kFusedChunkRows;
    const int64_t r1 = r0 + kFusedChunkRows < (b + 1) * L.seq ? r0 + kFusedChunkRows : (b + 1) * L.seq;
    for (int64_t t = r0 + warp; t < r1; t += W) {
      if constexpr (N > 0) {
        RegRow<N> row(E, lane);
        fused_fwd_row<T>(p, L, t, row, my_acc, picks, aux_picks, lse2);
      } else {
        SmemRow row = smem_row(E, lane);
        fused_fwd_row<T>(p, L, t, row, my_acc, picks, aux_picks, lse2);
      }
      __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      q.picks[c * E + e] = picks[e];
      if (L.stats) {
        float s = 0.f;
        for (int w = 0; w < W; ++w) s += acc[size_t(w) * E + e];
        q.sums[c * E + e] = s;
        q.aux_picks[c * E + e] = aux_picks[e];
      }
    }
    if (L.z && threadIdx.x == 0) {
      float s = 0.f;
      for (int w = 0; w < W; ++w) s += lse2[w];
      q.lse2[c] = s;
    }
    __syncthreads();
  }

  // The last block to finish adds the partials of every chunk (common/chunk_sums.cuh: the chunks split over
  // lanes, 16-byte loads where E % 4 == 0, a fixed order).
  if (!is_last_block(p.counter)) return;
  if (E % 4 == 0) {
    fused_finish<4>(p, L, q, reinterpret_cast<ChunkLane<4>*>(smem), red);
  } else {
    fused_finish<1>(p, L, q, reinterpret_cast<ChunkLane<1>*>(smem), red);
  }
}

// grad_logits[t] = the top-k backward of grad_weights + the aux scores' backward of
// G[t, e] = grad_loss * (aux_scale * aux_counts[e] + seq_scale * seq_counts[b(t), e]) + the z loss's
// grad_loss * z_coeff * 2 / T * lse_t * softmax(x_t)[e].
template <typename T>
__device__ __forceinline__ void fused_bwd_token(const FusedBwdParams& p, int64_t t, float* xs, float* gb, int lane) {
  const TopkBwdParams& tp = p.topk;
  const int E = tp.num_experts, k = tp.k;
  const T* row = static_cast<const T*>(tp.logits) + t * E;
  float* grad = tp.grad_logits + t * E;
  const bool stats = p.aux_scale != 0.f || p.seq_scale != 0.f, z = p.z_coeff != 0.f;
  const float gl = p.grad_loss != nullptr ? *p.grad_loss : 0.f;

  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    xs[e] = load(row, e);
    m = fmaxf(m, xs[e]);
  }
  m = warp_max(m);
  float se = 0.f;
  for (int e = lane; e < E; e += 32) se += expf(xs[e] - m);
  se = warp_sum(se);

  for (int e = lane; e < E; e += 32) gb[e] = 0.f;
  if (stats) {
    const int32_t* cs = p.seq_scale != 0.f ? p.seq_counts + (t / p.seq_len) * E : nullptr;
    auto G = [&](int e) {
      float g = p.aux_scale != 0.f ? gl * p.aux_scale * float(p.aux_counts[e]) : 0.f;
      if (cs != nullptr) g = g + gl * p.seq_scale * float(cs[e]);
      return g;
    };
    if (tp.score == Score::kSoftmax) {
      float dot = 0.f;
      for (int e = lane; e < E; e += 32) dot += G(e) * (expf(xs[e] - m) / se);
      dot = warp_sum(dot);
      for (int e = lane; e < E; e += 32) gb[e] = (expf(xs[e] - m) / se) * (G(e) - dot);
    } else {
      float total = 0.f;
      for (int e = lane; e < E; e += 32) total += activation(tp.score, xs[e]);
      const float denom = warp_sum(total) + kNormEps;
      float dot = 0.f;
      for (int e = lane; e < E; e += 32) dot += G(e) * (activation(tp.score, xs[e]) / denom);
      dot = warp_sum(dot);
      for (int e = lane; e < E; e += 32) {
        const float s = activation(tp.score, xs[e]);
        gb[e] = (G(e) - dot) / denom * activation_grad(tp.score, xs[e], s);
      }
    }
  }
  if (z && tp.num_tokens > 0) {
    const float lse = m + logf(se);
    const float zg = gl * p.z_coeff * 2.f / float(tp.num_tokens) * lse;
    for (int e = lane; e < E; e += 32) gb[e] = gb[e] + zg * (expf(xs[e] - m) / se);
  }
  __syncwarp();

  // The top-k backward, as topk_bwd_token, added to the dense part.
  int32_t e = lane < k ? tp.indices[t * k + lane] : -1;
  if (e >= E) e = -1;
  const bool live = e >= 0;
  const float x = live ? xs[e] : 0.f;
  const float g = live ? tp.grad_weights[t * k + lane] * tp.scaling_factor : 0.f;
  if (softmax_over_all(tp.score, tp.pre_softmax, tp.normalize)) {
    const float w = live ? expf(x - m) / se : 0.f;
    const float dot = warp_sum(g * w);
    for (int i = lane; i < E; i += 32) grad[i] = -(expf(xs[i] - m) / se) * dot + gb[i];
    __syncwarp();
    if (live) grad[e] = w * (g - dot) + gb[e];
    return;
  }
  for (int i = lane; i < E; i += 32) grad[i] = gb[i];
  __syncwarp();
  const float dx = chosen_grad(tp.score, tp.normalize, live, x, g);
  if (live) grad[e] = dx + gb[e];
}

template <typename T>
__global__ void fused_bwd_kernel(FusedBwdParams p) {
  for_each_token<true>(p.topk.num_tokens, [&](int64_t t, int lane) {
    SmemRow row = smem_row(p.topk.num_experts, lane);
    fused_bwd_token<T>(p, t, row.x, reinterpret_cast<float*>(row.key), lane);
  });
}

void check_sizes(int E, int k, const char* what) {
  if (E < 1 || E > kMaxExperts) throw std::invalid_argument(std::string(what) + ": num_experts out of range");
  if (k < 1 || k > kMaxK || k > E) throw std::invalid_argument(std::string(what) + ": k out of range");
}

}  // namespace

int router_fwd_warps(int num_experts) {
  if (num_experts < 1) throw std::invalid_argument("router_fwd_warps: num_experts must be positive");
  const int w = kSmemBytes / (8 * num_experts);
  return w < 1 ? 1 : (w > 8 ? 8 : w);
}

// Register-row slots a lane for E experts (1, 2, 4 or 8), 0 past kRegExperts (shared-memory rows).
int reg_slots(int E) { return E <= 32 ? 1 : E <= 64 ? 2 : E <= 128 ? 4 : E <= kRegExperts ? 8 : 0; }

// f.template operator()<N>() for N = reg_slots(E) (0: shared-memory rows).
template <typename F>
void with_reg_slots(int E, F&& f) {
  switch (reg_slots(E)) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 4: f.template operator()<4>(); break;
    case 8: f.template operator()<8>(); break;
    default: f.template operator()<0>(); break;
  }
}

int64_t router_blocks(int64_t num_tokens, int warps_per_block) {
  if (num_tokens < 0 || warps_per_block < 1) throw std::invalid_argument("router_blocks: bad sizes");
  const int64_t want = num_tokens / warps_per_block + (num_tokens % warps_per_block != 0);  // no overflow at INT64_MAX
  return want < kMaxRouterBlocks ? want : kMaxRouterBlocks;
}

void topk_fwd(const TopkParams& p, cudaStream_t stream) {
  check_sizes(p.num_experts, p.k, "router_topk");
  if (p.num_groups < 1 || p.num_groups > kMaxGroups || p.num_experts % p.num_groups ||
      p.group_topk < 1 || p.group_topk > p.num_groups || p.group_score_topk < 1 ||
      p.group_score_topk > p.num_experts / p.num_groups) {
    throw std::invalid_argument("router_topk: invalid group configuration");
  }
  if (p.num_tokens == 0) return;
  if (p.num_experts <= kSmallExperts && p.num_groups == 1) {
    const unsigned blocks = unsigned(router_blocks(p.num_tokens, kSmallThreads));  // a token a thread
    by_float_dtype(p.dtype, "router_topk", [&]<typename T>() {
      if (p.num_experts <= 8) {
        topk_fwd_small_kernel<T, 8><<<blocks, kSmallThreads, 0, stream>>>(p);
      } else {
        topk_fwd_small_kernel<T, 16><<<blocks, kSmallThreads, 0, stream>>>(p);
      }
    });
    check_launch("router topk_fwd_small_kernel");
    return;
  }
  const bool regs = reg_slots(p.num_experts) > 0;
  const int W = regs ? kRouterRegWarps : router_fwd_warps(p.num_experts);
  const unsigned blocks = unsigned(router_blocks(p.num_tokens, W));
  const size_t smem = regs ? 0 : size_t(W) * 8 * p.num_experts;
  by_float_dtype(p.dtype, "router_topk", [&]<typename T>() {
    with_reg_slots(p.num_experts, [&]<int N>() { topk_fwd_kernel<T, N><<<blocks, W * 32, smem, stream>>>(p); });
  });
  check_launch("router topk_fwd_kernel");
}

void topk_bwd(const TopkBwdParams& p, cudaStream_t stream) {
  check_sizes(p.num_experts, p.k, "router_topk backward");
  if (p.num_tokens == 0) return;
  if (p.num_experts <= kSmallExperts) {
    const unsigned blocks = unsigned(router_blocks(p.num_tokens, kSmallThreads));  // a token a thread
    by_float_dtype(p.dtype, "router_topk backward", [&]<typename T>() {
      if (p.num_experts <= 8) {
        topk_bwd_small_kernel<T, 8><<<blocks, kSmallThreads, 0, stream>>>(p);
      } else {
        topk_bwd_small_kernel<T, 16><<<blocks, kSmallThreads, 0, stream>>>(p);
      }
    });
    check_launch("router topk_bwd_small_kernel");
    return;
  }
  const unsigned blocks = unsigned(router_blocks(p.num_tokens, kRouterBwdWarps));
  by_float_dtype(p.dtype, "router_topk backward", [&]<typename T>() {
    topk_bwd_kernel<T><<<blocks, kRouterBwdWarps * 32, 0, stream>>>(p);
  });
  check_launch("router topk_bwd_kernel");
}

void aux_scores_fwd(const AuxScoresParams& p, cudaStream_t stream) {
  check_sizes(p.num_experts, p.k, "router_aux_scores");
  if (p.num_tokens == 0) return;
  const bool regs = reg_slots(p.num_experts) > 0;
  const int W = regs ? kRouterRegWarps : router_fwd_warps(p.num_experts);
  const unsigned blocks = unsigned(router_blocks(p.num_tokens, W));
  const size_t smem = regs ? 0 : size_t(W) * 8 * p.num_experts;
  by_float_dtype(p.dtype, "router_aux_scores", [&]<typename T>() {
    with_reg_slots(p.num_experts, [&]<int N>() { aux_scores_fwd_kernel<T, N><<<blocks, W * 32, smem, stream>>>(p); });
  });
  check_launch("router aux_scores_fwd_kernel");
}

void aux_scores_bwd(const AuxScoresBwdParams& p, cudaStream_t stream) {
  check_sizes(p.num_experts, 1, "router_aux_scores backward");
  if (p.num_tokens == 0) return;
  const unsigned blocks = unsigned(router_blocks(p.num_tokens, kRouterBwdWarps));
  by_float_dtype(p.dtype, "router_aux_scores backward", [&]<typename T>() {
    aux_scores_bwd_kernel<T><<<blocks, kRouterBwdWarps * 32, 0, stream>>>(p);
  });
  check_launch("router aux_scores_bwd_kernel");
}

int router_fused_warps(int num_experts) {
  if (num_experts < 1) throw std::invalid_argument("router_fused_warps: num_experts must be positive");
  return fused_warps(num_experts);
}

size_t fused_workspace_bytes(const FusedParams& p) {
  return fused_partials_bytes(fused_layout(p), p.topk.num_experts);
}

void fused_fwd(const FusedParams& p, cudaStream_t stream) {
  const TopkParams& tp = p.topk;
  check_sizes(tp.num_experts, tp.k, "router_fused");
  if (tp.num_experts > kFusedMaxExperts) throw std::invalid_argument("router_fused: num_experts out of range");
  if (tp.num_groups < 1 || tp.num_groups > kMaxGroups || tp.num_experts % tp.num_groups ||
      tp.group_topk < 1 || tp.group_topk > tp.num_groups || tp.group_score_topk < 1 ||
      tp.group_score_topk > tp.num_experts / tp.num_groups) {
    throw std::invalid_argument("router_fused: invalid group configuration");
  }
  if (tp.num_tokens < 0) throw std::invalid_argument("router_fused: negative num_tokens");
  if (p.seq_scale != 0.f && (p.seq_len < 1 || tp.num_tokens % p.seq_len)) {
    throw std::invalid_argument("router_fused: the rows are not whole sequences of seq_len");
  }
  if (p.loss == nullptr || p.counter == nullptr) throw std::invalid_argument("router_fused: loss and counter needed");
  if ((p.aux_scale != 0.f && p.aux_counts == nullptr) ||
      (p.seq_scale != 0.f && p.seq_counts == nullptr && tp.num_tokens > 0)) {
    throw std::invalid_argument("router_fused: a loss is on without its counts");
  }
  const FusedLayout L = fused_layout(p);
  if (p.workspace_bytes < fused_partials_bytes(L, tp.num_experts)) {
    throw std::invalid_argument("router_fused: workspace too small");
  }
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16) {  // the last block's 16-byte loads of the partials (E % 4 == 0)
    throw std::invalid_argument("router_fused: workspace must be 16-byte aligned");
  }
  const int E = tp.num_experts, W = fused_warps(E);
  const int64_t want = L.chunks > 0 ? L.chunks : 1;  // one block at least: it writes the counts and the loss
  const unsigned blocks = unsigned(want < kMaxRouterBlocks ? want : kMaxRouterBlocks);
  // The chunk loop's arrays (the warps' shared-memory rows where E takes them, the score sums, the counts), or the
  // last block's lanes (common/chunk_sums.cuh) if they are larger (small E).
  const bool regs = reg_slots(E) > 0;
  const size_t chunk_smem = size_t(W) * (regs ? 4 : 12) * E + 8 * size_t(E) + 8 * size_t(W);
  const size_t lanes_smem = chunk_lanes_bytes<4>(W * 32);
  const size_t smem = chunk_smem > lanes_smem ? chunk_smem : lanes_smem;
  const FusedPartials q = fused_partials(p.workspace, L, E);
  by_float_dtype(tp.dtype, "router_fused", [&]<typename T>() {
    with_reg_slots(E, [&]<int N>() { fused_fwd_kernel<T, N><<<blocks, W * 32, smem, stream>>>(p, L, q); });
  });
  check_launch("router fused_fwd_kernel");
}

void fused_bwd(const FusedBwdParams& p, cudaStream_t stream) {
  const TopkBwdParams& tp = p.topk;
  check_sizes(tp.num_experts, tp.k, "router_fused backward");
  if (p.seq_scale != 0.f && (p.seq_len < 1 || tp.num_tokens % p.seq_len)) {
    throw std::invalid_argument("router_fused backward: the rows are not whole sequences of seq_len");
  }
  if ((p.aux_scale != 0.f && p.aux_counts == nullptr) ||
      (p.seq_scale != 0.f && p.seq_counts == nullptr && tp.num_tokens > 0)) {
    throw std::invalid_argument("router_fused backward: a loss is on without its counts");
  }
  if (tp.num_tokens == 0) return;
  const int W = router_fwd_warps(tp.num_experts);
  const unsigned blocks = unsigned(router_blocks(tp.num_tokens, W));
  const size_t smem = size_t(W) * 8 * tp.num_experts;
  by_float_dtype(tp.dtype, "router_fused backward", [&]<typename T>() {
    fused_bwd_kernel<T><<<blocks, W * 32, smem, stream>>>(p);
  });
  check_launch("router fused_bwd_kernel");
}

}  // namespace moe::router
