// Element-type dispatch for the floating-point kernels: calls f.template operator()<T>() with the
// CUDA type of `dtype`, or throws naming the caller.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "common/dtype.h"

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

}  // namespace moe
