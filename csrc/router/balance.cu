// Load-balancing losses (aux, sequence-wise aux, z) and the expert-bias update.
//
// The aux losses run one launch: each block reads a fixed chunk of rows of the [T, E] input once (column
// sums, with the sequence's expert counts taken from the indices in the same pass) and the last block to
// finish (an atomic ticket on a counter it leaves at zero) adds the chunks' partials in a fixed order. z_loss
// runs a partial kernel (log-sum-exp per row) and one finalize block. Results do not depend on scheduling:
// the same input gives the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>

#include "common/check.h"
#include "common/chunk_sums.cuh"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "router/balance.h"

namespace moe::router {
namespace {

constexpr int kPartialThreads = 256;
constexpr int kFinalThreads = 1024;
constexpr int kTargetBlocks = 264;     // two waves of blocks on a 132-SM H100/H200
constexpr int64_t kMinChunkRows = 64;  // keeps each block's pass over its rows worth launching
constexpr int kZWarps = 8;
constexpr int64_t kZMaxChunks = 1056;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t chunks_per_seq(int64_t num_tokens, int64_t seq_len) {
  const int64_t B = num_tokens / seq_len;
  const int64_t want = ceil_div(kTargetBlocks, B);
  const int64_t by_rows = ceil_div(seq_len, kMinChunkRows);
  const int64_t c = want < by_rows ? want : by_rows;
  return c < 1 ? 1 : c;
}

template <typename I>
__device__ __forceinline__ int64_t load_count(const void* counts, int64_t i) {
  return static_cast<int64_t>(static_cast<const I*>(counts)[i]);
}

__device__ __forceinline__ int64_t load_count(const void* counts, bool is64, int64_t i) {
  return is64 ? load_count<int64_t>(counts, i) : load_count<int32_t>(counts, i);
}

// Sum of v over the block, in a fixed tree order; the result is valid in thread 0.
template <typename V, int kThreads>
__device__ V block_sum(V v, V* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) smem[threadIdx.x] += smem[threadIdx.x + s];
    __syncthreads();
  }
  return smem[0];
}

// Row-parallel elementwise geometry for the [T, E] backward kernels: `cols` threads (a power of two,
// 32..256) walk one row's columns, 256 / cols rows per block; no per-element division.
struct RowCols {
  int cols;
  int rows_per_block;
};

RowCols row_cols(int32_t E) {
  int cols = 32;
  while (cols < 256 && cols < E) cols *= 2;
  return {cols, 256 / cols};
}

// Threads split into `cols` column lanes (a power of two, 32..256) x 256 / cols row lanes, so a
// narrow E still keeps the block busy. Each thread sums its rows of one column in blocks of
// kSumBlock rows (8 accumulators each: eight loads in flight a thread, where a 256-thread block of
// 4-byte loads needs them to keep DRAM busy), which bounds the fp32 error by the block length rather
// than the chunk length; the row lanes are then added in a fixed order through shared memory.
constexpr int64_t kSumBlock = 64;

template <typename T>
__device__ float column_sum(const T* __restrict__ scores, int64_t E, int64_t e, int64_t r0, int64_t r1, int stride) {
  float total = 0.f;
  for (int64_t b0 = r0; b0 < r1; b0 += kSumBlock * stride) {
    const int64_t b1 = b0 + kSumBlock * stride < r1 ? b0 + kSumBlock * stride : r1;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t r = b0;
    for (; r + 7 * stride < b1; r += 8 * stride) {
#pragma unroll
      for (int u = 0; u < 8; ++u) a[u] += to_float(scores[(r + u * stride) * E + e]);
    }
    for (; r < b1; r += stride) a[0] += to_float(scores[r * E + e]);
    total += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
  return total;
}

// The last block: s_{b,e} = the sum of sequence b's chunks' partial sums (and, for seq_aux_loss, c_{b,e} = the
// sum of their partial counts; common/chunk_sums.cuh: 16-byte loads when E % 4 == 0, the chunks split over
// lanes, a fixed order), then loss = scale * sum_{b,e} s_{b,e} c_{b,e} in fp64.
template <int VEC>
__device__ void balance_finish(const BalanceParams& p, int64_t B, int64_t cps, ChunkLane<VEC>* lanes, double* red) {
  const bool seq = p.indices != nullptr;
  const int64_t E = p.num_experts;
  double acc = 0.0;
  chunk_column_sums<VEC, VEC == 4 ? 4 : 8>(p.partial_sums, seq ? p.partial_counts : nullptr, E, B, cps, lanes,
                                          [&](int64_t b, int64_t e, float s, int32_t n) {
                                            int64_t count;
                                            if (seq) {
                                              p.seq_counts[b * E + e] = n;
                                              count = n;
                                            } else {
                                              count = load_count(p.counts, p.counts_int64, e);
                                            }
                                            acc += double(s) * double(count);
                                          });
  const double total = block_sum<double, kPartialThreads>(acc, red);
  if (threadIdx.x == 0) {
    *p.loss = float(total * double(p.scale));
    *p.counter = 0u;  // ready for the next launch on this stream
  }
}

template <typename T>
__global__ void __launch_bounds__(kPartialThreads)
    balance_fwd_kernel(BalanceParams p, int64_t B, int64_t cps, int64_t rows_per_chunk, int cols, bool vec4) {
  extern __shared__ int32_t hist[];  // [E] when counting
  __shared__ float lane_sums[kPartialThreads];
  __shared__ __align__(16) unsigned char lane_buf[chunk_lanes_bytes<4>(kPartialThreads)];
  __shared__ double red[kPartialThreads];
  const int64_t chunk = blockIdx.x;
  const int64_t b = chunk / cps, c = chunk % cps;
  const int64_t seq_end = (b + 1) * p.seq_len;
  const int64_t r0 = b * p.seq_len + c * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < seq_end ? r0 + rows_per_chunk : seq_end;
  const int64_t E = p.num_experts;
  const int row_lanes = kPartialThreads / cols;
  const int col = threadIdx.x % cols, row_lane = threadIdx.x / cols;
  const T* scores = static_cast<const T*>(p.scores);
  for (int64_t e0 = 0; e0 < E; e0 += cols) {
    const int64_t e = e0 + col;
    lane_sums[threadIdx.x] = e < E ? column_sum(scores, E, e, r0 + row_lane, r1, row_lanes) : 0.f;
    __syncthreads();
    if (row_lane == 0 && e < E) {
      float sum = 0.f;
      for (int q = 0; q < row_lanes; ++q) sum += lane_sums[q * cols + col];
      p.partial_sums[chunk * E + e] = sum;
    }
    __syncthreads();
  }
  if (p.indices != nullptr) {
    for (int64_t e = threadIdx.x; e < E; e += kPartialThreads) hist[e] = 0;
    __syncthreads();
    const int64_t end = r1 > r0 ? r1 * p.k : r0 * p.k;
    for (int64_t i = r0 * p.k + threadIdx.x; i < end; i += kPartialThreads) {
      const int32_t e = p.indices[i];
      if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += kPartialThreads) p.partial_counts[chunk * E + e] = hist[e];
  }

  if (!is_last_block(p.counter)) return;  // the last block adds the partials of every chunk
  if (vec4) {
    balance_finish<4>(p, B, cps, reinterpret_cast<ChunkLane<4>*>(lane_buf), red);
  } else {
    balance_finish<1>(p, B, cps, reinterpret_cast<ChunkLane<1>*>(lane_buf), red);
  }
}

template <typename T>
__global__ void __launch_bounds__(256) balance_bwd_kernel(BalanceBwdParams p, RowCols g) {
  const float scaled = *p.grad * p.scale;
  const int64_t E = p.num_experts;
  const int row_in_block = threadIdx.x / g.cols, col = threadIdx.x % g.cols;
  T* out = static_cast<T*>(p.grad_scores);
  const int64_t stride = int64_t(gridDim.x) * g.rows_per_block;
  for (int64_t t = int64_t(blockIdx.x) * g.rows_per_block + row_in_block; t < p.num_tokens; t += stride) {
    const int64_t b = t / p.seq_len;
    for (int64_t e = col; e < E; e += g.cols) {
      out[t * E + e] = from_float<T>(scaled * float(load_count(p.counts, p.counts_int64, b * E + e)));
    }
  }
}

// log-sum-exp of one row by one warp, as torch.logsumexp: NaN if any entry is NaN, the infinite
// maximum itself when the maximum is +-inf.
template <typename T>
__device__ float row_lse(const T* row, int E, int lane) {
  float m = -INFINITY;
  bool nan = false;
  for (int e = lane; e < E; e += 32) {
    const float x = to_float(row[e]);
    nan |= isnan(x);
    m = fmaxf(m, x);
  }
  m = warp_max(m);
  if (__any_sync(0xffffffffu, nan)) return NAN;
  if (isinf(m)) return m;
  float s = 0.f;
  for (int e = lane; e < E; e += 32) s += expf(to_float(row[e]) - m);
  return m + logf(warp_sum(s));
}

template <typename T>
__global__ void __launch_bounds__(kZWarps * 32) z_partial_kernel(ZLossParams p, int64_t rows_per_chunk) {
  __shared__ float warp_acc[kZWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < p.num_tokens ? r0 + rows_per_chunk : p.num_tokens;
  const T* logits = static_cast<const T*>(p.logits);
  float acc = 0.f;
  for (int64_t t = r0 + warp; t < r1; t += kZWarps) {
    const float lse = row_lse(logits + t * p.num_experts, p.num_experts, lane);
    if (lane == 0) p.lse[t] = lse;
    acc += lse * lse;
  }
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kZWarps; ++w) s += warp_acc[w];
    p.partials[blockIdx.x] = s;
  }
}

__global__ void __launch_bounds__(kFinalThreads) z_finalize_kernel(ZLossParams p, int64_t chunks) {
  __shared__ double smem[kFinalThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < chunks; i += kFinalThreads) acc += double(p.partials[i]);
  const double total = block_sum<double, kFinalThreads>(acc, smem);
  if (threadIdx.x == 0) *p.loss = float(total / double(p.num_tokens) * double(p.coeff));
}

template <typename T>
__global__ void __launch_bounds__(256) z_bwd_kernel(ZLossBwdParams p, RowCols g) {
  const float scaled = *p.grad * p.coeff * 2.f / float(p.num_tokens);
  const int64_t E = p.num_experts;
  const int row_in_block = threadIdx.x / g.cols, col = threadIdx.x % g.cols;
  const T* logits = static_cast<const T*>(p.logits);
  T* out = static_cast<T*>(p.grad_logits);
  const int64_t stride = int64_t(gridDim.x) * g.rows_per_block;
  for (int64_t t = int64_t(blockIdx.x) * g.rows_per_block + row_in_block; t < p.num_tokens; t += stride) {
    const float lse = p.lse[t];
    for (int64_t e = col; e < E; e += g.cols) {
      out[t * E + e] = from_float<T>(scaled * lse * expf(to_float(logits[t * E + e]) - lse));
    }
  }
}

__global__ void __launch_bounds__(kFinalThreads)
    bias_update_kernel(float* bias, const void* counts, bool is64, int32_t E, float rate) {
  __shared__ long long smem[kFinalThreads];
  long long acc = 0;
  for (int e = threadIdx.x; e < E; e += kFinalThreads) acc += load_count(counts, is64, e);
  const long long total = block_sum<long long, kFinalThreads>(acc, smem);
  for (int e = threadIdx.x; e < E; e += kFinalThreads) {
    const long long d = total - (long long)E * load_count(counts, is64, e);
    const float sign = d > 0 ? 1.f : (d < 0 ? -1.f : 0.f);
    bias[e] = bias[e] + sign * rate;
  }
}

unsigned row_blocks(int64_t rows, const RowCols& g) {
  const int64_t want = ceil_div(rows, g.rows_per_block);
  return unsigned(want < 8192 ? want : 8192);
}

void check_experts(int32_t E, const char* what, bool histogram = false) {
  if (E < 1 || (histogram && E > kBalanceMaxExperts)) {
    throw std::invalid_argument(std::string(what) + ": num_experts out of range");
  }
}

}  // namespace

int64_t balance_chunks(int64_t num_tokens, int64_t seq_len) {
  if (num_tokens <= 0 || seq_len <= 0) return 0;
  return (num_tokens / seq_len) * chunks_per_seq(num_tokens, seq_len);
}

void balance_loss_fwd(const BalanceParams& p, cudaStream_t stream) {
  const char* what = p.indices != nullptr ? "seq_aux_loss" : "aux_loss";
  check_experts(p.num_experts, what, p.indices != nullptr);
  if (p.seq_len < 1 || p.num_tokens % p.seq_len) throw std::invalid_argument(std::string(what) + ": bad seq_len");
  if (p.num_tokens == 0) {
    check_cuda(cudaMemsetAsync(p.loss, 0, sizeof(float), stream), what);
    return;
  }
  const int64_t B = p.num_tokens / p.seq_len;
  const int64_t cps = chunks_per_seq(p.num_tokens, p.seq_len);
  const int64_t rows_per_chunk = ceil_div(p.seq_len, cps);
  if (B * cps > INT32_MAX) throw std::invalid_argument(std::string(what) + ": too many sequences for one launch");
  if (p.counter == nullptr) throw std::invalid_argument(std::string(what) + ": counter needed");
  const size_t smem = p.indices != nullptr ? sizeof(int32_t) * p.num_experts : 0;
  const int cols = row_cols(p.num_experts).cols;
  // 16-byte loads of the partials where every row of E starts 16-byte aligned.
  const bool vec4 = p.num_experts % 4 == 0 && reinterpret_cast<uintptr_t>(p.partial_sums) % 16 == 0 &&
                    (p.indices == nullptr || reinterpret_cast<uintptr_t>(p.partial_counts) % 16 == 0);
  by_float_dtype(p.dtype, what, [&]<typename T>() {
    balance_fwd_kernel<T><<<unsigned(B * cps), kPartialThreads, smem, stream>>>(p, B, cps, rows_per_chunk, cols,
                                                                                  vec4);
  });
  check_launch("balance_fwd_kernel");
}

void balance_loss_bwd(const BalanceBwdParams& p, cudaStream_t stream) {
  check_experts(p.num_experts, "aux loss backward");
  const int64_t n = p.num_tokens * p.num_experts;
  if (n == 0) return;
  if (p.seq_len < 1) throw std::invalid_argument("aux loss backward: bad seq_len");
  by_float_dtype(p.dtype, "aux loss backward", [&]<typename T>() {
    const RowCols g = row_cols(p.num_experts);
    balance_bwd_kernel<T><<<row_blocks(p.num_tokens, g), 256, 0, stream>>>(p, g);
  });
  check_launch("balance_bwd_kernel");
}

int64_t z_loss_chunks(int64_t num_tokens) {
  if (num_tokens <= 0) return 0;
  const int64_t want = ceil_div(num_tokens, kZWarps);
  return want < kZMaxChunks ? want : kZMaxChunks;
}

void z_loss_fwd(const ZLossParams& p, cudaStream_t stream) {
  if (p.num_experts < 1) throw std::invalid_argument("z_loss: num_experts out of range");
  if (p.num_tokens == 0) {
    check_cuda(cudaMemsetAsync(p.loss, 0, sizeof(float), stream), "z_loss");
    return;
  }
  const int64_t chunks = z_loss_chunks(p.num_tokens);
  const int64_t rows_per_chunk = ceil_div(p.num_tokens, chunks);
  by_float_dtype(p.dtype, "z_loss", [&]<typename T>() {
    z_partial_kernel<T><<<unsigned(chunks), kZWarps * 32, 0, stream>>>(p, rows_per_chunk);
  });
  check_launch("z_partial_kernel");
  z_finalize_kernel<<<1, kFinalThreads, 0, stream>>>(p, chunks);
  check_launch("z_finalize_kernel");
}

void z_loss_bwd(const ZLossBwdParams& p, cudaStream_t stream) {
  const int64_t n = p.num_tokens * p.num_experts;
  if (n == 0) return;
  by_float_dtype(p.dtype, "z_loss backward", [&]<typename T>() {
    const RowCols g = row_cols(p.num_experts);
    z_bwd_kernel<T><<<row_blocks(p.num_tokens, g), 256, 0, stream>>>(p, g);
  });
  check_launch("z_bwd_kernel");
}

void update_expert_bias(float* bias, const void* counts, bool counts_int64, int32_t num_experts, float rate,
                        cudaStream_t stream) {
  check_experts(num_experts, "update_expert_bias");
  bias_update_kernel<<<1, kFinalThreads, 0, stream>>>(bias, counts, counts_int64, num_experts, rate);
  check_launch("bias_update_kernel");
}

}  // namespace moe::router
