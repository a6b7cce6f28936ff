// The multi-tensor launcher of the pointwise rules (docs/gpu.md), included
// by pointwise_ieee.cu and pointwise_ftz.cu, which build it with and
// without -ftz=true inside namespace DISTOPT_FP_NS.
//
// One step of a rule over K tensors is one launch per combination of the
// rule's compile-time flags and element type (usually one: multi_tensor.cuh);
// block b of the grid finds its tensor by binary search over the first
// chunks and updates that chunk with the rule's element() -- the function
// the CPU loop runs. Where every pointer of a tensor is aligned, a thread moves four
// elements at a time: it loads them with one vector access per array into
// registers, runs element() on the registers and stores them the same way
// (the same operations on the same values, so the same bits; the wide
// accesses are what keep the memory system busy). Unaligned tensors and the
// last few elements go one element at a time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "../core/cuda_backend.hpp"
#include "../optim/cuda_step.hpp"
#include "../optim/rules/pointwise.hpp"
#include "check.cuh"
#include "multi_tensor.cuh"
#include "table.cuh"

namespace distopt::cuda::DISTOPT_FP_NS {
namespace {

using rules::Typed;

constexpr int kThreads = 512;
constexpr std::size_t kChunk = 16384;  // elements per block
constexpr int kVec = 4;                // elements per vector access

struct Entry {
  float* p;
  void* lp;
  const void* g;
  float* s[kMaxStateTensors];
  std::size_t n;
  unsigned coeffs;
  bool vector;  // every pointer aligned for kVec-element accesses
};

// kVec elements of type T, aligned so that one load or store moves them all.
template <class T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <class T>
__device__ __forceinline__ Pack<T> load(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}
template <class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& x) {
  *reinterpret_cast<Pack<T>*>(p) = x;
}

// Elements [i, i + kVec) of tensor e, through registers.
template <class M, class T, bool... F>
__device__ __forceinline__ void vector_step(const typename M::Coeffs& c, const Entry& e, std::size_t i) {
  Pack<float> p = load(e.p + i);
  const Pack<T> g = load(static_cast<const T*>(e.g) + i);
  Pack<T> lp;
  Pack<float> st[kMaxStateTensors];
#pragma unroll
  for (int k = 0; k < kMaxStateTensors; ++k)
    if (e.s[k] != nullptr) st[k] = load(e.s[k] + i);
  // element() touches only the state its flags use, which are the non-null ones.
  float* const state[kMaxStateTensors] = {st[0].v, st[1].v, st[2].v, st[3].v};
  const Typed<T> s{p.v, lp.v, g.v, state, kVec};
#pragma unroll
  for (int j = 0; j < kVec; ++j) M::template element<F...>(c, s, static_cast<std::size_t>(j));
  store_pack(e.p + i, p);
  if constexpr (!std::is_same_v<T, float>) store_pack(static_cast<T*>(e.lp) + i, lp);
#pragma unroll
  for (int k = 0; k < kMaxStateTensors; ++k)
    if (e.s[k] != nullptr) store_pack(e.s[k] + i, st[k]);
}

template <class M, class T, bool... F>
__global__ void __launch_bounds__(kThreads)
    pointwise_kernel(const RuleBlob* __restrict__ coeffs, const Entry* __restrict__ entries,
                     const unsigned* __restrict__ first_chunk, unsigned count, const float* __restrict__ skip) {
  // GradScaler's found_inf: a step with an inf or NaN gradient changes nothing.
  if (skip != nullptr && *skip != 0.0f) return;
  const unsigned lo = entry_of_block(first_chunk, count);
  const Entry e = entries[lo];
  const typename M::Coeffs c = *reinterpret_cast<const typename M::Coeffs*>(coeffs[e.coeffs].bytes);
  const std::size_t begin = (blockIdx.x - first_chunk[lo]) * kChunk;
  const std::size_t end = begin + kChunk < e.n ? begin + kChunk : e.n;
  std::size_t rest = begin;  // chunks begin at multiples of kChunk, so stay aligned
  if (e.vector) {
    rest = begin + (end - begin) / kVec * kVec;
    for (std::size_t i = begin + threadIdx.x * std::size_t{kVec}; i < rest; i += kThreads * std::size_t{kVec})
      vector_step<M, T, F...>(c, e, i);
  }
  float* const state[kMaxStateTensors] = {e.s[0], e.s[1], e.s[2], e.s[3]};
  const Typed<T> s{e.p, static_cast<T*>(e.lp), static_cast<const T*>(e.g), state, e.n};
  for (std::size_t i = rest + threadIdx.x; i < end; i += kThreads) M::template element<F...>(c, s, i);
}

bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

template <class M>
void launch(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
            std::optional<std::uintptr_t> caller, const float* skip) {
  auto fill = [&](std::size_t j, Entry& e) {
    const Slice& sl = slices[j];
    set_arrays(e, sl);
    e.n = sl.n;
    const std::size_t es = size_of(sl.dtype);
    e.vector = aligned(e.p, 4 * kVec) && aligned(e.g, es * kVec) && (e.lp == nullptr || aligned(e.lp, es * kVec));
    for (int t = 0; t < kMaxStateTensors; ++t) e.vector = e.vector && (e.s[t] == nullptr || aligned(e.s[t], 4 * kVec));
  };
  auto blocks = [&](std::size_t j) { return (slices[j].n + kChunk - 1) / kChunk; };
  auto kernel = [&](const Run<Entry>& r, cudaStream_t stream) {
    const unsigned flags = M::flags(coeffs[r.slice]->as<typename M::Coeffs>());
    rules::dispatch_mask<M::kFlags>(flags, [&](auto... f) {
      dispatch_dtype(slices[r.slice].dtype, [&]<class T>() {
        pointwise_kernel<M, T, decltype(f)::value...>
            <<<r.blocks, kThreads, 0, stream>>>(r.blobs, r.entries, r.first, r.count, skip);
      });
    });
  };
  launch_planned<M, Entry>(rule, coeffs, slices, caller, {}, fill, blocks, kernel);
}

}  // namespace

bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
         std::optional<std::uintptr_t> stream, const float* skip) {
  return rules::with_math(rules::kPointwise, rule, [&]<class M>() { launch<M>(rule, coeffs, slices, stream, skip); });
}

}  // namespace distopt::cuda::DISTOPT_FP_NS
