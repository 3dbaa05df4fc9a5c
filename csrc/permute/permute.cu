// Permute: route each (token, slot) copy of x to its expert's contiguous row range.
//
// Four launches, no host sync:
//   1. count:  each warp histograms one chunk of kChunk slots (shared memory) -> counts[chunk][E].
//   2. scan:   one block turns counts into per-chunk offsets within each expert, pads each expert's
//              total to `align`, and scans those over experts -> starts[E], group_sizes[E].
//   3. map:    each warp re-reads its chunk and assigns row = start + chunk offset + rank, where the
//              rank among equal experts comes from __match_any_sync, so rows follow (token, slot)
//              order within each expert: the result is unique and deterministic.
//   4. copy:   one row group per token loads x[t] once into registers and stores it to its k rows;
//              extra blocks zero each expert's padding rows.
//              With FP8 outputs (permute_quantize_fp8) the copy is quant_copy_kernel instead: 16 lanes
//              per (token, 1x128 block) load it once, take its amax by shuffles, and store the E4M3
//              codes and the scale (and the input-precision values, when asked) to each of its k rows.
#include <cub/block/block_scan.cuh>

#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/rows.cuh"
#include "common/vec.cuh"
#include "permute/permute.h"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"

namespace moe::permute {
namespace {

constexpr int kChunk = 512;  // slots per warp-chunk: 16 rounds of 32
constexpr int kScanThreads = 1024;
constexpr int kScanItems = kMaxExperts / kScanThreads;
constexpr int kHistBytes = 48 * 1024;

struct Workspace {
  int32_t* counts;  // [num_chunks][E]
  int32_t* starts;  // [E]
  int32_t* totals;  // [E]
};

int64_t num_chunks_for(int64_t num_slots) { return (num_slots + kChunk - 1) / kChunk; }

Workspace carve(void* base, int64_t num_chunks, int32_t E) {
  auto* p = static_cast<int32_t*>(base);
  return Workspace{p, p + num_chunks * E, p + num_chunks * E + E};
}

int warps_per_block(int32_t E) {
  int w = kHistBytes / (4 * E);
  return w < 1 ? 1 : (w > 8 ? 8 : w);
}

__device__ __forceinline__ int32_t load_expert(const int32_t* indices, int64_t s, int64_t end, int32_t E) {
  int32_t e = s < end ? indices[s] : -1;
  return (e >= 0 && e < E) ? e : -1;
}

__global__ void count_kernel(const int32_t* __restrict__ indices, int64_t num_slots, int32_t E,
                             int64_t num_chunks, int32_t* __restrict__ counts) {
  extern __shared__ int32_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* hist = smem + warp * E;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  if (c >= num_chunks) return;
  for (int e = lane; e < E; e += 32) hist[e] = 0;
  __syncwarp();
  const int64_t begin = c * kChunk;
  const int64_t end = min(begin + kChunk, num_slots);
  for (int64_t base = begin; base < end; base += 32) {
    const int32_t e = load_expert(indices, base + lane, end, E);
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(peers) - 1) hist[e] += __popc(peers);
    __syncwarp();
  }
  for (int e = lane; e < E; e += 32) counts[c * E + e] = hist[e];
}

// Rewrites counts[c0..c1)[e] as an exclusive prefix starting at `running`; returns the end value.
// Loads are batched so several are in flight; the running sum itself is serial.
__device__ int32_t scan_column(int32_t* counts, int32_t E, int e, int64_t c0, int64_t c1, int32_t running) {
  constexpr int kBatch = 8;
  int64_t c = c0;
  for (; c + kBatch <= c1; c += kBatch) {
    int32_t v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = counts[(c + i) * E + e];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      counts[(c + i) * E + e] = running;
      running += v[i];
    }
  }
  for (; c < c1; ++c) {
    const int32_t v = counts[c * E + e];
    counts[c * E + e] = running;
    running += v;
  }
  return running;
}

__device__ int32_t sum_column(const int32_t* counts, int32_t E, int e, int64_t c0, int64_t c1) {
  int32_t sum = 0;
#pragma unroll 8
  for (int64_t c = c0; c < c1; ++c) sum += counts[c * E + e];
  return sum;
}

__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int32_t* __restrict__ counts, int64_t num_chunks, int32_t E, int32_t align,
                int32_t* __restrict__ starts, int32_t* __restrict__ totals, int32_t* __restrict__ group_sizes) {
  using BlockScan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int32_t padded[kMaxExperts];
  __shared__ int32_t partial[kScanThreads];
  // Few experts leave threads idle, so each expert's chunk column is split into `parts` pieces
  // scanned in parallel (sum, prefix over pieces, rewrite).
  const int parts = E >= kScanThreads ? 1 : kScanThreads / E;
  if (parts == 1) {
    for (int e = threadIdx.x; e < E; e += kScanThreads) {
      const int32_t total = scan_column(counts, E, e, 0, num_chunks, 0);
      totals[e] = total;
      padded[e] = (total + align - 1) / align * align;
    }
  } else {
    const int part = threadIdx.x / E, e = threadIdx.x % E;
    const int64_t per_part = (num_chunks + parts - 1) / parts;
    const int64_t c0 = min(int64_t(part) * per_part, num_chunks);
    const int64_t c1 = min(c0 + per_part, num_chunks);
    if (part < parts) partial[threadIdx.x] = sum_column(counts, E, e, c0, c1);
    __syncthreads();
    if (part < parts) {
      int32_t offset = 0;
      for (int q = 0; q < part; ++q) offset += partial[q * E + e];
      const int32_t end = scan_column(counts, E, e, c0, c1, offset);
      if (part == parts - 1) {
        totals[e] = end;
        padded[e] = (end + align - 1) / align * align;
      }
    }
  }
  __syncthreads();
  int32_t items[kScanItems];
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    const int e = threadIdx.x * kScanItems + i;
    items[i] = e < E ? padded[e] : 0;
  }
  BlockScan(scan_storage).ExclusiveSum(items, items);
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    const int e = threadIdx.x * kScanItems + i;
    if (e < E) {
      starts[e] = items[i];
      group_sizes[e] = padded[e];
    }
  }
}

__global__ void map_kernel(const int32_t* __restrict__ indices, int64_t num_slots, int32_t E,
                           int64_t num_chunks, const int32_t* __restrict__ counts,
                           const int32_t* __restrict__ starts, int32_t* __restrict__ row_map) {
  extern __shared__ int32_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* next_row = smem + warp * E;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  if (c >= num_chunks) return;
  for (int e = lane; e < E; e += 32) next_row[e] = starts[e] + counts[c * E + e];
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t begin = c * kChunk;
  const int64_t end = min(begin + kChunk, num_slots);
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t s = base + lane;
    const int32_t e = load_expert(indices, s, end, E);
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (s < end) row_map[s] = e >= 0 ? next_row[e] + __popc(peers & lanes_below) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) next_row[e] += __popc(peers);
    __syncwarp();
  }
}

template <int VB>
__global__ void __launch_bounds__(kRowBlockThreads)
    copy_kernel(const char* __restrict__ x, const int32_t* __restrict__ row_map, char* __restrict__ x_perm,
                int64_t T, int64_t k, int64_t row_bytes, RowGeometry g, int64_t token_blocks,
                const int32_t* __restrict__ starts, const int32_t* __restrict__ totals,
                const int32_t* __restrict__ group_sizes) {
  using V = typename RawVec<VB>::type;
  const int64_t row_vecs = g.row_vecs;
  if (blockIdx.x >= token_blocks) {
    // Padding rows of one expert: [start + count, start + padded).
    const int e = int(blockIdx.x - token_blocks);
    const int64_t first = int64_t(starts[e]) + totals[e];
    const int64_t last = int64_t(starts[e]) + group_sizes[e];
    for (int64_t r = first; r < last; ++r) {
      V* dst = reinterpret_cast<V*>(x_perm + r * row_bytes);
      for (int64_t v = threadIdx.x; v < row_vecs; v += blockDim.x) dst[v] = V{};
    }
    return;
  }
  const int tpr = g.threads_per_row;
  const int lane = threadIdx.x % tpr;
  const int64_t t = int64_t(blockIdx.x) * g.rows_per_block + threadIdx.x / tpr;
  if (t >= T) return;
  const V* src = reinterpret_cast<const V*>(x + t * row_bytes);
  for (int64_t seg = 0; seg < row_vecs; seg += int64_t(tpr) * kRowItems) {
    V regs[kRowItems];
#pragma unroll
    for (int i = 0; i < kRowItems; ++i) {
      const int64_t v = seg + lane + int64_t(i) * tpr;
      if (v < row_vecs) regs[i] = src[v];
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row_map[t * k + j];
      if (r < 0) continue;
      V* dst = reinterpret_cast<V*>(x_perm + int64_t(r) * row_bytes);
#pragma unroll
      for (int i = 0; i < kRowItems; ++i) {
        const int64_t v = seg + lane + int64_t(i) * tpr;
        if (v < row_vecs) dst[v] = regs[i];
      }
    }
  }
}

template <int VB>
void launch_copy(const PermuteParams& p, const Workspace& ws, cudaStream_t stream) {
  const RowGeometry g = row_geometry(p.row_bytes, VB);
  const int64_t token_blocks = (p.num_tokens + g.rows_per_block - 1) / g.rows_per_block;
  const int64_t blocks = token_blocks + (p.align > 1 ? p.num_experts : 0);
  copy_kernel<VB><<<dim3(unsigned(blocks)), kRowBlockThreads, 0, stream>>>(
      static_cast<const char*>(p.x), p.row_map, static_cast<char*>(p.x_perm), p.num_tokens, p.k,
      p.row_bytes, g, token_blocks, ws.starts, ws.totals, p.group_sizes);
  check_launch("permute copy_kernel");
}

constexpr int kQuantThreads = 256;
constexpr int kQuantLanes = 16;                                // lanes per 1x128 block
constexpr int kQuantItems = quant::kFp8Block / kQuantLanes;    // 8 elements per lane
constexpr int kQuantGroups = kQuantThreads / kQuantLanes;      // blocks per thread block and pass
constexpr int64_t kQuantMaxBlocks = 1 << 16;

// VEC: each lane's 8 elements are contiguous (H % 8 == 0, aligned rows) or strided by 16. The scale and
// the rounding are quantize_fp8's (quant/fp8_math.cuh), so the codes equal quantize_fp8(permute(x)).
template <typename T, bool VEC>
__global__ void __launch_bounds__(kQuantThreads)
    quant_copy_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_map, T* __restrict__ x_perm,
                      uint8_t* __restrict__ codes, float* __restrict__ scales, int64_t T_, int64_t k, int64_t H,
                      int64_t bpr, int64_t quant_blocks, bool pow2, const int32_t* __restrict__ starts,
                      const int32_t* __restrict__ totals, const int32_t* __restrict__ group_sizes) {
  if (blockIdx.x >= quant_blocks) {
    // Padding rows of one expert: zero codes, scale 0, zero values.
    const int e = int(blockIdx.x - quant_blocks);
    const int64_t first = int64_t(starts[e]) + totals[e];
    const int64_t last = int64_t(starts[e]) + group_sizes[e];
    for (int64_t r = first; r < last; ++r) {
      for (int64_t c = threadIdx.x; c < H; c += kQuantThreads) {
        codes[r * H + c] = 0;
        if (x_perm != nullptr) x_perm[r * H + c] = from_float<T>(0.f);
      }
      for (int64_t b = threadIdx.x; b < bpr; b += kQuantThreads) scales[r * bpr + b] = 0.f;
    }
    return;
  }
  const int lane = threadIdx.x % kQuantLanes;
  const int64_t total = T_ * bpr;
  // Every thread of the block runs the same number of passes (the shuffles need whole warps).
  for (int64_t base = int64_t(blockIdx.x) * kQuantGroups; base < total; base += quant_blocks * kQuantGroups) {
    const int64_t g = base + threadIdx.x / kQuantLanes;
    const bool live = g < total;
    const int64_t t = live ? g / bpr : 0;
    const int64_t cb = live ? g % bpr : 0;
    const int64_t c0 = cb * quant::kFp8Block;
    const T* src = x + t * H;
    Pack<T, kQuantItems> vals;
    float m = 0.f;
    if constexpr (VEC) {
      const int64_t c = c0 + lane * kQuantItems;
      const bool in = live && c < H;
      if (in) vals = *reinterpret_cast<const Pack<T, kQuantItems>*>(src + c);
#pragma unroll
      for (int j = 0; j < kQuantItems; ++j) {
        if (!in) vals.v[j] = from_float<T>(0.f);
        m = quant::nan_max(m, fabsf(to_float(vals.v[j])));
      }
    } else {
#pragma unroll
      for (int j = 0; j < kQuantItems; ++j) {
        const int64_t c = c0 + lane + j * kQuantLanes;
        vals.v[j] = (live && c < H) ? src[c] : from_float<T>(0.f);
        m = quant::nan_max(m, fabsf(to_float(vals.v[j])));
      }
    }
    const float s = quant::scale_from_amax(quant::warp_nan_max(m, kQuantLanes), false, pow2);
    if (!live) continue;
    Pack<uint8_t, kQuantItems> q;
#pragma unroll
    for (int j = 0; j < kQuantItems; ++j) q.v[j] = quant::to_fp8(__fmul_rn(to_float(vals.v[j]), s), false);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row_map[t * k + j];
      if (r < 0) continue;
      const int64_t row = int64_t(r);
      if (lane == 0) scales[row * bpr + cb] = s;
      if constexpr (VEC) {
        const int64_t c = c0 + lane * kQuantItems;
        if (c < H) {
          *reinterpret_cast<Pack<uint8_t, kQuantItems>*>(codes + row * H + c) = q;
          if (x_perm != nullptr) *reinterpret_cast<Pack<T, kQuantItems>*>(x_perm + row * H + c) = vals;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kQuantItems; ++i) {
          const int64_t c = c0 + lane + i * kQuantLanes;
          if (c < H) {
            codes[row * H + c] = q.v[i];
            if (x_perm != nullptr) x_perm[row * H + c] = vals.v[i];
          }
        }
      }
    }
  }
}

void launch_quant_copy(const PermuteParams& p, const Workspace& ws, cudaStream_t stream) {
  by_float_dtype(p.dtype, "permute_quantize_fp8", [&]<typename T>() {
    const int64_t H = p.row_bytes / int64_t(sizeof(T));
    const int64_t bpr = (H + quant::kFp8Block - 1) / quant::kFp8Block;
    const int64_t want = (p.num_tokens * bpr + kQuantGroups - 1) / kQuantGroups;
    const int64_t quant_blocks = want < kQuantMaxBlocks ? want : kQuantMaxBlocks;
    const int64_t blocks = quant_blocks + (p.align > 1 ? p.num_experts : 0);
    const bool vec = H % kQuantItems == 0 && reinterpret_cast<uintptr_t>(p.x) % alignof(Pack<T, kQuantItems>) == 0 &&
                     reinterpret_cast<uintptr_t>(p.x_perm) % alignof(Pack<T, kQuantItems>) == 0 &&
                     reinterpret_cast<uintptr_t>(p.fp8_codes) % kQuantItems == 0;
    const dim3 grid{unsigned(blocks)};
    if (vec) {
      quant_copy_kernel<T, true><<<grid, kQuantThreads, 0, stream>>>(
          static_cast<const T*>(p.x), p.row_map, static_cast<T*>(p.x_perm), p.fp8_codes, p.fp8_scales, p.num_tokens,
          p.k, H, bpr, quant_blocks, p.pow2, ws.starts, ws.totals, p.group_sizes);
    } else {
      quant_copy_kernel<T, false><<<grid, kQuantThreads, 0, stream>>>(
          static_cast<const T*>(p.x), p.row_map, static_cast<T*>(p.x_perm), p.fp8_codes, p.fp8_scales, p.num_tokens,
          p.k, H, bpr, quant_blocks, p.pow2, ws.starts, ws.totals, p.group_sizes);
    }
    check_launch("permute quant_copy_kernel");
  });
}

}  // namespace

size_t permute_workspace_bytes(int64_t num_slots, int32_t num_experts) {
  return size_t(num_chunks_for(num_slots) * num_experts + 2 * int64_t(num_experts)) * sizeof(int32_t);
}

const int32_t* permute_expert_starts(const void* workspace, int64_t num_slots, int32_t num_experts) {
  return carve(const_cast<void*>(workspace), num_chunks_for(num_slots), num_experts).starts;
}

int64_t permute_starts_offset(int64_t num_slots, int32_t num_experts) {
  return num_chunks_for(num_slots) * num_experts * int64_t(sizeof(int32_t));
}

void permute_fwd(const PermuteParams& p, cudaStream_t stream) {
  const int64_t num_slots = p.num_tokens * p.k;
  const int32_t E = p.num_experts;
  if (E <= 0 || E > kMaxExperts) throw std::invalid_argument("permute: num_experts out of range");
  if (num_slots == 0) {
    check_cuda(cudaMemsetAsync(p.group_sizes, 0, sizeof(int32_t) * E, stream), "permute memset");
    return;
  }
  const int64_t nc = num_chunks_for(num_slots);
  const Workspace ws = carve(p.workspace, nc, E);
  const int W = warps_per_block(E);
  const unsigned hist_blocks = unsigned((nc + W - 1) / W);
  const size_t hist_smem = size_t(W) * E * sizeof(int32_t);

  count_kernel<<<hist_blocks, W * 32, hist_smem, stream>>>(p.indices, num_slots, E, nc, ws.counts);
  check_launch("permute count_kernel");
  scan_kernel<<<1, kScanThreads, 0, stream>>>(ws.counts, nc, E, p.align, ws.starts, ws.totals, p.group_sizes);
  check_launch("permute scan_kernel");
  map_kernel<<<hist_blocks, W * 32, hist_smem, stream>>>(p.indices, num_slots, E, nc, ws.counts, ws.starts,
                                                         p.row_map);
  check_launch("permute map_kernel");
  if (p.row_bytes == 0) return;
  if (p.fp8_codes != nullptr) return launch_quant_copy(p, ws, stream);

  const void* ptrs[] = {p.x, p.x_perm};
  switch (widest_vector(p.row_bytes, ptrs, 2)) {
    case 16: launch_copy<16>(p, ws, stream); break;
    case 8: launch_copy<8>(p, ws, stream); break;
    case 4: launch_copy<4>(p, ws, stream); break;
    case 2: launch_copy<2>(p, ws, stream); break;
    default: launch_copy<1>(p, ws, stream); break;
  }
}

namespace {

__global__ void tokens_per_expert_kernel(const int32_t* __restrict__ indices, int64_t num_slots, int32_t E,
                                         int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots; s += stride) {
    const int32_t e = indices[s];
    if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (hist[e]) atomicAdd(&counts[e], hist[e]);
  }
}

}  // namespace

void tokens_per_expert(const int32_t* indices, int64_t num_slots, int32_t E, int32_t* counts,
                       cudaStream_t stream) {
  if (E <= 0 || E > kMaxExperts) throw std::invalid_argument("tokens_per_expert: num_experts out of range");
  check_cuda(cudaMemsetAsync(counts, 0, sizeof(int32_t) * E, stream), "tokens_per_expert memset");
  if (num_slots == 0) return;
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU, few enough that the per-block histogram flush stays cheap.
  const int64_t want = (num_slots + kThreads * 16 - 1) / (kThreads * 16);
  const unsigned blocks = unsigned(want < 264 ? want : 264);
  tokens_per_expert_kernel<<<blocks, kThreads, E * sizeof(int32_t), stream>>>(indices, num_slots, E, counts);
  check_launch("tokens_per_expert_kernel");
}

namespace {

__global__ void rows_to_tokens_kernel(const int32_t* __restrict__ row_map, int64_t num_slots, int64_t k, int64_t R,
                                      int32_t* __restrict__ row_token) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots; s += stride) {
    const int32_t r = row_map[s];
    if (r >= 0 && r < R) row_token[r] = int32_t(s / k);
  }
}

__global__ void slot_values_to_rows_kernel(const int32_t* __restrict__ row_map, const float* __restrict__ values,
                                           int64_t num_slots, int64_t R, float* __restrict__ rows) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots; s += stride) {
    const int32_t r = row_map[s];
    if (r >= 0 && r < R) rows[r] = values[s];
  }
}

__global__ void rows_to_slot_values_kernel(const int32_t* __restrict__ row_map, const float* __restrict__ rows,
                                           int64_t num_slots, int64_t R, float* __restrict__ values) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots; s += stride) {
    const int32_t r = row_map[s];
    values[s] = r >= 0 && r < R ? rows[r] : 0.f;
  }
}

unsigned slot_grid(int64_t n, int threads) {
  const int64_t want = (n + threads - 1) / threads;
  return unsigned(want < 1024 ? want : 1024);
}

}  // namespace

void slot_values_to_rows(const int32_t* row_map, const float* values, int64_t num_slots, int64_t num_rows, float* rows,
                         cudaStream_t stream) {
  if (num_rows == 0) return;
  check_cuda(cudaMemsetAsync(rows, 0, sizeof(float) * num_rows, stream), "slot_values_to_rows memset");
  if (num_slots == 0) return;
  constexpr int kThreads = 256;
  slot_values_to_rows_kernel<<<slot_grid(num_slots, kThreads), kThreads, 0, stream>>>(row_map, values, num_slots,
                                                                                      num_rows, rows);
  check_launch("slot_values_to_rows_kernel");
}

void rows_to_slot_values(const int32_t* row_map, const float* rows, int64_t num_slots, int64_t num_rows, float* values,
                         cudaStream_t stream) {
  if (num_slots == 0) return;
  constexpr int kThreads = 256;
  rows_to_slot_values_kernel<<<slot_grid(num_slots, kThreads), kThreads, 0, stream>>>(row_map, rows, num_slots,
                                                                                      num_rows, values);
  check_launch("rows_to_slot_values_kernel");
}

void rows_to_tokens(const int32_t* row_map, int64_t num_tokens, int64_t k, int64_t num_rows, int32_t* row_token,
                    cudaStream_t stream) {
  if (num_rows == 0) return;
  check_cuda(cudaMemsetAsync(row_token, 0xff, sizeof(int32_t) * num_rows, stream), "rows_to_tokens memset");  // -1
  const int64_t n = num_tokens * k;
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t want = (n + kThreads - 1) / kThreads;
  rows_to_tokens_kernel<<<unsigned(want < 1024 ? want : 1024), kThreads, 0, stream>>>(row_map, n, k, num_rows,
                                                                                     row_token);
  check_launch("rows_to_tokens_kernel");
}

}  // namespace moe::permute
