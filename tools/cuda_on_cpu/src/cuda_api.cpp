// Stand-ins for the CUDA runtime calls our launchers and bindings make. One emulated device (0),
// compute capability 8.0: not Hopper, so the launchers take their portable paths. MOE_KERNELS_EMU_CAPABILITY
// ("8.9", "12.0", ...; read once) reports another one, for the paths a capability gates (FP8 tensor cores
// from 8.9). Memory is the
// host's: "device" pointers are CPU tensors' data, copies and fills are memcpy and memset, and work is
// finished when the call returns (streams are ordered by construction).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace emu {
cudaError_t last_error_and_clear();
cudaError_t peek_last_error();
void set_max_dynamic_smem(const void* func, int bytes);
}  // namespace emu

namespace {
constexpr int kSMs = 132;

// The reported compute capability: MOE_KERNELS_EMU_CAPABILITY as major.minor, else 8.0.
struct Capability {
  int major = 8, minor = 0;
};
const Capability& capability() {
  static const Capability cc = [] {
    Capability c;
    const char* v = std::getenv("MOE_KERNELS_EMU_CAPABILITY");
    int major = 0, minor = 0;
    if (v != nullptr && std::sscanf(v, "%d.%d", &major, &minor) == 2 && major > 0 && minor >= 0 && minor < 10) {
      c.major = major;
      c.minor = minor;
    }
    return c;
  }();
  return cc;
}

// Shared memory of an SM, and the most one block may opt in to, in KB, as the capability's GPUs have them.
int smem_per_sm_kb() {
  const Capability& c = capability();
  if (c.major == 8) return c.minor == 0 || c.minor == 7 ? 164 : 100;
  if (c.major == 9 || c.major == 10) return 228;
  return 100;
}
int smem_optin_kb() { return smem_per_sm_kb() - 1; }
}  // namespace

extern "C" {

cudaError_t cudaGetLastError(void) { return emu::last_error_and_clear(); }
cudaError_t cudaPeekAtLastError(void) { return emu::peek_last_error(); }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaError (emulated)";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return "error in the CPU execution layer";
  }
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = kSMs; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = capability().major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = capability().minor; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = smem_optin_kb() * 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = smem_per_sm_kb() * 1024; return cudaSuccess;
    case cudaDevAttrReservedSharedMemoryPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrMaxGridDimX: *value = 0x7fffffff; return cudaSuccess;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ: *value = 65535; return cudaSuccess;
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t) {
  if (count) std::memset(p, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t count) { return cudaMemsetAsync(p, value, count, nullptr); }

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind, cudaStream_t) {
  if (count) std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, count, kind, nullptr);
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > smem_optin_kb() * 1024) return cudaErrorInvalidValue;
    emu::set_max_dynamic_smem(func, value);
  }
  return cudaSuccess;
}

// Every kernel is host code here, "built" for the emulated device: its binary and PTX versions are the
// reported capability (major * 10 + minor), the other fields 0.
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attr, const void* func) {
  if (attr == nullptr || func == nullptr) return cudaErrorInvalidValue;
  *attr = cudaFuncAttributes{};
  attr->binaryVersion = attr->ptxVersion = capability().major * 10 + capability().minor;
  attr->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

}  // extern "C"
