// Clipping's device half (optim/clip.cpp, optim/cuda_step.hpp): the norm's
// partial statistic of device gradients, and their in-place scale and
// clamp, on the calling thread's stream, complete when they return.
//
// The statistic: each 16384-element chunk of a gradient is summed in double
// (|g|^2, |g| or |g|^p; each thread over a fixed stride, the block's
// threads in a fixed tree) or maxed (|g|, NaN if any element is), and the
// host adds the chunks in order -- the same bits run to run; against the
// CPU's one sequential sum, the same to double rounding (max: exactly). The
// scale and the clamp are the CPU's per-element expressions (bit for bit
// in IEEE mode; these kernels do not flush denormals, where the CPU may).
// The calling thread's stream follows the legacy default stream (torch's
// default); a caller on another stream waits for it first (clip.cpp does
// for an optimizer's stream).
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "../optim/cuda_step.hpp"
#include "check.cuh"
#include "distopt/core/hd.hpp"
#include "table.cuh"

namespace distopt::cuda {
namespace {

constexpr int kThreads = kSumThreads;
constexpr std::size_t kChunk = kSumChunk;

enum class Norm : int { two, one, power, inf };

__device__ __forceinline__ double combine(Norm kind, double a, double b) {
  if (kind != Norm::inf) return a + b;
  if (a != a || b != b) return __longlong_as_double(0x7ff8000000000000ll);  // NaN
  return a < b ? b : a;
}

struct Combine {
  Norm kind;
  __device__ __forceinline__ double operator()(double a, double b) const { return combine(kind, a, b); }
};

template <class T>
__global__ void __launch_bounds__(kThreads)
    norm_kernel(const T* __restrict__ g, std::size_t n, Norm kind, double p, double* __restrict__ out) {
  __shared__ double shared[kThreads];
  const std::size_t begin = blockIdx.x * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
  double a = 0.0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double x = to_float(g[i]);
    const double ax = x < 0 ? -x : x;
    double v = 0.0;
    if (kind == Norm::two) v = x * x;
    else if (kind == Norm::one || kind == Norm::inf) v = kind == Norm::inf && x != x ? x : ax;
    else v = pow(ax, p);
    a = combine(kind, a, v);
  }
  a = block_reduce(a, shared, Combine{kind});
  if (threadIdx.x == 0) out[blockIdx.x] = a;
}

template <class T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* __restrict__ g, std::size_t n, float coef) {
  for (std::size_t i = blockIdx.x * std::size_t{kThreads} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * kThreads)
    g[i] = from_float<T>(to_float(g[i]) * coef);
}

template <class T>
__global__ void __launch_bounds__(kThreads) clamp_kernel(T* __restrict__ g, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * std::size_t{kThreads} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * kThreads) {
    const float x = to_float(g[i]);
    g[i] = from_float<T>(x != x ? x : hd::min(hd::max(x, -v), v));
  }
}

}  // namespace

double grad_norm_partial(std::span<const TensorView> grads, double norm_type) {
  const Norm kind = std::isinf(norm_type) ? Norm::inf
                    : norm_type == 2      ? Norm::two
                    : norm_type == 1      ? Norm::one
                                          : Norm::power;
  std::size_t total = 0;
  for (const TensorView& g : grads) total += sum_chunks(static_cast<std::size_t>(g.numel()));
  if (total == 0) return 0.0;
  const cudaStream_t stream{0};  // this thread's own
  const Staging area = staging(total * sizeof(double));
  auto* dev = reinterpret_cast<double*>(area.device);
  enqueue_staged(stream, [&] {
    std::size_t at = 0;
    for (const TensorView& g : grads) {
      const auto n = static_cast<std::size_t>(g.numel());
      if (n == 0) continue;
      dispatch_dtype(g.dtype, [&]<class T>() {
        norm_kernel<T><<<static_cast<unsigned>(sum_chunks(n)), kThreads, 0, stream>>>(g.as<const T>(), n, kind,
                                                                                      norm_type, dev + at);
      });
      check(cudaGetLastError(), "clipping: the norm's kernel");
      at += sum_chunks(n);
    }
    check(cudaMemcpyAsync(area.host, area.device, total * sizeof(double), cudaMemcpyDeviceToHost, stream),
          "clipping: the norm's partial sums");
  });
  check(cudaStreamSynchronize(stream), "clipping: the norm");
  const auto* host = reinterpret_cast<const double*>(area.host);
  double s = 0.0;
  for (std::size_t k = 0; k < total; ++k) {
    if (kind != Norm::inf) s += host[k];
    else if (std::isnan(host[k]) || std::isnan(s)) s = std::numeric_limits<double>::quiet_NaN();
    else s = s < host[k] ? host[k] : s;
  }
  return s;
}

namespace {
template <class Launch>
void each_grad(std::span<const TensorView> grads, std::string_view what, Launch&& launch) {
  const cudaStream_t stream{0};
  for (const TensorView& g : grads) {
    const auto n = static_cast<std::size_t>(g.numel());
    if (n == 0) continue;
    dispatch_dtype(g.dtype, [&]<class T>() { launch.template operator()<T>(g.as<T>(), n, grid_for(n), stream); });
    check(cudaGetLastError(), what);
  }
  check(cudaStreamSynchronize(stream), what);
}
}  // namespace

void scale_grads(std::span<const TensorView> grads, float coef) {
  each_grad(grads, "clipping: scaling", [&]<class T>(T* g, std::size_t n, unsigned blocks, cudaStream_t s) {
    scale_kernel<T><<<blocks, kThreads, 0, s>>>(g, n, coef);
  });
}

void clamp_grads(std::span<const TensorView> grads, float limit) {
  each_grad(grads, "clipping: clamping", [&]<class T>(T* g, std::size_t n, unsigned blocks, cudaStream_t s) {
    clamp_kernel<T><<<blocks, kThreads, 0, s>>>(g, n, limit);
  });
}

}  // namespace distopt::cuda
