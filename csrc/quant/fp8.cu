// FP8 quantization kernels. Amax is a max, exact in any order, so every granularity is deterministic.
//   tensor: a grid-wide amax (atomicMax on the bits of |x|, NaN above every number) then one
//           elementwise pass that derives the scale on the device: no host sync.
//   row:    one block per row: amax pass, then quantize (the second read hits L2).
//   block:  16 lanes per 1x128 block, 8 elements each (one 16-byte load when the row allows it), four
//           blocks per lane group loaded before the first is reduced (two for fp32), amax by shuffles,
//           then 8 fp8 bytes stored at once.
//   tile:   the experts' tile kernel (fp8_experts.cu) on one expert, the row-major layout alone: the tile
//           loaded once into registers with 16-byte loads, amax over the block, codes from registers.
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <stdexcept>

#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/fp8.h"
#include "quant/fp8_math.cuh"

namespace moe::quant {
namespace {

constexpr int kThreads = kAmaxThreads;
constexpr int kGroupLanes = 16;                  // lanes per 1x128 block
constexpr int kGroupItems = kFp8Block / kGroupLanes;  // 8 elements per lane
constexpr int kGroupsPerBlock = kThreads / kGroupLanes;

__device__ __forceinline__ float from_fp8(uint8_t q, bool e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(q), e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tensor_quant_kernel(Fp8QuantParams p, int64_t n) {
  const float s = scale_from_amax(__uint_as_float(*p.amax), p.e5m2, p.pow2);
  if (blockIdx.x == 0 && threadIdx.x == 0) p.scale[0] = s;
  const T* x = static_cast<const T*>(p.x);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    p.q[i] = to_fp8(__fmul_rn(to_float(x[i]), s), p.e5m2);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) row_quant_kernel(Fp8QuantParams p) {
  const T* x = static_cast<const T*>(p.x);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* row = x + r * p.cols;
    float m = 0.f;
    for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) m = nan_max(m, fabsf(to_float(row[c])));
    const float s = scale_from_amax(block_nan_max(m), p.e5m2, p.pow2);
    if (threadIdx.x == 0) p.scale[r] = s;
    uint8_t* q = p.q + r * p.cols;
    for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) q[c] = to_fp8(__fmul_rn(to_float(row[c]), s), p.e5m2);
  }
}

// VEC: each lane's 8 elements are contiguous (cols % 8 == 0, 16-byte aligned rows) or strided by 16.
// U: 1x128 blocks per lane group and iteration, all their loads issued before the first amax (U vector loads
// in flight per thread: one per thread leaves the memory system short of requests at these sizes). The
// CTA's 16 groups take 16 consecutive blocks per u, so each u's loads stay coalesced across the CTA.
template <typename T, bool VEC, int U>
__global__ void __launch_bounds__(kThreads) block_quant_kernel(Fp8QuantParams p, int64_t blocks_per_row) {
  const T* x = static_cast<const T*>(p.x);
  const int lane = threadIdx.x % kGroupLanes;
  const int64_t total = p.rows * blocks_per_row;
  constexpr int64_t kStep = int64_t(kGroupsPerBlock) * U;
  for (int64_t base = int64_t(blockIdx.x) * kStep; base < total; base += int64_t(gridDim.x) * kStep) {
    // Per u: the block index g (its scale's index), the offset of the lane's first element and its column.
    // VEC keeps the loaded elements packed (half the registers of floats) until their amax.
    int64_t g[U], off[U], qoff[U], col[VEC ? 1 : U];
    bool in[U];   // VEC: the lane's vector is in the row (cols % 8 == 0: all in or all out)
    bool out[U];  // VEC: ... in q's row (q_cols % 8 == 0)
    Pack<T, kGroupItems> pk[U];
    float v[VEC ? 1 : U][kGroupItems];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      g[u] = base + u * kGroupsPerBlock + threadIdx.x / kGroupLanes;  // the whole warp shuffles below
      const bool live = g[u] < total;
      const int64_t r = live ? g[u] / blocks_per_row : 0;
      const int64_t c = live ? (g[u] - r * blocks_per_row) * kFp8Block + lane * (VEC ? kGroupItems : 1) : p.cols;
      off[u] = r * p.cols + c;
      qoff[u] = r * p.q_cols + c;
      in[u] = c < p.cols;
      out[u] = c < p.q_cols;
      if constexpr (VEC) {
        if (in[u]) pk[u] = *reinterpret_cast<const Pack<T, kGroupItems>*>(x + off[u]);
      } else {
        col[u] = c;
#pragma unroll
        for (int j = 0; j < kGroupItems; ++j) {
          v[u][j] = col[u] + j * kGroupLanes < p.cols ? to_float(x[off[u] + j * kGroupLanes]) : 0.f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float e[kGroupItems];
#pragma unroll
      for (int j = 0; j < kGroupItems; ++j) {
        if constexpr (VEC) {
          e[j] = in[u] ? to_float(pk[u].v[j]) : 0.f;
        } else {
          e[j] = v[u][j];
        }
      }
      float m = 0.f;
#pragma unroll
      for (int j = 0; j < kGroupItems; ++j) m = nan_max(m, fabsf(e[j]));
      const float s = scale_from_amax(warp_nan_max(m, kGroupLanes), p.e5m2, p.pow2);
      if (g[u] >= total) continue;
      if (lane == 0) p.scale[g[u]] = s;
      // Past cols, up to q_cols, e is 0 and so is its code: the zero padding of a K that is no multiple of 128.
      if constexpr (VEC) {
        if (out[u]) {
          Pack<uint8_t, kGroupItems> codes;
#pragma unroll
          for (int j = 0; j < kGroupItems; ++j) codes.v[j] = to_fp8(__fmul_rn(e[j], s), p.e5m2);
          *reinterpret_cast<Pack<uint8_t, kGroupItems>*>(p.q + qoff[u]) = codes;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kGroupItems; ++j) {
          if (col[u] + j * kGroupLanes < p.q_cols) p.q[qoff[u] + j * kGroupLanes] = to_fp8(__fmul_rn(e[j], s), p.e5m2);
        }
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) dequant_kernel(Fp8DequantParams p, int64_t blocks_per_row) {
  T* out = static_cast<T*>(p.out);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
      int64_t si = 0;
      switch (p.granularity) {
        case Granularity::kTensor: si = 0; break;
        case Granularity::kRow: si = r; break;
        case Granularity::kBlock: si = r * blocks_per_row + c / kFp8Block; break;
        case Granularity::kTile: si = (r / kFp8Block) * blocks_per_row + c / kFp8Block; break;
      }
      const float s = p.scale[si];
      const float v = __fdiv_rn(from_fp8(p.q[r * p.cols + c], p.e5m2), s);
      out[r * p.cols + c] = from_float<T>(s == 0.f ? 0.f : v);  // 0: a block of zeros (permute's padding), not 0 / 0
    }
  }
}

unsigned capped_grid(int64_t want) { return unsigned(want < 1 ? 1 : (want < 65536 ? want : 65536)); }

}  // namespace

void fp8_quantize(const Fp8QuantParams& params, cudaStream_t stream) {
  if (params.rows < 0 || params.cols < 0) throw std::invalid_argument("quantize_fp8: negative size");
  Fp8QuantParams p = params;
  if (p.q_cols == 0) p.q_cols = p.cols;
  const int64_t n = p.rows * p.cols;
  const int64_t bpr = (p.cols + kFp8Block - 1) / kFp8Block;
  if (p.q_cols != p.cols && (p.granularity != Granularity::kBlock || p.q_cols < p.cols || p.q_cols > bpr * kFp8Block)) {
    throw std::invalid_argument("quantize_fp8: q_cols must be cols, or up to ceil(cols / 128) * 128 for 1x128 blocks");
  }
  if (p.granularity == Granularity::kTile) {  // one expert of the experts' tile kernel, the row-major layout alone
    fp8_quantize_experts({p.x, p.q, p.scale, nullptr, nullptr, 1, p.rows, p.cols, p.pow2, p.dtype, p.e5m2}, stream);
    return;
  }
  by_float_dtype(p.dtype, "quantize_fp8", [&]<typename T>() {
    switch (p.granularity) {
      case Granularity::kTensor: {
        check_cuda(cudaMemsetAsync(p.amax, 0, sizeof(uint32_t), stream), "quantize_fp8 memset");
        const unsigned grid = capped_grid(std::min<int64_t>((n + kThreads - 1) / kThreads, 1056));
        if (n > 0) {
          tensor_amax_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(p.x), n, p.amax);
          check_launch("fp8 tensor_amax_kernel");
        }
        tensor_quant_kernel<T><<<capped_grid((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p, n);
        check_launch("fp8 tensor_quant_kernel");
        break;
      }
      case Granularity::kRow:
        if (p.rows == 0) return;
        row_quant_kernel<T><<<capped_grid(p.rows), kThreads, 0, stream>>>(p);
        check_launch("fp8 row_quant_kernel");
        break;
      case Granularity::kBlock: {
        const int64_t total = p.rows * bpr;
        if (total == 0) return;
        // Pack<T, 8> is 16 bytes for 2-byte types and 32 for float (one 256-bit load on sm_100): 64 bytes of
        // loads in flight per thread either way.
        constexpr int U = sizeof(T) == 4 ? 2 : 4;
        const unsigned grid = capped_grid((total + kGroupsPerBlock * U - 1) / (kGroupsPerBlock * U));
        const bool vec = p.cols % kGroupItems == 0 && p.q_cols % kGroupItems == 0 &&
                         reinterpret_cast<uintptr_t>(p.x) % alignof(Pack<T, kGroupItems>) == 0 &&
                         reinterpret_cast<uintptr_t>(p.q) % 8 == 0;
        if (vec) {
          block_quant_kernel<T, true, U><<<grid, kThreads, 0, stream>>>(p, bpr);
        } else {
          block_quant_kernel<T, false, U><<<grid, kThreads, 0, stream>>>(p, bpr);
        }
        check_launch("fp8 block_quant_kernel");
        break;
      }
      default: throw std::invalid_argument("quantize_fp8: unknown granularity");
    }
  });
}

void fp8_dequantize(const Fp8DequantParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0) throw std::invalid_argument("dequantize_fp8: negative size");
  if (p.rows == 0 || p.cols == 0) return;
  const int64_t bpr = (p.cols + kFp8Block - 1) / kFp8Block;
  by_float_dtype(p.dtype, "dequantize_fp8", [&]<typename T>() {
    dequant_kernel<T><<<capped_grid(p.rows), kThreads, 0, stream>>>(p, bpr);
  });
  check_launch("fp8 dequant_kernel");
}

}  // namespace moe::quant
