// The CPU execution layer's scheduler interface: what the prelude's device functions call.
//
// A launch runs its blocks one after another. Each CUDA thread of a block is a fiber that runs until it
// reaches __syncthreads, a warp collective or its end; then the next runnable fiber of the block runs.
// A warp collective completes when every lane named in its mask has arrived at it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace emu {

// What a running CUDA thread sees.
struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  int linear = 0;  // thread index within the block
  int warp = 0;
  int lane = 0;
};

// The running CUDA thread (valid only inside a kernel).
extern ThreadState* g_thread;
inline const ThreadState& self() { return *g_thread; }

enum class Coll : int {
  kShflIdx,
  kShflUp,
  kShflDown,
  kShflXor,
  kBallot,
  kAny,
  kAll,
  kMatchAny,
  kMatchAll,
  kReduceAdd,
  kReduceMin,
  kReduceMax,
  kReduceAnd,
  kReduceOr,
  kReduceXor,
  kSyncWarp,
};

// One lane's part in a warp collective. `value` holds `size` bytes (<= 16); `arg` is the shuffle's lane
// or offset, or the reduction's signedness; `width` the shuffle width.
struct CollArgs {
  Coll op;
  unsigned mask;
  const void* value;
  int size;
  int arg;
  int width;
  const char* file;
  int line;
};

// Blocks until every lane of `a.mask` has arrived; returns this lane's result in `out` (`a.size` bytes
// for shuffles, 4 bytes otherwise) and, for __match_all_sync, the predicate.
void warp_collective(const CollArgs& a, void* out, int* pred);

// __syncthreads: blocks until every thread of the block that has not exited has arrived.
// Returns the number of arrived threads whose `pred` was non-zero (for __syncthreads_count/and/or).
int block_barrier(int pred, const char* file, int line);

// Non-exited lanes of the calling thread's warp.
unsigned active_lanes();

// Aborts the running kernel: the launch raises (or aborts the process) with a message naming the
// kernel, block, warp and lane.
[[noreturn]] void fail(const std::string& what, const char* file, int line);

// The launch's dynamic shared memory (exactly its size, 0xff before each block).
void* dynamic_shared();

// cp.async: `bytes` (4, 8 or 16) from global `src` to shared `dst`. The source is read now; `dst` holds 0xff
// until the copy completes, at the cp.async.wait_group that covers its commit group (never, when the thread exits
// without that wait: a GPU may complete it as late as the block's end), so a read before that wait, or a copy into
// a buffer other threads still read, sees the poison.
void cp_async(void* dst, const void* src, int bytes, const char* file, int line);
// cp.async.commit_group: the thread's copies since the last commit form one group.
void cp_async_commit();
// cp.async.wait_group: completes the thread's committed groups but the newest `pending`.
void cp_async_wait(int pending);

// cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): a launch of `func` may then
// have up to `bytes` of dynamic shared memory (48 KB without it).
void set_max_dynamic_smem(const void* func, int bytes);

// The address that names a kernel (a function or a pointer to one) in cudaFuncSetAttribute.
template <typename F>
const void* kernel_address(F* f) {
  return reinterpret_cast<const void*>(f);
}

// Static __shared__ variables: the first thread of each block to pass the declaration fills the
// variable with 0xff (`epoch` remembers the block that last did).
void shared_declared(void* p, size_t bytes, uint64_t* epoch);

struct LaunchConfig {
  const char* kernel;
  const char* file;
  int line;
  const void* func;  // the kernel's address (kernel_address)
  dim3 grid;
  dim3 block;
  size_t smem;
  cudaStream_t stream;
};

// The order of blocks and of runnable threads: "forward" (the default), "reverse", "random", "random:SEED",
// "serial", "serial-reverse", "serial-random" or "serial-random:SEED" (README, Schedules). Throws
// std::invalid_argument on another spec; returns the schedule it replaces. MOE_KERNELS_EMU_SCHEDULE sets it
// when the library loads, and a bad value there aborts the process with a message.
std::string set_schedule(const std::string& spec);

// Runs `body` as every thread of every block (or records cudaErrorInvalidConfiguration).
void run_grid(const LaunchConfig& cfg, const std::function<void()>& body);

// Launches run since the library loaded, per kernel name (the name as launched, its template arguments dropped):
// the tests read which kernels a call launched (one extension call may launch several).
std::map<std::string, int64_t> kernel_launches();

// `kernel<<<grid, block, smem, stream>>>(args...)` is rewritten to
// `::emu::launch("kernel", __FILE__, __LINE__, ::emu::kernel_address(kernel), grid, block, smem, stream)(
//     [&](auto... a) { kernel(a...); }, args...)`.
struct Launcher {
  LaunchConfig cfg;
  template <typename F, typename... Args>
  void operator()(F&& f, Args&&... args) const {
    // Kernel parameters are copied once at launch, as on the device.
    auto params = std::make_tuple(std::decay_t<Args>(std::forward<Args>(args))...);
    run_grid(cfg, [&]() { std::apply(f, params); });
  }
};

inline Launcher launch(const char* kernel, const char* file, int line, const void* func, dim3 grid, dim3 block,
                       size_t smem = 0, cudaStream_t stream = nullptr) {
  return Launcher{LaunchConfig{kernel, file, line, func, grid, block, smem, stream}};
}

}  // namespace emu
