// Expert-parallel dispatch and combine over peer buffers: the kernels. Layout and phases: nvlink.h.
//
// Ordering. Only `barrier_kernel` waits for other ranks. It fences at system scope, stores its epoch into
// every rank's signal word for it with release semantics, then polls its own signal words with acquire
// loads until every rank reached the epoch. Everything a rank wrote before its barrier (in stream order)
// is visible to every rank after theirs. Each phase that writes into another rank's memory starts after
// a barrier, so no rank overwrites what another is still reading.
//
// Determinism. Receive rows are laid out in (source rank, source token) order from exchanged counts;
// the grouped rows then follow permute's (row, slot) order within each expert, which is the order the
// all-to-all backend produces. Combine brings one row per (token, slot) back and the source sums them
// with unpermute (fp32, ascending slot): bit-identical to the one-rank layer.
#include <cub/block/block_scan.cuh>

#include <cstdio>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "common/vec.cuh"
#include "dispatch/nvlink.h"

namespace moe::dispatch {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // 16-byte vectors in flight per lane

// Signal words: release store and acquire load at system scope (peer GPUs see them in order). Portable
// twins for the CPU-executed build.
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

template <typename T>
__device__ __forceinline__ T* at(uint64_t base, int64_t offset) {
  return reinterpret_cast<T*>(base + uint64_t(offset));
}

__device__ __forceinline__ Header* header_of(const World& w, int r) { return at<Header>(w.bases[r], 0); }

// A wait gives up after 10 minutes (NCCL's default watchdog): a rank died, skipped a collective, or
// raised on a bad argument. It traps, so the job fails instead of hanging.
constexpr uint64_t kTimeoutNs = uint64_t(600) * 1000000000ull;

__device__ __forceinline__ uint64_t now_ns() {
#if defined(__CUDA_ARCH__)
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

__global__ void barrier_kernel(World w, int mode) {
  __shared__ uint64_t epoch;
  Header* self = header_of(w, w.rank);
  if (threadIdx.x == 0) {
    epoch = self->epoch + ((mode & 1) ? 1 : 0);
    if (mode & 1) self->epoch = epoch;
  }
  __syncthreads();
  const uint64_t e = epoch;
  if (mode & 1) {
    __threadfence_system();  // this rank's earlier writes (earlier kernels included) before the signal
    for (int r = threadIdx.x; r < w.ranks; r += blockDim.x) store_release_sys(&header_of(w, r)->signals[w.rank], e);
  }
  if (mode & 2) {
    for (int r = threadIdx.x; r < w.ranks; r += blockDim.x) {
      const uint64_t start = now_ns();
      while (load_acquire_sys(&self->signals[r]) < e) {
#ifdef CUDA_ON_CPU
        __trap();  // ranks run one after another here: a wait that is not already satisfied never will be
#endif
        if (now_ns() - start > kTimeoutNs) {
          printf("moe_kernels nvlink barrier: rank %d waited 10 minutes for rank %d (epoch %llu)\n", w.rank, r,
                 (unsigned long long)e);
          __trap();
        }
        __nanosleep(256);
      }
    }
    __syncthreads();
  }
}

// One block per destination rank d: which of this rank's tokens go to d, their positions among them
// (token units and expert-row units), and the totals into d's inbox.
__global__ void __launch_bounds__(kThreads) notify_kernel(NotifyParams p) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int d = blockIdx.x;
  const int P = p.header.ranks;
  const int32_t lo = d * p.local_experts, hi = lo + p.local_experts;
  int32_t run_tokens = 0, run_rows = 0;
  for (int64_t base = 0; base < p.num_tokens; base += kThreads) {
    const int64_t t = base + threadIdx.x;
    int32_t m = 0;
    if (t < p.num_tokens) {
      for (int64_t j = 0; j < p.k; ++j) {
        const int32_t e = p.indices[t * p.k + j];
        m += (e >= lo && e < hi) ? 1 : 0;
      }
    }
    int32_t tok_pos, row_pos, tok_sum, row_sum;
    Scan(storage).ExclusiveSum(m > 0 ? 1 : 0, tok_pos, tok_sum);
    __syncthreads();
    Scan(storage).ExclusiveSum(m, row_pos, row_sum);
    __syncthreads();
    if (t < p.num_tokens) {
      p.send_token[t * P + d] = m > 0 ? run_tokens + tok_pos : -1;
      p.send_slot[t * P + d] = run_rows + row_pos;
    }
    run_tokens += tok_sum;
    run_rows += row_sum;
  }
  if (threadIdx.x == 0) {
    int32_t* inbox = header_of(p.header, d)->inbox[p.header.rank];
    inbox[0] = run_tokens;
    inbox[1] = run_rows;
    __threadfence_system();
  }
}

// Copies one row of `row_bytes` from src to the destinations in `dsts` (n of them): each lane loads
// kUnroll vectors once and stores them to every destination.
template <int VB>
__device__ __forceinline__ void copy_row(const char* src, char* const* dsts, int n, int64_t row_bytes, int lane) {
  using V = typename RawVec<VB>::type;
  const int64_t vecs = row_bytes / VB;
  const V* s = reinterpret_cast<const V*>(src);
  for (int64_t seg = 0; seg < vecs; seg += 32 * kUnroll) {
    V regs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = seg + lane + 32 * u;
      if (v < vecs) regs[u] = s[v];
    }
    for (int i = 0; i < n; ++i) {
      V* dst = reinterpret_cast<V*>(dsts[i]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = seg + lane + 32 * u;
        if (v < vecs) __stcg(dst + v, regs[u]);  // st.global: peer memory is global memory
      }
    }
  }
}

__device__ __forceinline__ void copy_bytes(const char* src, char* const* dsts, int n, int64_t bytes, int lane) {
  for (int64_t b = lane; b < bytes; b += 32)
    for (int i = 0; i < n; ++i) dsts[i][b] = src[b];
}

// One warp per token; lane d (and d + 32) handles destination rank d's bookkeeping.
template <int VB>
__global__ void __launch_bounds__(kThreads) send_kernel(SendParams p) {
  __shared__ int32_t token_offset[kMaxRanks];  // rows of lower ranks' tokens at each destination
  __shared__ int32_t row_offset[kMaxRanks];
  __shared__ char* dst_x[kWarps][kMaxRanks];
  __shared__ char* dst_s[kWarps][kMaxRanks];
  const int P = p.header.ranks, me = p.header.rank;
  for (int d = threadIdx.x; d < P; d += kThreads) {
    const volatile int32_t* inbox = &header_of(p.header, d)->inbox[0][0];
    int32_t tokens = 0, rows = 0;
    for (int s = 0; s < me; ++s) {
      tokens += inbox[2 * s];
      rows += inbox[2 * s + 1];
    }
    token_offset[d] = tokens;
    row_offset[d] = rows;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k = p.k;
  const int32_t El = p.local_experts;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + warp; t < p.num_tokens; t += int64_t(gridDim.x) * kWarps) {
    // Destinations this token reaches; metadata rows written for every token sent (dropped ones get -1
    // slots, so the receiver's rows [0, N) are all this dispatch's).
    int n = 0;
    for (int d0 = 0; d0 < P; d0 += 32) {
      const int d = d0 + lane;
      bool delivered = false;
      int32_t row = -1;
      if (d < P) {
        const int32_t tok = p.send_token[t * P + d];
        if (tok >= 0) {
          row = token_offset[d] + tok;
          int32_t m = 0;
          for (int64_t j = 0; j < k; ++j) {
            const int32_t e = p.indices[t * k + j];
            m += (e >= d * El && e < (d + 1) * El) ? 1 : 0;
          }
          const int64_t first = int64_t(row_offset[d]) + p.send_slot[t * P + d];
          delivered = first + m <= p.capacity && row < p.x_rows;
          if (!delivered) atomicAdd(reinterpret_cast<unsigned long long*>(&header_of(p.header, me)->dropped), 1ull);
          const uint64_t base = p.data.bases[d];
          int32_t* src = at<int32_t>(base, p.layout.src) + 2 * int64_t(row);
          src[0] = me;
          src[1] = int32_t(t);
          int32_t* idx = at<int32_t>(base, p.layout.idx) + int64_t(row) * k;
          float* w = at<float>(base, p.layout.w) + int64_t(row) * k;
          for (int64_t j = 0; j < k; ++j) {
            const int32_t e = p.indices[t * k + j];
            const bool here = delivered && e >= d * El && e < (d + 1) * El;
            idx[j] = here ? e - d * El : -1;
            w[j] = p.weights[t * k + j];
          }
        }
      }
      const unsigned go = __ballot_sync(0xffffffffu, delivered);
      if (delivered) {
        const int i = n + __popc(go & ((1u << lane) - 1u));
        const uint64_t base = p.data.bases[d];
        dst_x[warp][i] = at<char>(base, p.layout.x) + int64_t(row) * p.row_bytes;
        dst_s[warp][i] = at<char>(base, p.layout.scales) + int64_t(row) * p.scale_bytes;
      }
      n += __popc(go);
    }
    // This rank's own map for the combine: slot j's row in the combine region, -1 if it went nowhere.
    for (int64_t j = lane; j < k; j += 32) {
      const int32_t e = p.indices[t * k + j];
      int32_t r = -1;
      if (e >= 0 && e < P * El) {
        const int d = e / El;
        const int32_t tok = p.send_token[t * P + d];
        int32_t m = 0;
        for (int64_t i = 0; i < k; ++i) {
          const int32_t f = p.indices[t * k + i];
          m += (f >= d * El && f < (d + 1) * El) ? 1 : 0;
        }
        const int64_t first = int64_t(row_offset[d]) + p.send_slot[t * P + d];
        if (first + m <= p.capacity && token_offset[d] + tok < p.x_rows) r = int32_t(t * k + j);
      }
      p.source_rows[t * k + j] = r;
    }
    __syncwarp();
    copy_row<VB>(static_cast<const char*>(p.x) + t * p.row_bytes, dst_x[warp], n, p.row_bytes, lane);
    if (p.scales != nullptr)
      copy_bytes(static_cast<const char*>(p.scales) + t * p.scale_bytes, dst_s[warp], n, p.scale_bytes, lane);
    __syncwarp();
  }
  __threadfence_system();  // this thread's peer writes performed before the barrier kernel's signal
}

__global__ void prepare_kernel(PrepareParams p) {
  const volatile int32_t* inbox = &header_of(p.header, p.header.rank)->inbox[0][0];
  int64_t n = 0;
  for (int s = 0; s < p.header.ranks; ++s) n += inbox[2 * s];
  n = n < p.rows ? n : p.rows;  // rows past X hold only dropped tokens (a delivered token's row is < X)
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.num_received = int32_t(n);
  const int64_t total = p.rows * p.k;
  for (int64_t i = n * p.k + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    p.idx[i] = -1;
}

__global__ void __launch_bounds__(kThreads) layout_meta_kernel(LayoutParams p) {
  const int64_t n = *p.num_received;
  const int64_t k = p.k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + warp; i < n; i += int64_t(gridDim.x) * kWarps) {
    if (lane < 2) p.handle_src[2 * i + lane] = p.src[2 * i + lane];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t g = p.row_map[i * k + j];
      if (g < 0) continue;
      if (lane == 0) {
        p.row_weights[g] = p.w[i * k + j];
        p.local_indices[g] = p.idx[i * k + j];
      }
      if (p.grouped_scales != nullptr) {
        const char* s = static_cast<const char*>(p.scales) + i * p.scale_bytes;
        char* d = static_cast<char*>(p.grouped_scales) + int64_t(g) * p.scale_bytes;
        for (int64_t b = lane; b < p.scale_bytes; b += 32) d[b] = s[b];
      }
    }
  }
}

// push (PULL = false): grouped rows -> source ranks' combine regions; pull: the reverse.
template <int VB, bool PULL>
__global__ void __launch_bounds__(kThreads) move_kernel(MoveParams p) {
  using V = typename RawVec<VB>::type;
  const int64_t n = *p.num_received;
  const int64_t k = p.k;
  const int64_t vecs = p.row_bytes / VB;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t floats_at = combine_floats_offset(p.max_tokens, k, p.row_bytes);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + warp; i < n; i += warps) {
    const int32_t s = p.src[2 * i], t = p.src[2 * i + 1];
    const uint64_t base = p.data.bases[s];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t g = p.row_map[i * k + j];
      if (g < 0) continue;
      V* remote = at<V>(base, (int64_t(t) * k + j) * p.row_bytes);
      V* local = reinterpret_cast<V*>(static_cast<char*>(p.rows) + int64_t(g) * p.row_bytes);
      const V* from = PULL ? remote : local;
      V* to = PULL ? local : remote;
      for (int64_t seg = 0; seg < vecs; seg += 32 * kUnroll) {
        V regs[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = seg + lane + 32 * u;
          if (v < vecs) regs[u] = PULL ? __ldcg(from + v) : from[v];  // peer rows: L2 (the owner's), not L1
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = seg + lane + 32 * u;
          if (v < vecs) __stcg(to + v, regs[u]);
        }
      }
      if (!PULL && p.floats != nullptr && lane == 0) at<float>(base, floats_at)[int64_t(t) * k + j] = p.floats[g];
    }
  }
  if (!PULL) __threadfence_system();  // peer writes performed before the barrier kernel's signal
  if (PULL && p.local_experts > 0) {
    // Padding rows of each local expert get zeros; warps over (expert, row) pairs.
    for (int e = 0; e < p.local_experts; ++e) {
      const int64_t first = int64_t(p.starts[e]) + p.totals[e];
      const int64_t last = int64_t(p.starts[e]) + p.group_sizes[e];
      for (int64_t r = first + int64_t(blockIdx.x) * kWarps + warp; r < last; r += warps) {
        V* to = reinterpret_cast<V*>(static_cast<char*>(p.rows) + r * p.row_bytes);
        for (int64_t v = lane; v < vecs; v += 32) to[v] = V{};
      }
    }
  }
}

int vector_bytes(int64_t row_bytes, std::initializer_list<const void*> ptrs) {
  for (int vb = 16; vb > 1; vb /= 2) {
    bool ok = row_bytes % vb == 0;
    for (const void* q : ptrs) ok = ok && reinterpret_cast<uintptr_t>(q) % vb == 0;
    if (ok) return vb;
  }
  return 1;
}

unsigned blocks_for(int64_t items_per_block_unit, int64_t items, int32_t cap) {
  int64_t b = (items + items_per_block_unit - 1) / items_per_block_unit;
  if (b > cap) b = cap;
  return unsigned(b < 1 ? 1 : b);
}

void check_world(const World& w, const char* what) {
  if (w.ranks < 1 || w.ranks > kMaxRanks || w.rank < 0 || w.rank >= w.ranks)
    throw std::invalid_argument(std::string(what) + ": rank/world size out of range");
}

}  // namespace

DispatchLayout dispatch_layout(int32_t ranks, int64_t max_tokens, int64_t k, int64_t x_rows, int64_t row_bytes,
                               int64_t scale_bytes) {
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t rows = int64_t(ranks) * max_tokens;
  DispatchLayout l;
  l.src = 0;
  l.idx = up(l.src + rows * 2 * 4);
  l.w = up(l.idx + rows * k * 4);
  l.x = up(l.w + rows * k * 4);
  l.scales = up(l.x + x_rows * row_bytes);
  l.bytes = up(l.scales + x_rows * scale_bytes);
  return l;
}

void barrier(World header, int mode, cudaStream_t stream) {
  check_world(header, "nvlink barrier");
  barrier_kernel<<<1, 64, 0, stream>>>(header, mode);
  check_launch("nvlink barrier_kernel");
}

void notify(const NotifyParams& p, cudaStream_t stream) {
  check_world(p.header, "nvlink notify");
  notify_kernel<<<unsigned(p.header.ranks), kThreads, 0, stream>>>(p);
  check_launch("nvlink notify_kernel");
}

void send(const SendParams& p, cudaStream_t stream) {
  check_world(p.header, "nvlink send");
  if (p.num_tokens == 0) return;
  const unsigned blocks = blocks_for(kWarps, p.num_tokens, p.num_sms);
  switch (vector_bytes(p.row_bytes, {p.x})) {  // every region offset and base is 256-byte aligned
    case 16: send_kernel<16><<<blocks, kThreads, 0, stream>>>(p); break;
    case 8: send_kernel<8><<<blocks, kThreads, 0, stream>>>(p); break;
    case 4: send_kernel<4><<<blocks, kThreads, 0, stream>>>(p); break;
    case 2: send_kernel<2><<<blocks, kThreads, 0, stream>>>(p); break;
    default: send_kernel<1><<<blocks, kThreads, 0, stream>>>(p); break;
  }
  check_launch("nvlink send_kernel");
}

void prepare(const PrepareParams& p, cudaStream_t stream) {
  check_world(p.header, "nvlink prepare");
  const unsigned blocks = blocks_for(kThreads * 8, p.rows * p.k, 264);
  prepare_kernel<<<blocks, kThreads, 0, stream>>>(p);
  check_launch("nvlink prepare_kernel");
}

void layout_meta(const LayoutParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  layout_meta_kernel<<<blocks_for(kWarps * 4, p.rows, 1024), kThreads, 0, stream>>>(p);
  check_launch("nvlink layout_meta_kernel");
}

template <bool PULL>
void move(const MoveParams& p, cudaStream_t stream) {
  check_world(p.data, PULL ? "nvlink pull" : "nvlink push");
  if (p.received_rows == 0 && (!PULL || p.local_experts == 0)) return;
  const unsigned blocks = blocks_for(kWarps, p.received_rows > 0 ? p.received_rows : 1, p.num_sms);
  switch (vector_bytes(p.row_bytes, {p.rows})) {
    case 16: move_kernel<16, PULL><<<blocks, kThreads, 0, stream>>>(p); break;
    case 8: move_kernel<8, PULL><<<blocks, kThreads, 0, stream>>>(p); break;
    case 4: move_kernel<4, PULL><<<blocks, kThreads, 0, stream>>>(p); break;
    case 2: move_kernel<2, PULL><<<blocks, kThreads, 0, stream>>>(p); break;
    default: move_kernel<1, PULL><<<blocks, kThreads, 0, stream>>>(p); break;
  }
  check_launch(PULL ? "nvlink pull (move_kernel)" : "nvlink push (move_kernel)");
}

void push(const MoveParams& p, cudaStream_t stream) { move<false>(p, stream); }
void pull(const MoveParams& p, cudaStream_t stream) { move<true>(p, stream); }

}  // namespace moe::dispatch
