// Kernels that exercise the CPU execution layer itself: the collectives' results, and the errors it
// must report. Compiled into _C_emu only (tests/tools/test_cuda_on_cpu.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "common/cp_async.cuh"

namespace emu_selftest {

// out[lane * 16 + i]: shuffles with width 8, ballot, match_any, reductions, activemask.
__global__ void collectives_kernel(int32_t* out) {
  const int lane = threadIdx.x;
  int32_t* o = out + lane * 16;
  o[0] = __shfl_sync(0xffffffffu, lane * 10, 3, 8);         // lane 3 of each segment of 8
  o[1] = __shfl_up_sync(0xffffffffu, lane * 10, 2, 8);      // lanes below the segment keep their own
  o[2] = __shfl_down_sync(0xffffffffu, lane * 10, 3, 8);
  o[3] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  o[4] = int32_t(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[5] = int32_t(__match_any_sync(0xffffffffu, lane / 4));
  o[6] = __reduce_add_sync(0xffffffffu, lane);
  o[7] = __reduce_min_sync(0xffffffffu, 7 - lane);
  o[8] = int32_t(__reduce_max_sync(0xffffffffu, unsigned(lane * 3)));
  o[9] = __any_sync(0xffffffffu, lane == 31);
  o[10] = __all_sync(0xffffffffu, lane < 31);
  int pred = 0;
  o[11] = int32_t(__match_all_sync(0xffffffffu, 5, &pred));
  o[12] = pred;
  const double d = __shfl_xor_sync(0xffffffffu, double(lane) + 0.5, 1);
  o[13] = int32_t(d * 2);
  if (lane < 16) o[14] = __shfl_xor_sync(0x0000ffffu, lane, 8);  // a half-warp collective
  __syncwarp();
  o[15] = int32_t(__reduce_or_sync(0xffffffffu, 1u << (lane % 4)));
}

// out[t] = a static __shared__ word never written: the poison the layer fills before each block.
__global__ void poison_kernel(uint32_t* out) {
  __shared__ uint32_t never_written[64];
  out[blockIdx.x * 64 + threadIdx.x] = never_written[threadIdx.x];
  never_written[threadIdx.x] = 0;  // the next block must see the poison again
}

// Cross-warp exchange through shared memory: correct only with the barrier.
__global__ void barrier_kernel(int32_t* out) {
  __shared__ int32_t s[64];
  s[threadIdx.x] = int32_t(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[63 - threadIdx.x];
}

// A race: each thread reads its lower neighbour's shared word with no barrier after the write. In
// thread order it reads the written value; in reverse order, the poison.
__global__ void race_lower_kernel(int32_t* out) {
  __shared__ int32_t s[64];
  s[threadIdx.x] = int32_t(threadIdx.x);
  out[threadIdx.x] = threadIdx.x ? s[threadIdx.x - 1] : 0;
}

// A race between warps: each reads the other warp's shared words with only warp-level synchronisation
// after the writes. Rounds keep the warps in step (every order passes); a serial schedule runs one warp
// to its end first, which reads the poison.
__global__ void race_across_warps_kernel(int32_t* out) {
  __shared__ int32_t s[64];
  s[threadIdx.x] = int32_t(threadIdx.x);
  __syncwarp();
  __syncwarp();
  out[threadIdx.x] = s[(threadIdx.x + 32) % 64];
}

// The block order: thread 0 of each block takes a ticket (out[0] counts from 0).
__global__ void block_order_kernel(int32_t* out) {
  if (threadIdx.x == 0) out[1 + blockIdx.x + gridDim.x * blockIdx.y] = atomicAdd(out, 1);
}

__global__ void exited_lane_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

__global__ void mixed_collectives_kernel(int32_t* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
  } else {
    out[threadIdx.x] = int32_t(__ballot_sync(0xffffffffu, 1));
  }
}

__global__ void outside_mask_kernel(int32_t* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 20);
}

__global__ void deadlock_kernel(int32_t* out) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

__global__ void empty_kernel(int32_t*) {}
__global__ void opted_in_kernel(int32_t*) {}

// cp.async through the layer: each of 64 threads copies 16 bytes of out[0, 512) into dynamic shared memory in two
// commit groups (over 7s it wrote first), waits until `pending` groups are left in flight (-1: no wait), then after a
// barrier writes what the copies of thread 63 - t left: out[512 + t] from the first group, out[576 + t] from the
// second.
__global__ void cp_async_kernel(int32_t* out, int pending) {
  extern __shared__ __align__(16) int32_t staged[];  // [2][64][4]
  const int t = int(threadIdx.x), o = 63 - t;
  for (int i = 0; i < 4; ++i) staged[4 * t + i] = staged[256 + 4 * t + i] = 7;  // overwritten by the issue's poison
  moe::cp_async_16(staged + 4 * t, out + 4 * t);
  moe::cp_async_commit();
  moe::cp_async_16(staged + 256 + 4 * t, out + 256 + 4 * t);
  moe::cp_async_commit();
  if (pending >= 0) moe::cp_async_wait(pending);
  __syncthreads();
  out[512 + t] = staged[4 * o];
  out[576 + t] = staged[256 + 4 * o];
}

void run(const std::string& name, uintptr_t out) {
  if (name == "collectives") {
    collectives_kernel<<<1, 32>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "poison") {
    poison_kernel<<<2, 64>>>(reinterpret_cast<uint32_t*>(out));
  } else if (name == "barrier") {
    barrier_kernel<<<1, 64>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "race_lower") {
    race_lower_kernel<<<1, 64>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "race_across_warps") {
    race_across_warps_kernel<<<1, 64>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "block_order") {
    block_order_kernel<<<dim3(5, 3), 64>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "exited_lane") {
    exited_lane_kernel<<<1, 32>>>(reinterpret_cast<float*>(out));
  } else if (name == "mixed_collectives") {
    mixed_collectives_kernel<<<1, 32>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "outside_mask") {
    outside_mask_kernel<<<1, 32>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "deadlock") {
    deadlock_kernel<<<dim3(1, 2), 64>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "bad_block") {
    empty_kernel<<<1, 2048>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "big_smem") {
    empty_kernel<<<1, 32, 64 * 1024>>>(reinterpret_cast<int32_t*>(out));
  } else if (name == "big_smem_opted_in") {  // 64 KB allowed; 96 KB still past what was allowed
    moe::check_cuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(&opted_in_kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
                    "big_smem_opted_in");
    opted_in_kernel<<<1, 32, 64 * 1024>>>(reinterpret_cast<int32_t*>(out));
    moe::check_launch("64 KB after the opt-in");
    opted_in_kernel<<<1, 32, 96 * 1024>>>(reinterpret_cast<int32_t*>(out));
  } else if (name.rfind("cp_async_", 0) == 0) {  // cp_async_wait0, cp_async_wait1, cp_async_nowait
    const int pending = name == "cp_async_wait0" ? 0 : name == "cp_async_wait1" ? 1 : -1;
    cp_async_kernel<<<1, 64, 2048>>>(reinterpret_cast<int32_t*>(out), pending);
  } else {
    throw std::invalid_argument("emu_selftest: unknown case " + name);
  }
  moe::check_launch(name.c_str());
}

}  // namespace emu_selftest

namespace emu {
void register_selftest(pybind11::module_& m) {
  m.def("emu_selftest", &emu_selftest::run, pybind11::arg("name"), pybind11::arg("out"),
        "Runs one of the CPU execution layer's own test kernels on host memory at `out`");
  m.def("emu_schedule", &emu::set_schedule, pybind11::arg("spec"),
        "Sets the order of blocks and runnable threads (forward, reverse, random, random:SEED, serial, "
        "serial-reverse, serial-random, serial-random:SEED); returns the previous one");
  m.def("emu_kernel_launches", &emu::kernel_launches,
        "Launches run since the library loaded, per kernel name (template arguments dropped)");
}
}  // namespace emu
