// Each op family registers its functions on the `_C` module from its own file.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include <cuda_runtime.h>

#include "common/check.h"

namespace moe::api {

// Python passes device pointers and streams as integers (tensor.data_ptr(), stream.cuda_stream).
template <typename T>
inline T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
// Every launch names its device: this module's runtime keeps its own current device, which need not
// be the one torch made current.
inline cudaStream_t on_device(int device, uintptr_t s) {
  moe::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  return reinterpret_cast<cudaStream_t>(s);
}

void register_permute(pybind11::module_& m);

}  // namespace moe::api
