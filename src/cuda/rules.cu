// Which rules have CUDA kernels (the lists of rules/pointwise.hpp and
// rules/stats.hpp, and muon.cu's), and the
// Optimizer's entry to them and to the copies of its skip flags
// (optim/cuda_step.hpp).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "../optim/cuda_step.hpp"
#include "../optim/rules/pointwise.hpp"
#include "../optim/rules/stats.hpp"
#include "check.cuh"
#include "distopt/core/error.hpp"

namespace distopt::cuda {
// Each of pointwise.cuh and stats.cuh is built twice, into these namespaces.
#define DISTOPT_KERNEL_ENTRIES                                                                                   \
  bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,        \
           std::optional<std::uintptr_t> stream, const float* skip);                                             \
  bool run_quantized(std::string_view rule, quant::StateDType storage, std::span<const RuleBlob* const> coeffs,  \
                     std::span<const Slice> slices, std::span<const QuantizedSlice> codes,                       \
                     std::optional<std::uintptr_t> stream, const float* skip);                                   \
  bool run_pass(std::string_view rule, int pass, std::span<const RuleBlob* const> coeffs,                        \
                std::span<const Slice> slices, std::span<const StatRange> ranges,                                \
                std::span<const std::span<const float>> aux, std::span<double* const> out,                       \
                std::optional<std::uintptr_t> stream);                                                           \
  bool run_update(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices, \
                  std::optional<std::uintptr_t> stream);
namespace ieee {
DISTOPT_KERNEL_ENTRIES
}
namespace ftz {
DISTOPT_KERNEL_ENTRIES
}
#undef DISTOPT_KERNEL_ENTRIES

bool has_kernel(std::string_view rule) {
  return rules::with_math(rules::kPointwise, rule, [&]<class M>() {}) || has_stats_kernel(rule) ||
         has_whole_kernel(rule);
}

bool has_stats_kernel(std::string_view rule) {
  return rules::with_math(rules::kTensorStats, rule, [&]<class M>() {});
}

std::string_view kernel_rules() {
  static const std::string names =
      rules::names_of(rules::kPointwise) + ", " + rules::names_of(rules::kTensorStats) + ", muon";
  return names;
}

void pointwise_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    bool flush, std::optional<std::uintptr_t> stream, const float* skip) {
  if (coeffs.size() != slices.size()) throw PreconditionError("pointwise_step: one coefficient block per slice");
  const bool ran =
      flush ? ftz::run(rule, coeffs, slices, stream, skip) : ieee::run(rule, coeffs, slices, stream, skip);
  if (!ran) throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
}

void quantized_step(std::string_view rule, quant::StateDType storage, std::span<const RuleBlob* const> coeffs,
                    std::span<const Slice> slices, std::span<const QuantizedSlice> codes, bool flush,
                    std::optional<std::uintptr_t> stream, const float* skip) {
  if (coeffs.size() != slices.size() || codes.size() != slices.size())
    throw PreconditionError("quantized_step: one coefficient block and one set of codes per slice");
  const bool ran = flush ? ftz::run_quantized(rule, storage, coeffs, slices, codes, stream, skip)
                         : ieee::run_quantized(rule, storage, coeffs, slices, codes, stream, skip);
  if (!ran) throw InvalidInput(str(rule, " keeps no quantized state on the device"));
}

void stats_pass(std::string_view rule, int pass, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                std::span<const StatRange> ranges, std::span<const std::span<const float>> aux,
                std::span<double* const> out, bool flush, std::optional<std::uintptr_t> stream) {
  if (coeffs.size() != slices.size() || out.size() != slices.size() ||
      (!ranges.empty() && ranges.size() != slices.size()) || (!aux.empty() && aux.size() != slices.size()))
    throw PreconditionError("stats_pass: one coefficient block, output, range and small state per slice");
  const bool ran = flush ? ftz::run_pass(rule, pass, coeffs, slices, ranges, aux, out, stream)
                         : ieee::run_pass(rule, pass, coeffs, slices, ranges, aux, out, stream);
  if (!ran) throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
}

void stats_update(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                  bool flush, std::optional<std::uintptr_t> stream) {
  if (coeffs.size() != slices.size()) throw PreconditionError("stats_update: one coefficient block per slice");
  const bool ran =
      flush ? ftz::run_update(rule, coeffs, slices, stream) : ieee::run_update(rule, coeffs, slices, stream);
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
