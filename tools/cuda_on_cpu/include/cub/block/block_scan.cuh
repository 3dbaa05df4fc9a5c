// cub::BlockScan for the CPU execution layer (real CUB is PTX inside). Same interface for the calls
// our kernels make: ExclusiveSum / InclusiveSum of one item or an array of items per thread, with
// an optional block aggregate. Every thread of the block must call, and the TempStorage may be reused
// only after a __syncthreads, as with CUB. Included in place of CUB's header (the include path puts
// this directory first).
#pragma once

#include <cstddef>

namespace cub {

template <typename T, int BLOCK_DIM_X, int ALGORITHM = 0, int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1, int ARCH = 0>
class BlockScan {
  static constexpr int kThreads = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;

 public:
  struct TempStorage {
    T partial[kThreads];
  };

  explicit BlockScan(TempStorage& storage) : s_(storage) {}

  void ExclusiveSum(T input, T& output) {
    T aggregate;
    ExclusiveSum(input, output, aggregate);
  }
  void ExclusiveSum(T input, T& output, T& aggregate) {
    T items[1] = {input};
    T out[1];
    ExclusiveSum(items, out, aggregate);
    output = out[0];
  }
  template <int N>
  void ExclusiveSum(T (&input)[N], T (&output)[N]) {
    T aggregate;
    ExclusiveSum(input, output, aggregate);
  }
  template <int N>
  void ExclusiveSum(T (&input)[N], T (&output)[N], T& aggregate) {
    Scan(input, output, aggregate, /*inclusive=*/false);
  }

  void InclusiveSum(T input, T& output) {
    T aggregate;
    InclusiveSum(input, output, aggregate);
  }
  void InclusiveSum(T input, T& output, T& aggregate) {
    T items[1] = {input};
    T out[1];
    InclusiveSum(items, out, aggregate);
    output = out[0];
  }
  template <int N>
  void InclusiveSum(T (&input)[N], T (&output)[N]) {
    T aggregate;
    InclusiveSum(input, output, aggregate);
  }
  template <int N>
  void InclusiveSum(T (&input)[N], T (&output)[N], T& aggregate) {
    Scan(input, output, aggregate, /*inclusive=*/true);
  }

 private:
  // Blocked arrangement: thread i holds items [i * N, (i + 1) * N) of the scanned sequence.
  template <int N>
  void Scan(T (&input)[N], T (&output)[N], T& aggregate, bool inclusive) {
    const int me = int(threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y);
    if (int(blockDim.x * blockDim.y * blockDim.z) != kThreads) {
      ::emu::fail("cub::BlockScan: the block does not have BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z threads", __FILE__,
                  __LINE__);
    }
    T local = T(0);
    for (int i = 0; i < N; ++i) local = local + input[i];
    s_.partial[me] = local;
    __syncthreads();
    T prefix = T(0), total = T(0);
    for (int t = 0; t < kThreads; ++t) {
      if (t < me) prefix = prefix + s_.partial[t];
      total = total + s_.partial[t];
    }
    for (int i = 0; i < N; ++i) {
      const T v = input[i];
      if (inclusive) prefix = prefix + v;
      output[i] = prefix;
      if (!inclusive) prefix = prefix + v;
    }
    aggregate = total;
    // No trailing barrier, as in CUB: reusing the storage needs a __syncthreads first.
  }

  TempStorage& s_;
};

}  // namespace cub
