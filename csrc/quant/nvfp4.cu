// NVFP4 quantization kernels: one thread per block of 16 elements (two 16-byte loads for bf16, one
// 8-byte store of packed codes, one scale byte). 2-D tiles take a pre-pass that writes each 16x16
// tile's amax. The global amax comes from the caller or from a grid-wide amax pass; either way the
// global scale is derived on the device (no host sync).
#include <cuda_fp8.h>

#include <cfloat>
#include <stdexcept>

#include "common/check.h"
#include "common/dispatch.cuh"
#include "common/vec.cuh"
#include "quant/amax.cuh"
#include "quant/nvfp4.h"

namespace moe::quant {
namespace {

constexpr int kThreads = kAmaxThreads;

__device__ __forceinline__ float global_scale_from(float amax) {
  return (isfinite(amax) && amax > 0.f) ? fminf(__fdiv_rn(2688.f, amax), FLT_MAX) : 1.f;
}

__device__ __forceinline__ uint8_t e4m3(float v) {
  if (isnan(v)) return 0x7f;
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float from_e4m3(uint8_t q) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(q), __NV_E4M3)));
}

__device__ __forceinline__ float grid_value(int code) {
  switch (code) {
    case 0: return 0.f;
    case 1: return 0.5f;
    case 2: return 1.f;
    case 3: return 1.5f;
    case 4: return 2.f;
    case 5: return 3.f;
    case 6: return 4.f;
    default: return 6.f;
  }
}

// Round-to-nearest-even on the E2M1 grid, ties to the even code, saturating at 6. NaN -> 0. a = |v| >= 0.
// Below 1 the grid is the multiples of 0.5: code = rint(2a), ties to even. From 1 on it is a float with one
// mantissa bit (1, 1.5, 2, 3, 4, 6 = 2^e (1 + m/2), code 2 + 2e + m): the fp32 bits rounded to that bit, ties to
// even (the carry moves into the exponent), then the code read off, 7 and above saturating to 7 (6; inf too).
// The same codes as counting the thresholds 0.25 < 0.75 <= 1.25 < 1.75 <= 2.5 < 3.5 <= 5 <, in fewer instructions.
__device__ __forceinline__ uint32_t e2m1_rne(float a) {
  if (!(a >= 1.f)) return a > 0.25f ? uint32_t(__float2int_rn(2.f * a)) : 0u;  // NaN fails both tests: 0
  uint32_t bits = __float_as_uint(a);
  bits += 0x1fffffu + ((bits >> 22) & 1u);
  const uint32_t code = 2u * ((bits >> 23) - 126u) + ((bits >> 22) & 1u);
  return code < 7u ? code : 7u;
}

// Stochastic: the grid point below, or the one above with probability (a - lo) / (hi - lo). The
// spacing is a power of two, so the fraction and its scaling by 2^24 are exact.
__device__ __forceinline__ uint32_t e2m1_stochastic(float a, uint32_t bits) {
  const uint32_t lo = uint32_t(a >= 0.5f) + uint32_t(a >= 1.f) + uint32_t(a >= 1.5f) + uint32_t(a >= 2.f) +
                      uint32_t(a >= 3.f) + uint32_t(a >= 4.f) + uint32_t(a >= 6.f);
  if (lo == 7 || isnan(a)) return lo;
  const float frac = __fdiv_rn(a - grid_value(lo), grid_value(lo + 1) - grid_value(lo));
  return lo + uint32_t(float(bits >> 8) < __fmul_rn(frac, 16777216.f));
}

__device__ __forceinline__ uint32_t e2m1_code(float v, bool stochastic, uint32_t bits) {
  const float a = fabsf(v);
  const uint32_t mag = stochastic ? e2m1_stochastic(a, bits) : e2m1_rne(a);
  return mag | ((signbit(v) && !isnan(v)) ? 8u : 0u);
}

// Philox4x32-10 (Salmon et al., Random123): 10 rounds of the multiply-xor round with a Weyl key bump.
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

// The 16 elements of one block: 16-byte loads when the base pointer allows (a block starts 16
// elements after the previous one, so every block is then aligned too), else element by element.
template <typename T, bool VEC>
__device__ __forceinline__ void load16(const T* src, float* v) {
  if constexpr (VEC) {
    constexpr int N = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < kNvfp4Block / N; ++c) {
      const Pack<T, N> a = reinterpret_cast<const Pack<T, N>*>(src)[c];
#pragma unroll
      for (int j = 0; j < N; ++j) v[c * N + j] = to_float(a.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kNvfp4Block; ++j) v[j] = to_float(src[j]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tile_amax_kernel(Nvfp4QuantParams p, int64_t kblocks, int64_t tiles) {
  const T* x = static_cast<const T*>(p.x);
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < tiles; t += int64_t(gridDim.x) * kThreads) {
    const int64_t r0 = (t / kblocks) * kNvfp4Block, c0 = (t % kblocks) * kNvfp4Block;
    const int64_t r1 = r0 + kNvfp4Block < p.rows ? r0 + kNvfp4Block : p.rows;
    float m = 0.f;
    for (int64_t r = r0; r < r1; ++r) {
      for (int j = 0; j < kNvfp4Block; ++j) m = nan_max(m, fabsf(to_float(x[r * p.cols + c0 + j])));
    }
    p.tile_amax[t] = m;
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads) quant_kernel(Nvfp4QuantParams p, int64_t kblocks) {
  const float amax = p.amax != nullptr ? *p.amax : __uint_as_float(*p.amax_scratch);
  const float sg = global_scale_from(amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.global_scale = sg;
  const bool stochastic = p.rng != nullptr;
  uint2 key = make_uint2(0u, 0u);
  uint64_t offset = 0;
  if (stochastic) {
    const uint64_t seed = uint64_t(p.rng[0]);
    offset = uint64_t(p.rng[1]);
    key = make_uint2(uint32_t(seed), uint32_t(seed >> 32));
  }
  const T* x = static_cast<const T*>(p.x);
  const int64_t total = p.rows * kblocks;
  // Rows are cols = 16 * kblocks elements long, so block b starts at element 16 b and its codes at byte 8 b: no
  // division by kblocks but the 2-D tiles' (their amax index).
  for (int64_t b = int64_t(blockIdx.x) * kThreads + threadIdx.x; b < total; b += int64_t(gridDim.x) * kThreads) {
    float v[kNvfp4Block];
    load16<T, VEC>(x + b * kNvfp4Block, v);
    float bamax = 0.f;
    if (p.tile_2d) {
      const int64_t r = b / kblocks;
      bamax = p.tile_amax[(r / kNvfp4Block) * kblocks + (b - r * kblocks)];
    } else {
#pragma unroll
      for (int j = 0; j < kNvfp4Block; ++j) bamax = nan_max(bamax, fabsf(v[j]));
    }
    const uint8_t sb = e4m3(__fmul_rn(__fdiv_rn(bamax, 6.f), sg));
    const float sbf = from_e4m3(sb);
    uint32_t words[2] = {0u, 0u};
    if (sbf != 0.f) {
      const float rs = __fdiv_rn(sg, sbf);
      const uint64_t first = uint64_t(b) * kNvfp4Block;  // element index of v[0]: a multiple of 16
#pragma unroll
      for (int g = 0; g < kNvfp4Block / 4; ++g) {
        uint4 bits = make_uint4(0u, 0u, 0u, 0u);
        if (stochastic) {
          const uint64_t group = (first >> 2) + g;
          bits = philox(make_uint4(uint32_t(group), uint32_t(group >> 32), uint32_t(offset), uint32_t(offset >> 32)),
                        key);
        }
        const uint32_t rnd[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = 4 * g + j;
          words[e / 8] |= e2m1_code(__fmul_rn(v[e], rs), stochastic, rnd[j]) << (4 * (e % 8));
        }
      }
    }
    *reinterpret_cast<uint2*>(p.packed + b * (kNvfp4Block / 2)) = make_uint2(words[0], words[1]);
    p.block_scale[b] = sb;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) dequant_kernel(Nvfp4DequantParams p, int64_t kblocks) {
  const float sg = *p.global_scale;
  T* out = static_cast<T*>(p.out);
  const int64_t total = p.rows * kblocks;
  for (int64_t b = int64_t(blockIdx.x) * kThreads + threadIdx.x; b < total; b += int64_t(gridDim.x) * kThreads) {
    const uint2 w = *reinterpret_cast<const uint2*>(p.packed + b * (kNvfp4Block / 2));  // (as in quant_kernel)
    const float sbf = from_e4m3(p.block_scale[b]);
    T* dst = out + b * kNvfp4Block;
#pragma unroll
    for (int e = 0; e < kNvfp4Block; ++e) {
      const uint32_t code = ((e < 8 ? w.x : w.y) >> (4 * (e % 8))) & 0xfu;
      const float q = (code & 8u) ? -grid_value(code & 7u) : grid_value(code & 7u);
      dst[e] = from_float<T>(__fdiv_rn(__fmul_rn(q, sbf), sg));
    }
  }
}

unsigned grid_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  return unsigned(want < 1 ? 1 : (want < 65536 ? want : 65536));
}

}  // namespace

void nvfp4_quantize(const Nvfp4QuantParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0 || p.cols % kNvfp4Block) throw std::invalid_argument("quantize_nvfp4: bad shape");
  const int64_t kblocks = p.cols / kNvfp4Block;
  const int64_t n = p.rows * p.cols;
  if (p.tile_2d && p.tile_amax == nullptr && n > 0) throw std::invalid_argument("quantize_nvfp4: 2-D tiles need scratch");
  if (reinterpret_cast<uintptr_t>(p.packed) % 8) throw std::invalid_argument("quantize_nvfp4: packed codes not 8-byte aligned");
  by_float_dtype(p.dtype, "quantize_nvfp4", [&]<typename T>() {
    if (p.amax == nullptr) {
      check_cuda(cudaMemsetAsync(p.amax_scratch, 0, sizeof(uint32_t), stream), "quantize_nvfp4 memset");
      if (n > 0) {
        tensor_amax_kernel<T><<<grid_for(n) < 1056 ? grid_for(n) : 1056, kThreads, 0, stream>>>(
            static_cast<const T*>(p.x), n, p.amax_scratch);
        check_launch("nvfp4 tensor_amax_kernel");
      }
    }
    if (p.tile_2d && n > 0) {
      const int64_t tiles = ((p.rows + kNvfp4Block - 1) / kNvfp4Block) * kblocks;
      tile_amax_kernel<T><<<grid_for(tiles), kThreads, 0, stream>>>(p, kblocks, tiles);
      check_launch("nvfp4 tile_amax_kernel");
    }
    const bool vec = reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
    if (vec) {
      quant_kernel<T, true><<<grid_for(p.rows * kblocks), kThreads, 0, stream>>>(p, kblocks);
    } else {
      quant_kernel<T, false><<<grid_for(p.rows * kblocks), kThreads, 0, stream>>>(p, kblocks);
    }
    check_launch("nvfp4 quant_kernel");
  });
}

void nvfp4_dequantize(const Nvfp4DequantParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0 || p.cols % kNvfp4Block) throw std::invalid_argument("dequantize_nvfp4: bad shape");
  if (reinterpret_cast<uintptr_t>(p.packed) % 8) throw std::invalid_argument("dequantize_nvfp4: packed codes not 8-byte aligned");
  const int64_t kblocks = p.cols / kNvfp4Block;
  by_float_dtype(p.dtype, "dequantize_nvfp4", [&]<typename T>() {
    if (p.rows * kblocks == 0) return;
    dequant_kernel<T><<<grid_for(p.rows * kblocks), kThreads, 0, stream>>>(p, kblocks);
  });
  check_launch("nvfp4 dequant_kernel");
}

}  // namespace moe::quant
