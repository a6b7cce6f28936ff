// Which rules have CUDA kernels (the list of rules/pointwise.hpp), and the
// Optimizer's entry to them and to the copies of its skip flags
// (optim/cuda_step.hpp).
#include <cuda_runtime.h>

#include <string>

#include "../optim/cuda_step.hpp"
#include "../optim/rules/pointwise.hpp"
#include "check.cuh"
#include "distopt/core/error.hpp"

namespace distopt::cuda {
namespace ieee {
bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
         std::optional<std::uintptr_t> stream, const float* skip);
}
namespace ftz {
bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
         std::optional<std::uintptr_t> stream, const float* skip);
}

bool has_kernel(std::string_view rule) {
  return rules::with_pointwise_math(rule, [&]<class M>() {});
}

std::string_view kernel_rules() {
  static const std::string names = rules::pointwise_names();
  return names;
}

void pointwise_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    bool flush, std::optional<std::uintptr_t> stream, const float* skip) {
  if (coeffs.size() != slices.size()) throw PreconditionError("pointwise_step: one coefficient block per slice");
  const bool ran =
      flush ? ftz::run(rule, coeffs, slices, stream, skip) : ieee::run(rule, coeffs, slices, stream, skip);
  if (!ran) throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
}

struct FlagCopy {
  float* host = nullptr;  // pinned
  cudaEvent_t done{};
};

FlagCopy* new_flag_copy() {
  auto* c = new FlagCopy;
  try {
    check(cudaMallocHost(&c->host, sizeof(float)), "pinned memory for a skip flag");
    check(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming), "creating an event");
  } catch (...) {
    free_flag(c);
    throw;
  }
  return c;
}

void copy_flag(FlagCopy* c, const float* flag, std::optional<std::uintptr_t> stream) {
  const cudaStream_t s = stream ? as_stream(*stream) : cudaStream_t{0};
  check(cudaMemcpyAsync(c->host, flag, sizeof(float), cudaMemcpyDeviceToHost, s), "copying a skip flag");
  check(cudaEventRecord(c->done, s), "recording a skip flag's copy");
}

float flag_value(FlagCopy* c) {
  check(cudaEventSynchronize(c->done), "waiting for a skip flag");
  return *c->host;
}

void free_flag(FlagCopy* c) noexcept {
  if (c == nullptr) return;
  if (c->done) (void)cudaEventDestroy(c->done);
  if (c->host) (void)cudaFreeHost(c->host);
  delete c;
}

}  // namespace distopt::cuda
