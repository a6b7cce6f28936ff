// The multi-tensor launches' table (pointwise.cuh, stats.cuh): entry k of a
// launch owns blocks [first[k], first[k+1]) of its grid.
#pragma once

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

}  // namespace distopt::cuda
