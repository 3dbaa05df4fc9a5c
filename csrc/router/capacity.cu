// Capacity (token dropping): each expert keeps at most C of its (token, slot) pairs.
//
// The routing pass of permute (count, scan, map; no copy) gives every valid pair its rank among the
// pairs of its expert in (token, slot) order, and each expert's first row.
//   policy "position": keep iff rank < C, one elementwise pass.
//   policy "probs":    pairs are scattered into expert segments (in (token, slot) order) as 32-bit
//                      order keys of their weights; one block per expert whose segment holds more
//                      than C pairs finds the C-th largest key by a 4-pass MSB radix select (8 bits
//                      per pass, shared-memory histograms) and keeps the pairs above it plus the
//                      first pairs equal to it (ties to the earlier pair, a block-wide scan in segment
//                      order). Segments with at most C pairs are copied through.
// No host sync; the result is exact and deterministic.
#include <cub/block/block_scan.cuh>

#include <stdexcept>

#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "permute/permute.h"
#include "router/balance.h"

namespace moe::router {
namespace {

constexpr int kThreads = 256;
constexpr int kSelectThreads = kCapacitySelectThreads;
static_assert(capacity_select_passes(INT32_MAX) == (int64_t(1) << 22), "a segment of 2^31 - 1 pairs ends");
constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Workspace {
  int32_t* row_map;  // [n]
  int32_t* counts;   // [E]
  uint32_t* keys;    // [n] weight keys in expert-segment order
  int32_t* slots;    // [n] the pair at each segment position
  void* permute;     // permute_workspace_bytes(n, E)
};

Workspace carve(void* base, int64_t n, int32_t E) {
  char* p = static_cast<char*>(base);
  Workspace w;
  w.row_map = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * n);
  w.counts = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * E);
  w.keys = reinterpret_cast<uint32_t*>(p);
  p += align_up(sizeof(uint32_t) * n);
  w.slots = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * n);
  w.permute = p;
  return w;
}

// Larger weight -> larger key. NaN ranks below everything (-inf included) and -0 equals +0, as in the
// reference's stable descending sort.
__device__ __forceinline__ uint32_t weight_key(float w) {
  if (isnan(w)) return 0u;
  if (w == 0.f) w = 0.f;
  const uint32_t b = __float_as_uint(w);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <typename T>
__device__ __forceinline__ void write_pair(const CapacityParams& p, int64_t s, int32_t e, bool keep) {
  const T* w = static_cast<const T*>(p.weights);
  T* w_out = static_cast<T*>(p.weights_out);
  p.indices_out[s] = keep ? e : -1;
  w_out[s] = keep ? w[s] : from_float<T>(0.f);
}

template <typename T>
__global__ void position_kernel(CapacityParams p, const int32_t* __restrict__ row_map,
                                const int32_t* __restrict__ starts) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < p.num_slots; s += stride) {
    const int32_t r = row_map[s];
    const int32_t e = r >= 0 ? p.indices[s] : -1;  // a mapped pair has a valid expert
    write_pair<T>(p, s, e, r >= 0 && int64_t(r) - starts[e] < p.capacity);
  }
}

template <typename T>
__global__ void scatter_kernel(CapacityParams p, const int32_t* __restrict__ row_map, uint32_t* __restrict__ keys,
                               int32_t* __restrict__ slots) {
  const T* w = static_cast<const T*>(p.weights);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < p.num_slots; s += stride) {
    const int32_t r = row_map[s];
    if (r >= 0) {
      keys[r] = weight_key(to_float(w[s]));
      slots[r] = int32_t(s);
    } else {
      write_pair<T>(p, s, -1, false);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(CapacityParams p, const uint32_t* __restrict__ all_keys, const int32_t* __restrict__ all_slots,
                  const int32_t* __restrict__ starts, const int32_t* __restrict__ counts) {
  using BlockScan = cub::BlockScan<int32_t, kSelectThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int32_t hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int32_t s_remaining;

  const int32_t e = blockIdx.x;
  const int32_t n = counts[e];
  const uint32_t* keys = all_keys + starts[e];
  const int32_t* slots = all_slots + starts[e];
  if (int64_t(n) <= p.capacity || p.capacity == 0) {
    const bool keep = p.capacity > 0;
    for (int64_t i = threadIdx.x; i < n; i += kSelectThreads) write_pair<T>(p, slots[i], e, keep);
    return;
  }

  // The C-th largest key: after the pass at `shift`, `prefix` holds its top bits and `remaining` its
  // rank among the keys sharing them.
  uint32_t prefix = 0u, mask = 0u;
  int32_t remaining = int32_t(p.capacity);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += kSelectThreads) hist[d] = 0;
    __syncthreads();
    // Softmax weights share their top bits, so lanes of a warp mostly hit the same bin: one atomic
    // per distinct digit in the warp (the loop bound is uniform, so every lane reaches the match).
    for (int64_t pass = 0; pass < capacity_select_passes(n); ++pass) {
      const int64_t i = pass * kSelectThreads + threadIdx.x;
      const uint32_t key = i < n ? keys[i] : 0u;
      const bool mine = i < n && (key & mask) == prefix;
      const uint32_t digit = mine ? (key >> shift) & 0xffu : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (mine && (threadIdx.x % 32) == unsigned(__ffs(peers) - 1)) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds digits 255 - 8l down to 248 - 8l: an inclusive scan over lanes counts the keys
      // at or above each lane's digits; the lane whose range reaches `remaining` walks its 8 digits.
      const int lane = threadIdx.x;
      int32_t c[8];
      int32_t mine = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - 8 * lane - j];
        mine += c[j];
      }
      int32_t incl = mine;
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const int32_t v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      const int32_t excl = incl - mine;
      if (excl < remaining && remaining <= incl) {
        int32_t above = excl;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (above + c[j] >= remaining) {
            s_prefix = prefix | (uint32_t(255 - 8 * lane - j) << shift);
            s_remaining = remaining - above;
            break;
          }
          above += c[j];
        }
      }
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 0xffu << shift;
  }

  // Keys above the threshold stay; of those equal to it, the first `remaining` in segment order.
  int32_t ties_before = 0;
  for (int64_t pass = 0; pass < capacity_select_passes(n); ++pass) {
    const int64_t i = pass * kSelectThreads + threadIdx.x;
    const uint32_t key = i < n ? keys[i] : 0u;
    const int32_t tie = (i < n && key == prefix) ? 1 : 0;
    int32_t rank, total;
    BlockScan(scan_storage).ExclusiveSum(tie, rank, total);
    if (i < n) write_pair<T>(p, slots[i], e, key > prefix || (tie && ties_before + rank < remaining));
    ties_before += total;
    __syncthreads();
  }
}

unsigned grid_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  return unsigned(want < 8192 ? want : 8192);
}

}  // namespace

size_t capacity_workspace_bytes(int64_t num_slots, int32_t num_experts) {
  return 3 * align_up(sizeof(int32_t) * num_slots) + align_up(sizeof(int32_t) * num_experts) +
         permute::permute_workspace_bytes(num_slots, num_experts);
}

void apply_capacity(const CapacityParams& p, cudaStream_t stream) {
  if (p.num_experts < 1 || p.num_experts > kBalanceMaxExperts) {
    throw std::invalid_argument("apply_capacity: num_experts out of range");
  }
  if (p.num_slots < 0 || p.num_slots > INT32_MAX) throw std::invalid_argument("apply_capacity: too many slots");
  if (p.capacity < 0) throw std::invalid_argument("apply_capacity: negative capacity");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw std::invalid_argument("apply_capacity: weights must be float32, float16 or bfloat16");
  }
  if (p.num_slots == 0) return;
  const Workspace ws = carve(p.workspace, p.num_slots, p.num_experts);
  permute::PermuteParams route{};
  route.indices = p.indices;
  route.row_map = ws.row_map;
  route.group_sizes = ws.counts;
  route.workspace = ws.permute;
  route.num_tokens = p.num_slots;
  route.k = 1;
  route.row_bytes = 0;
  route.num_experts = p.num_experts;
  route.align = 1;
  permute::permute_fwd(route, stream);
  const int32_t* starts = permute::permute_expert_starts(ws.permute, p.num_slots, p.num_experts);

  by_float_dtype(p.dtype, "apply_capacity", [&]<typename T>() {
    if (!p.by_probs) {
      position_kernel<T><<<grid_for(p.num_slots), kThreads, 0, stream>>>(p, ws.row_map, starts);
      check_launch("capacity position_kernel");
      return;
    }
    scatter_kernel<T><<<grid_for(p.num_slots), kThreads, 0, stream>>>(p, ws.row_map, ws.keys, ws.slots);
    check_launch("capacity scatter_kernel");
    select_kernel<T><<<unsigned(p.num_experts), kSelectThreads, 0, stream>>>(p, ws.keys, ws.slots, starts,
                                                                              ws.counts);
    check_launch("capacity select_kernel");
  });
}

}  // namespace moe::router
