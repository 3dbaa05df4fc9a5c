// Error handling shared by every launcher: a failed CUDA call becomes a C++ exception that the
// pybind11 layer turns into a Python RuntimeError naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw CudaError(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
  }
}

// After a launch: catches bad launch configurations and earlier asynchronous faults.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

}  // namespace moe
