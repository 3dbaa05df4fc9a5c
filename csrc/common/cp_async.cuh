// cp.async (sm_80 and later): 16-byte copies from global to shared memory that complete asynchronously, tracked
// in commit groups per thread. A thread's copies are visible to itself after the cp.async.wait_group that covers
// them, and to the block after that wait and a barrier; a barrier alone does not wait for them.
//
// On the CPU-executed build (CUDA_ON_CPU) the execution layer reads the source at the issue, writes 0xff to the
// destination, and completes the copy at the wait that covers it, so a read before that wait, or a copy into a
// buffer other threads still read, sees the poison.
#pragma once

#include <cstdint>

namespace moe {

// Copies 16 bytes from `gmem` to `smem`, both 16-byte aligned (L2 only: .cg).
#if defined(CUDA_ON_CPU)
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, const char* file = __builtin_FILE(),
                                            int line = __builtin_LINE()) {  // errors name the caller
  ::emu::cp_async(smem, gmem, 16, file, line);
}
#else
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t dst = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();  // below sm_80: the kernels that copy this way are never launched there
#endif
}
#endif

// Closes the thread's group of copies issued since the last commit (an empty group where there were none).
__device__ __forceinline__ void cp_async_commit() {
#if defined(CUDA_ON_CPU)
  ::emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `pending` of the thread's newest committed groups are still in flight (below 0: none; above
// 3: 3, which waits for more than asked).
__device__ __forceinline__ void cp_async_wait(int pending) {
#if defined(CUDA_ON_CPU)
  ::emu::cp_async_wait(pending < 0 ? 0 : pending > 3 ? 3 : pending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  switch (pending) {  // the instruction takes an immediate
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    default:
      if (pending > 3) {
        asm volatile("cp.async.wait_group 3;\n" ::: "memory");
      } else {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      }
      break;
  }
#endif
}

}  // namespace moe
