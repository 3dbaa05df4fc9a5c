// The `moe_kernels._C` extension: argument marshalling only. Arguments are validated in Python;
// C++ exceptions become Python exceptions (std::invalid_argument -> ValueError, others -> RuntimeError).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "common/check.h"
#include "registry.h"

namespace py = pybind11;

// The same bindings build `_C` (nvcc, the GPU) and `_C_emu` / `_C_emu_asan` (the host compiler, the
// kernels executed on the CPU by tools/cuda_on_cpu).
#ifndef MOE_KERNELS_MODULE
#define MOE_KERNELS_MODULE _C
#endif
#ifdef CUDA_ON_CPU
namespace emu {
void register_selftest(py::module_& m);  // tools/cuda_on_cpu/selftest: the layer's own test kernels
}
#endif

namespace {

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

// 0 when no driver is installed (the module still imports and the CPU references work).
int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

// The first runtime call's status: cudaErrorInsufficientDriver (35) when the driver is older than the
// runtime this module links, which no version number check catches on every system.
int runtime_probe() {
  int n = 0;
  return static_cast<int>(cudaGetDeviceCount(&n));
}

}  // namespace

PYBIND11_MODULE(MOE_KERNELS_MODULE, m) {
  m.doc() = "moe_kernels CUDA kernels (raw pointers in, no torch dependency)";
#ifdef CUDA_ON_CPU
  m.attr("emulated") = true;  // the kernels run on the CPU: pointers are host memory
  emu::register_selftest(m);
#else
  m.attr("emulated") = false;
#endif
  m.attr("cuda_archs") = MOE_KERNELS_ARCHS;
  m.def("cuda_runtime_version", &runtime_version, "CUDA runtime version this module was built with");
  m.def("cuda_driver_version", &driver_version, "Installed driver's CUDA version, 0 if none");
  m.def("runtime_probe", &runtime_probe, "cudaError_t of the first runtime call (0: the runtime works here)");
  moe::api::register_permute(m);
  moe::api::register_router(m);
  moe::api::register_balance(m);
  moe::api::register_gemm(m);
  moe::api::register_activation(m);
  moe::api::register_quant(m);
  moe::api::register_dispatch(m);
  moe::api::register_regions(m);
  moe::api::register_regions_fp8(m);
}
