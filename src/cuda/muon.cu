// Muon on the device (optim/cuda_step.hpp's whole_step): the momentum and
// the step are rules/muon.hpp's per-element math, as on the CPU; the
// Newton-Schulz iteration (muon.cpp) runs on cuBLAS in float32:
//   X = U (transposed if rows > cols), X /= max(||X||, eps), then ns_steps times
//   A = X X^T;  B = b*A + c*(A A);  X = a*X + B X      (torch's two addmm)
// ||X|| is summed in double per 16384-element chunk in a fixed tree and the
// chunks added on the host in order (one wait per step for all tensors);
// the products are cuBLAS's SGEMM without TF32, so the result agrees with
// the CPU's Eigen products within float rounding (not bit for bit), and two
// runs on one device agree bit for bit.
//
// cuBLAS is loaded when Muon first steps on the device (dlopen of
// libcublas.so.13), so the library needs only the driver otherwise; where it
// cannot be loaded the step is refused in one line before anything changes.
// torch's bfloat16 rounding (ns_dtype "bfloat16") is CPU-only.
//
// Layout: a row-major rows x cols buffer is, to column-major cuBLAS, its
// transpose Y. With rows > cols, X = U^T = Y (m = cols rows, k = rows
// columns); else X = U = Y^T and the iteration runs on Y as
// Y <- a*Y + Y B^T. Either way the result lands in the buffer in U's
// layout, as the CPU's does.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/cuda_backend.hpp"
#include "../optim/cuda_step.hpp"
#include "../optim/rules/muon.hpp"
#include "check.cuh"
#include "table.cuh"

namespace distopt::cuda {
namespace {

using rules::MuonMath;
using Coeffs = MuonMath::Coeffs;

constexpr int kThreads = kSumThreads;
constexpr std::size_t kChunk = kSumChunk;

// A slice's arrays, by value into a kernel.
struct Arrays {
  float* p;
  void* lp;
  const void* g;
  float* s[kMaxStateTensors];
  std::size_t n;
};

Arrays arrays_of(const Slice& sl) {
  Arrays a{};
  set_arrays(a, sl);
  a.n = sl.n;
  return a;
}

template <class T>
__device__ __forceinline__ rules::Typed<T> typed(const Arrays& a) {
  return {a.p, static_cast<T*>(a.lp), static_cast<const T*>(a.g), a.s, a.n};
}

template <class T>
__global__ void __launch_bounds__(kThreads) transform_kernel(Coeffs c, Arrays a, float* __restrict__ work) {
  const rules::Typed<T> s = typed<T>(a);
  for (std::size_t i = blockIdx.x * std::size_t{kThreads} + threadIdx.x; i < a.n;
       i += std::size_t{gridDim.x} * kThreads)
    MuonMath::transform<T>(c, s, work, i);
}

template <class T>
__global__ void __launch_bounds__(kThreads) update_kernel(Coeffs c, Arrays a, const float* __restrict__ work) {
  const rules::Typed<T> s = typed<T>(a);
  for (std::size_t i = blockIdx.x * std::size_t{kThreads} + threadIdx.x; i < a.n;
       i += std::size_t{gridDim.x} * kThreads)
    MuonMath::update<T>(c, s, work, i);
}

// Σ x^2 of chunk blockIdx.x, in double: a fixed stride per thread, a fixed tree.
__global__ void __launch_bounds__(kThreads)
    squares_kernel(const float* __restrict__ x, std::size_t n, double* __restrict__ out) {
  __shared__ double shared[kThreads];
  const std::size_t begin = blockIdx.x * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
  double a = 0.0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double v = x[i];
    a += v * v;
  }
  a = block_reduce(a, shared, Plus{});
  if (threadIdx.x == 0) out[blockIdx.x] = a;
}

__global__ void __launch_bounds__(kThreads) divide_kernel(float* __restrict__ x, std::size_t n, float by) {
  for (std::size_t i = blockIdx.x * std::size_t{kThreads} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * kThreads)
    x[i] = x[i] / by;
}

// ---- cuBLAS, loaded on first use ----
struct Blas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  std::string why;  // empty when loaded
};

const Blas& blas() {
  static const Blas loaded = [] {
    Blas b;
    void* lib = nullptr;
    std::string errors;
    for (const char* name : {"libcublas.so.13", "libcublas.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
      const char* e = dlerror();
      errors += str(errors.empty() ? "" : "; ", e != nullptr ? e : name);
    }
    if (lib == nullptr) {
      b.why = str("cuBLAS could not be loaded (", errors, ")");
      return b;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && b.why.empty()) b.why = str("the loaded cuBLAS has no ", name);
    };
    sym(b.create, "cublasCreate_v2");
    sym(b.set_stream, "cublasSetStream_v2");
    sym(b.set_math_mode, "cublasSetMathMode");
    sym(b.sgemm, "cublasSgemm_v2");
    return b;
  }();
  return loaded;
}

void check_blas(cublasStatus_t status, std::string_view what) {
  if (status != CUBLAS_STATUS_SUCCESS) throw DeviceError(str("cuBLAS error ", static_cast<int>(status), " in ", what));
}

// This thread's handle on the current device (made once, never destroyed:
// a handle destroyed after the CUDA context is torn down can crash).
cublasHandle_t handle_of(int device) {
  thread_local std::map<int, cublasHandle_t> handles;
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasHandle_t h = nullptr;
    check_blas(blas().create(&h), "making a handle");
    check_blas(blas().set_math_mode(h, CUBLAS_DEFAULT_MATH), "setting its math mode (no TF32)");
    it = handles.emplace(device, h).first;
  }
  return it->second;
}

// C (m x n, column-major) = alpha op(A) op(B) + beta C.
void gemm(cublasHandle_t h, bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
          std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
  auto i = [](std::size_t v) { return static_cast<int>(v); };
  check_blas(blas().sgemm(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, i(m), i(n), i(k), &alpha,
                          a, i(lda), b, i(ldb), &beta, c, i(ldc)),
             "muon's Newton-Schulz (SGEMM)");
}

// The iteration's scratch on this thread and device: A, B (m x m each) and
// a second X, grown on demand; an event after its last use, which the next
// stream to use it waits for on the device.
struct Scratch {
  float* p = nullptr;
  std::size_t floats = 0;
  cudaEvent_t used{};
};

// At least `floats` of this thread's scratch on `device`, ordered after its
// last use on `stream`; call Scratch::done after the last launch using it.
Scratch& scratch(int device, std::size_t floats, cudaStream_t stream) {
  thread_local std::map<int, Scratch> areas;
  Scratch& s = areas[device];
  if (!s.used) check(cudaEventCreateWithFlags(&s.used, cudaEventDisableTiming), "creating an event");
  if (s.floats < floats) {
    check(cudaEventSynchronize(s.used), "waiting for muon's last step");
    cuda::free(s.p);
    s.p = nullptr;
    s.floats = 0;
    s.p = static_cast<float*>(alloc(floats * sizeof(float), "muon's Newton-Schulz scratch"));
    s.floats = floats;
  }
  check(cudaStreamWaitEvent(stream, s.used, 0), "ordering muon's scratch");
  return s;
}

constexpr const char* kBf16Refusal =
    "muon on cuda runs Newton-Schulz in float32: ns_dtype bfloat16 (torch's rounding) is CPU-only";

Coeffs coeffs_of(const RuleBlob* blob) {
  Coeffs c;
  std::memcpy(&c, blob->bytes, sizeof c);
  return c;
}

}  // namespace

bool has_whole_kernel(std::string_view rule) {
  return rule == "muon";
}

void check_whole_step(std::string_view rule, const OptionMap& options) {
  if (!has_whole_kernel(rule))
    throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
  const auto dtype = options.find("ns_dtype");
  if (dtype != options.end() && dtype->second.word() == "bfloat16") throw InvalidInput(kBf16Refusal);
  if (!blas().why.empty()) throw InvalidInput(str("muon on cuda needs cuBLAS: ", blas().why));
}

void whole_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                std::optional<std::uintptr_t> stream) {
  if (!has_whole_kernel(rule))
    throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
  if (coeffs.size() != slices.size()) throw PreconditionError("whole_step: one coefficient block per slice");
  // Everything that can refuse the step does so before anything changes.
  std::vector<Coeffs> cs;
  std::size_t most = 0, total_chunks = 0;
  for (std::size_t k = 0; k < slices.size(); ++k) {
    cs.push_back(coeffs_of(coeffs[k]));
    if (cs.back().bf16) throw InvalidInput(kBf16Refusal);
    const Shape& shape = *slices[k].shape;
    if (shape.size() != 2 || slices[k].offset != 0 || slices[k].n != static_cast<std::size_t>(numel(shape)))
      throw PreconditionError("muon on cuda steps whole 2-D tensors");
    const auto m = static_cast<std::size_t>(std::min(shape[0], shape[1])), n = slices[k].n;
    if (n > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw InvalidInput(str("muon on cuda: a ", to_string(shape), " tensor is larger than cuBLAS's int dimensions"));
    most = std::max(most, 2 * m * m + n);
    total_chunks += sum_chunks(n);
  }
  if (!blas().why.empty()) throw InvalidInput(str("muon on cuda needs cuBLAS: ", blas().why));
  if (total_chunks == 0) return;
  // This thread's own stream by name: cuBLAS, built without per-thread
  // default streams, would take 0 for the legacy one.
  const cudaStream_t s = stream ? as_stream(*stream) : cudaStreamPerThread;
  int device = 0;
  check(cudaGetDevice(&device), "muon: the current device");
  const cublasHandle_t h = handle_of(device);
  check_blas(blas().set_stream(h, s), "setting the stream");
  Scratch& area_ns = scratch(device, most, s);
  float* const a_buf = area_ns.p;
  // Its last use recorded however this ends (work already enqueued may use it).
  struct Record {
    Scratch& area;
    cudaStream_t stream;
    ~Record() { (void)cudaEventRecord(area.used, stream); }
  } record{area_ns, s};

  // The momentum into the scratch U, then Σ U^2 of every tensor, waited for.
  const Staging area = staging(total_chunks * sizeof(double));
  auto* sums = reinterpret_cast<double*>(area.device);
  enqueue_staged(s, [&] {
    std::size_t at = 0;
    for (std::size_t k = 0; k < slices.size(); ++k) {
      const Slice& sl = slices[k];
      if (sl.n == 0) continue;
      dispatch_dtype(sl.dtype, [&]<class T>() {
        transform_kernel<T><<<grid_for(sl.n), kThreads, 0, s>>>(cs[k], arrays_of(sl), sl.work);
      });
      check(cudaGetLastError(), "muon: the momentum's kernel");
      squares_kernel<<<static_cast<unsigned>(sum_chunks(sl.n)), kThreads, 0, s>>>(sl.work, sl.n, sums + at);
      check(cudaGetLastError(), "muon: the norm's kernel");
      at += sum_chunks(sl.n);
    }
    check(cudaMemcpyAsync(area.host, area.device, total_chunks * sizeof(double), cudaMemcpyDeviceToHost, s),
          "muon: the norms' partial sums");
  });
  check(cudaStreamSynchronize(s), "muon: the norms");
  std::vector<double> host(reinterpret_cast<const double*>(area.host),
                           reinterpret_cast<const double*>(area.host) + total_chunks);

  std::size_t at = 0;
  for (std::size_t k = 0; k < slices.size(); ++k) {
    const Slice& sl = slices[k];
    if (sl.n == 0) continue;
    Coeffs& c = cs[k];
    double sum = 0.0;
    for (std::size_t j = 0; j < sum_chunks(sl.n); ++j) sum += host[at + j];
    at += sum_chunks(sl.n);
    const float norm = static_cast<float>(std::sqrt(sum));
    divide_kernel<<<grid_for(sl.n), kThreads, 0, s>>>(sl.work, sl.n, std::max(norm, c.eps));
    check(cudaGetLastError(), "muon: the scaling kernel");

    const auto rows = static_cast<std::size_t>((*sl.shape)[0]), cols = static_cast<std::size_t>((*sl.shape)[1]);
    const bool transpose = rows > cols;
    const std::size_t m = std::min(rows, cols), kk = std::max(rows, cols);
    float* const A = a_buf;
    float* const B = A + m * m;
    float* y = sl.work;
    float* y2 = B + m * m;
    for (int step = 0; step < c.ns_steps; ++step) {
      if (transpose) gemm(h, false, true, m, m, kk, 1.0f, y, m, y, m, 0.0f, A, m);  // X X^T, X = Y
      else gemm(h, true, false, m, m, kk, 1.0f, y, kk, y, kk, 0.0f, A, m);          // Y^T Y, X = Y^T
      check(cudaMemcpyAsync(B, A, m * m * sizeof(float), cudaMemcpyDeviceToDevice, s), "muon: copying A");
      gemm(h, false, false, m, m, m, c.c, A, m, A, m, c.b, B, m);  // b*A + c*(A A)
      check(cudaMemcpyAsync(y2, y, sl.n * sizeof(float), cudaMemcpyDeviceToDevice, s), "muon: copying X");
      if (transpose) gemm(h, false, false, m, kk, m, 1.0f, B, m, y, m, c.a, y2, m);  // a*X + B X
      else gemm(h, false, true, kk, m, m, 1.0f, y, kk, B, m, c.a, y2, kk);           // a*Y + Y B^T
      std::swap(y, y2);
    }
    if (y != sl.work)
      check(cudaMemcpyAsync(sl.work, y, sl.n * sizeof(float), cudaMemcpyDeviceToDevice, s), "muon: the result");

    c.neg_adjusted_lr = MuonMath::adjusted_lr(c, rows, cols);
    dispatch_dtype(sl.dtype,
                   [&]<class T>() { update_kernel<T><<<grid_for(sl.n), kThreads, 0, s>>>(c, arrays_of(sl), sl.work); });
    check(cudaGetLastError(), "muon: the update's kernel");
  }
  if (!stream) check(cudaStreamSynchronize(s), "muon step");
}

}  // namespace distopt::cuda
