// The multi-tensor launches' table (pointwise.cuh, stats.cuh): entry k of a
// launch owns blocks [first[k], first[k+1]) of its grid. And the block
// reduction of the statistics (stats.cuh, clip.cu).
#pragma once

#include <cstddef>

#include "distopt/optim/rule.hpp"

namespace distopt::cuda {

// An entry's arrays from its slice: p the fp32 values (the parameter, or
// the master weights of a bf16/f16 one), lp the bf16/f16 parameter (null
// for fp32), g the gradient, s the state tensors.
template <class E>
void set_arrays(E& e, const Slice& sl) {
  e.p = sl.dtype == DType::f32 ? static_cast<float*>(sl.param) : sl.master;
  e.lp = sl.dtype == DType::f32 ? nullptr : sl.param;
  e.g = sl.grad;
  for (int t = 0; t < kMaxStateTensors; ++t) e.s[t] = sl.state[t];
}

// The entry owning block blockIdx.x: the last whose first block is <= it.
__device__ __forceinline__ unsigned entry_of_block(const unsigned* __restrict__ first, unsigned count) {
  unsigned lo = 0, hi = count;
  while (hi - lo > 1) {
    const unsigned mid = (lo + hi) / 2;
    if (first[mid] <= blockIdx.x) lo = mid;
    else hi = mid;
  }
  return lo;
}

// The block shape of every statistic (stats.cuh, clip.cu): a block sums one
// chunk of kSumChunk elements with kSumThreads threads, each over a fixed
// stride, so the order of the sums (and their bits) is the same on every
// device and launch.
constexpr int kSumThreads = 256;
constexpr std::size_t kSumChunk = 16384;

// The chunks (blocks) of a statistic over n elements.
inline std::size_t sum_chunks(std::size_t n) {
  return (n + kSumChunk - 1) / kSumChunk;
}
// A grid-stride launch of kSumThreads-thread blocks over n elements: at
// least one block, at most 65536.
inline unsigned grid_for(std::size_t n) {
  const std::size_t b = (n + kSumThreads - 1) / kSumThreads;
  return static_cast<unsigned>(b < 65536 ? (b == 0 ? 1 : b) : 65536);
}

// Combines v over the block's kSumThreads threads with op in a fixed tree;
// every thread gets the result. `shared` (kSumThreads doubles) may be reused
// at once: the first barrier keeps a call from overwriting it while threads
// still read the last call's result.
template <class Op>
__device__ __forceinline__ double block_reduce(double v, double* shared, Op op) {
  __syncthreads();
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kSumThreads / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) shared[threadIdx.x] = op(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  return shared[0];
}

struct Plus {
  __device__ __forceinline__ double operator()(double a, double b) const { return a + b; }
};

}  // namespace distopt::cuda
