// Which rules have CUDA kernels, and the Optimizer's entry to them.
#include "../core/cuda_backend.hpp"
#include "distopt/core/error.hpp"

namespace distopt::cuda {
namespace ieee {
bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices);
}
namespace ftz {
bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices);
}

namespace {
constexpr std::string_view kRules[] = {"sgd",     "adam",  "adamw", "adamax", "adadelta", "adagrad",
                                       "rmsprop", "nadam", "radam", "rprop",  "asgd",     "lion"};
}

bool has_kernel(std::string_view rule) {
  for (std::string_view r : kRules)
    if (r == rule) return true;
  return false;
}

std::string_view kernel_rules() { return "sgd, adam, adamw, adamax, adadelta, adagrad, rmsprop, nadam, radam, rprop, asgd, lion"; }

void pointwise_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    bool flush) {
  if (coeffs.size() != slices.size()) throw PreconditionError("pointwise_step: one coefficient block per slice");
  const bool ran = flush ? ftz::run(rule, coeffs, slices) : ieee::run(rule, coeffs, slices);
  if (!ran) throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
}

}  // namespace distopt::cuda
