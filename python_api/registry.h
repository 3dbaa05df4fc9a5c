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
// Every launch names its device. Switching the thread's current device would leak into torch (both
// runtimes share the driver's per-thread context), so the previous device is restored on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : target_(device) {
    moe::check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != target_) moe::check_cuda(cudaSetDevice(target_), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ != target_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int target_;
  int previous_ = 0;
};

inline cudaStream_t stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void register_permute(pybind11::module_& m);
void register_router(pybind11::module_& m);
void register_balance(pybind11::module_& m);
void register_gemm(pybind11::module_& m);
void register_activation(pybind11::module_& m);
void register_quant(pybind11::module_& m);
void register_dispatch(pybind11::module_& m);
void register_regions(pybind11::module_& m);
void register_regions_fp8(pybind11::module_& m);

}  // namespace moe::api
