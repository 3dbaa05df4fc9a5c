// Element-type dispatch for the floating-point kernels: calls f.template operator()<T>() with the
// CUDA type of `dtype`, or throws naming the caller; by_float_vector adds the vector width.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "common/rows.cuh"

namespace moe {

template <typename F>
void by_float_dtype(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f.template operator()<float>();
    case DType::kFloat16: return f.template operator()<__half>();
    case DType::kBFloat16: return f.template operator()<__nv_bfloat16>();
    default: throw std::invalid_argument(std::string(what) + ": expected float32, float16 or bfloat16 data");
  }
}

// Calls f.template operator()<T, N>() with N the most elements of T per vector (16 bytes at most) that divide
// `len` elements and every non-null pointer's alignment: vectors never straddle two runs of `len` elements (rows).
template <typename T, typename F>
void by_vector_width(int64_t len, const void* const* ptrs, int n_ptrs, F&& f) {
  const int elems = widest_vector(len * int64_t(sizeof(T)), ptrs, n_ptrs) / int(sizeof(T));
  constexpr int kMax = 16 / int(sizeof(T));
  if (elems >= kMax) return f.template operator()<T, kMax>();
  if (kMax >= 4 && elems >= 4) return f.template operator()<T, (kMax >= 4 ? 4 : 1)>();
  if (kMax >= 2 && elems >= 2) return f.template operator()<T, (kMax >= 2 ? 2 : 1)>();
  return f.template operator()<T, 1>();
}

// by_float_dtype, then by_vector_width: f.template operator()<T, N>().
template <typename F>
void by_float_vector(DType dtype, int64_t len, const void* const* ptrs, int n_ptrs, const char* what, F&& f) {
  by_float_dtype(dtype, what, [&]<typename T>() { by_vector_width<T>(len, ptrs, n_ptrs, f); });
}

}  // namespace moe
