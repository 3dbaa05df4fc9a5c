// Force-included (-include) before every CUDA source compiled for the CPU execution layer.
//
// The CUDA headers compile with a host compiler (their host paths: vector types, fp16/bf16/fp8
// conversions in software); this file adds what device code needs beyond them: the thread-index
// builtins, barriers and warp collectives (scheduled by runtime.cpp), atomics, the bit and float
// intrinsics, and CUDA's integer/float min and max.
//
// Rounding: build with -ffp-contract=off. nvcc contracts a * b + c into an fma by default, so a
// kernel that promises results bit-identical to a reference spells its roundings (__fmul_rn,
// __fadd_rn, __fmaf_rn); those are exact here too. expf/logf/... are the host's libm, which differs
// from the device's by a few ulp: transcendental results are compared with the tolerance policy.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "cuda_on_cpu/runtime.h"

#define CUDA_ON_CPU 1

// host_defines.h leaves __launch_bounds__ undefined outside nvcc.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif

#define threadIdx (::emu::self().thread_idx)
#define blockIdx (::emu::self().block_idx)
#define blockDim (::emu::self().block_dim)
#define gridDim (::emu::self().grid_dim)
#define warpSize 32

#define EMU_WHERE const char *emu_file = __builtin_FILE(), int emu_line = __builtin_LINE()

// ---------------------------------------------------------------------------------------------------
// Barriers and warp collectives

inline void __syncthreads(EMU_WHERE) { ::emu::block_barrier(0, emu_file, emu_line); }
inline int __syncthreads_count(int pred, EMU_WHERE) { return ::emu::block_barrier(pred != 0, emu_file, emu_line); }
inline int __syncthreads_and(int pred, EMU_WHERE) {
  // Every live thread arrives: the count equals the live threads iff all predicates hold.
  const int live_before = ::emu::block_barrier(1, emu_file, emu_line);
  return ::emu::block_barrier(pred != 0, emu_file, emu_line) == live_before;
}
inline int __syncthreads_or(int pred, EMU_WHERE) { return ::emu::block_barrier(pred != 0, emu_file, emu_line) > 0; }

namespace emu {

template <typename T>
inline T shuffle(Coll op, unsigned mask, T var, int arg, int width, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16, "shuffled values are at most 16 bytes");
  if (width <= 0 || width > 32 || (width & (width - 1))) fail("shuffle width must be a power of two <= 32", file, line);
  T out;
  warp_collective(CollArgs{op, mask, &var, int(sizeof(T)), arg, width, file, line}, &out, nullptr);
  return out;
}

inline unsigned vote(Coll op, unsigned mask, int pred, const char* file, int line) {
  const int p = pred != 0;
  unsigned out = 0;
  warp_collective(CollArgs{op, mask, &p, 4, 0, 32, file, line}, &out, nullptr);
  return out;
}

template <typename T>
inline unsigned reduce(Coll op, unsigned mask, T value, const char* file, int line) {
  static_assert(sizeof(T) == 4 && std::is_integral_v<T>, "__reduce_*_sync takes 32-bit integers");
  unsigned out = 0;
  warp_collective(CollArgs{op, mask, &value, 4, std::is_signed_v<T> ? 1 : 0, 32, file, line}, &out, nullptr);
  return out;
}

}  // namespace emu

inline void __syncwarp(unsigned mask = 0xffffffffu, EMU_WHERE) {
  int dummy = 0;
  ::emu::warp_collective(::emu::CollArgs{::emu::Coll::kSyncWarp, mask, &dummy, 4, 0, 32, emu_file, emu_line}, &dummy,
                         nullptr);
}
inline unsigned __activemask() { return ::emu::active_lanes(); }

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32, EMU_WHERE) {
  return ::emu::shuffle(::emu::Coll::kShflIdx, mask, var, src_lane, width, emu_file, emu_line);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, EMU_WHERE) {
  return ::emu::shuffle(::emu::Coll::kShflUp, mask, var, int(delta), width, emu_file, emu_line);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, EMU_WHERE) {
  return ::emu::shuffle(::emu::Coll::kShflDown, mask, var, int(delta), width, emu_file, emu_line);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32, EMU_WHERE) {
  return ::emu::shuffle(::emu::Coll::kShflXor, mask, var, lane_mask, width, emu_file, emu_line);
}

inline unsigned __ballot_sync(unsigned mask, int pred, EMU_WHERE) {
  return ::emu::vote(::emu::Coll::kBallot, mask, pred, emu_file, emu_line);
}
inline int __any_sync(unsigned mask, int pred, EMU_WHERE) {
  return int(::emu::vote(::emu::Coll::kAny, mask, pred, emu_file, emu_line));
}
inline int __all_sync(unsigned mask, int pred, EMU_WHERE) {
  return int(::emu::vote(::emu::Coll::kAll, mask, pred, emu_file, emu_line));
}

template <typename T>
inline unsigned __match_any_sync(unsigned mask, T value, EMU_WHERE) {
  static_assert(std::is_integral_v<T> || std::is_floating_point_v<T>, "__match_any_sync takes 32/64-bit values");
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_any_sync takes 32/64-bit values");
  unsigned out = 0;
  ::emu::warp_collective(::emu::CollArgs{::emu::Coll::kMatchAny, mask, &value, int(sizeof(T)), 0, 32, emu_file, emu_line},
                         &out, nullptr);
  return out;
}
template <typename T>
inline unsigned __match_all_sync(unsigned mask, T value, int* pred, EMU_WHERE) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_all_sync takes 32/64-bit values");
  unsigned out = 0;
  ::emu::warp_collective(::emu::CollArgs{::emu::Coll::kMatchAll, mask, &value, int(sizeof(T)), 0, 32, emu_file, emu_line},
                         &out, pred);
  return out;
}

#define EMU_REDUCE(name, op)                                                     \
  inline unsigned name(unsigned mask, unsigned value, EMU_WHERE) {               \
    return ::emu::reduce(::emu::Coll::op, mask, value, emu_file, emu_line);      \
  }
EMU_REDUCE(__reduce_and_sync, kReduceAnd)
EMU_REDUCE(__reduce_or_sync, kReduceOr)
EMU_REDUCE(__reduce_xor_sync, kReduceXor)
#undef EMU_REDUCE
#define EMU_REDUCE(name, op)                                                                       \
  inline unsigned name(unsigned mask, unsigned value, EMU_WHERE) {                                 \
    return ::emu::reduce(::emu::Coll::op, mask, value, emu_file, emu_line);                        \
  }                                                                                                \
  inline int name(unsigned mask, int value, EMU_WHERE) {                                           \
    return int(::emu::reduce(::emu::Coll::op, mask, value, emu_file, emu_line));                   \
  }
EMU_REDUCE(__reduce_add_sync, kReduceAdd)
EMU_REDUCE(__reduce_min_sync, kReduceMin)
EMU_REDUCE(__reduce_max_sync, kReduceMax)
#undef EMU_REDUCE

// ---------------------------------------------------------------------------------------------------
// Memory ordering: fibers of one launch share one OS thread and switch only at barriers and
// collectives, so every atomic is a plain read-modify-write and fences only order the compiler.

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __trap(EMU_WHERE) { ::emu::fail("__trap()", emu_file, emu_line); }
inline void __nanosleep(unsigned) {}
inline long long clock64() { return 0; }

template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline T __ldcv(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stwt(T* p, T v) { *p = v; }

namespace emu {
template <typename T> using same_t = std::type_identity_t<T>;
}

#define EMU_ATOMIC_SUFFIXES(name)                                                                        \
  template <typename T> inline T name##_block(T* p, ::emu::same_t<T> v) { return name(p, v); }           \
  template <typename T> inline T name##_system(T* p, ::emu::same_t<T> v) { return name(p, v); }

template <typename T> inline T atomicAdd(T* p, ::emu::same_t<T> v) { T old = *p; *p = T(old + v); return old; }
template <typename T> inline T atomicSub(T* p, ::emu::same_t<T> v) { T old = *p; *p = T(old - v); return old; }
template <typename T> inline T atomicExch(T* p, ::emu::same_t<T> v) { T old = *p; *p = v; return old; }
template <typename T> inline T atomicMin(T* p, ::emu::same_t<T> v) { T old = *p; *p = v < old ? v : old; return old; }
template <typename T> inline T atomicMax(T* p, ::emu::same_t<T> v) { T old = *p; *p = v > old ? v : old; return old; }
template <typename T> inline T atomicAnd(T* p, ::emu::same_t<T> v) { T old = *p; *p = old & v; return old; }
template <typename T> inline T atomicOr(T* p, ::emu::same_t<T> v) { T old = *p; *p = old | v; return old; }
template <typename T> inline T atomicXor(T* p, ::emu::same_t<T> v) { T old = *p; *p = old ^ v; return old; }
template <typename T> inline T atomicCAS(T* p, ::emu::same_t<T> cmp, ::emu::same_t<T> v) {
  T old = *p;
  if (old == cmp) *p = v;
  return old;
}
inline unsigned atomicInc(unsigned* p, unsigned v) { unsigned old = *p; *p = old >= v ? 0u : old + 1u; return old; }
inline unsigned atomicDec(unsigned* p, unsigned v) { unsigned old = *p; *p = (old == 0u || old > v) ? v : old - 1u; return old; }
EMU_ATOMIC_SUFFIXES(atomicAdd)
EMU_ATOMIC_SUFFIXES(atomicSub)
EMU_ATOMIC_SUFFIXES(atomicExch)
EMU_ATOMIC_SUFFIXES(atomicMin)
EMU_ATOMIC_SUFFIXES(atomicMax)
EMU_ATOMIC_SUFFIXES(atomicAnd)
EMU_ATOMIC_SUFFIXES(atomicOr)
EMU_ATOMIC_SUFFIXES(atomicXor)
#undef EMU_ATOMIC_SUFFIXES

// ---------------------------------------------------------------------------------------------------
// Integer intrinsics

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(unsigned(x))) << 32) | __brev(unsigned(x >> 32));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline int __mulhi(int a, int b) { return int((int64_t(a) * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) { return static_cast<long long>((static_cast<__int128>(a) * b) >> 64); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  return unsigned(((uint64_t(hi) << 32 | lo) << (shift & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return unsigned((uint64_t(hi) << 32 | lo) >> (shift & 31));
}

// ---------------------------------------------------------------------------------------------------
// Float intrinsics (round-to-nearest-even is the host's mode; -ffp-contract=off keeps products and
// sums separate roundings)

inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; std::memcpy(&x, &u, 4); return x; }
inline int __float_as_int(float x) { int u; std::memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }
inline double __longlong_as_double(long long u) { double x; std::memcpy(&x, &u, 8); return x; }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __saturatef(float x) { return x != x ? 0.f : (x < 0.f ? 0.f : (x > 1.f ? 1.f : x)); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.f / std::sqrt(x); }
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline int __float2int_rd(float x) { return int(std::floor(x)); }
inline int __float2int_ru(float x) { return int(std::ceil(x)); }
inline unsigned __float2uint_rn(float x) { return unsigned(std::nearbyint(x)); }
inline unsigned __float2uint_rz(float x) { return unsigned(x); }
inline long long __float2ll_rn(float x) { return (long long)std::nearbyint(x); }
inline float __int2float_rn(int x) { return float(x); }
inline float __uint2float_rn(unsigned x) { return float(x); }
inline float __ll2float_rn(long long x) { return float(x); }
inline float __double2float_rn(double x) { return float(x); }

// CUDA's global math overloads that the host's <cmath> keeps in std::.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// ---------------------------------------------------------------------------------------------------
// min / max: CUDA's overload set (mixed signed/unsigned pairs promote to unsigned, float/double to double)

#define EMU_MINMAX(T)                                             \
  inline T min(T a, T b) { return b < a ? b : a; }                \
  inline T max(T a, T b) { return a < b ? b : a; }
EMU_MINMAX(int)
EMU_MINMAX(unsigned)
EMU_MINMAX(long)
EMU_MINMAX(unsigned long)
EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
#undef EMU_MINMAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline unsigned min(int a, unsigned b) { return min(unsigned(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, unsigned(b)); }
inline unsigned max(int a, unsigned b) { return max(unsigned(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, unsigned(b)); }
inline unsigned long long min(long long a, unsigned long long b) { return min((unsigned long long)a, b); }
inline unsigned long long min(unsigned long long a, long long b) { return min(a, (unsigned long long)b); }
inline unsigned long long max(long long a, unsigned long long b) { return max((unsigned long long)a, b); }
inline unsigned long long max(unsigned long long a, long long b) { return max(a, (unsigned long long)b); }
inline double min(float a, double b) { return std::fmin(double(a), b); }
inline double min(double a, float b) { return std::fmin(a, double(b)); }
inline double max(float a, double b) { return std::fmax(double(a), b); }
inline double max(double a, float b) { return std::fmax(a, double(b)); }

#undef EMU_WHERE
