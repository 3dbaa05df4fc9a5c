// Plumbing shared by the sm_90a grouped GEMMs: workspace carving in 256-byte sections, the hardware
// info for the persistent scheduler, and running an adapter with errors turned into exceptions.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/kernel/tile_scheduler_params.h>
#include <cutlass/kernel_hardware_info.h>

#include <cute/util/type_traits.hpp>

#include <cstddef>
#include <stdexcept>
#include <string>

#include "common/check.h"

namespace moe::gemm::sm90 {

inline size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

// The next section of `count` Ts, advancing p.
template <typename T>
T* take(char*& p, int count) {
  T* out = reinterpret_cast<T*>(p);
  p += round_up(count * sizeof(T));
  return out;
}

inline cutlass::KernelHardwareInfo hardware(int device, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  return hw;
}

// GroupedParams::raster (0 along M, 1 along N) as the grouped tile scheduler's option.
inline cutlass::gemm::kernel::detail::RasterOrderOptions raster_option(int32_t raster) {
  using Options = cutlass::gemm::kernel::detail::RasterOrderOptions;
  return raster == 1 ? Options::AlongN : Options::AlongM;
}

// One named instance's CUTLASS kernel: the same kernel under a type that carries the instance's name
// (NAME##_instance), so the kernel's symbol says which instance it is where one translation unit holds several
// (scripts/kernel_resources.py reads it). It adds no member; the adapter and device_kernel use the base's.
template <class Kernel, class Name>
struct Named : Kernel {};
template <class Kernel, class Name>
using NamedKernel = cute::conditional_t<cute::is_void_v<Name>, Kernel, Named<Kernel, Name>>;

template <typename Gemm>
void run_gemm(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream, const char* what) {
  Gemm gemm;
  auto status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    throw std::invalid_argument(std::string(what) + ": CUTLASS cannot run this problem: " +
                                cutlassGetStatusString(status));
  }
  status = gemm.initialize(args, workspace, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    throw CudaError(std::string(what) + ": CUTLASS kernel failed: " + cutlassGetStatusString(status));
  }
  check_launch(what);
}

}  // namespace moe::gemm::sm90
