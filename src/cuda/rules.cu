// Which rules have CUDA kernels (the list of rules/pointwise.hpp), and the
// Optimizer's entry to them (optim/cuda_step.hpp).
#include <string>

#include "../optim/cuda_step.hpp"
#include "../optim/rules/pointwise.hpp"
#include "distopt/core/error.hpp"

namespace distopt::cuda {
namespace ieee {
bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
         std::optional<std::uintptr_t> stream);
}
namespace ftz {
bool run(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
         std::optional<std::uintptr_t> stream);
}

bool has_kernel(std::string_view rule) {
  return rules::with_pointwise_math(rule, [&]<class M>() {});
}

std::string_view kernel_rules() {
  static const std::string names = rules::pointwise_names();
  return names;
}

void pointwise_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    bool flush, std::optional<std::uintptr_t> stream) {
  if (coeffs.size() != slices.size()) throw PreconditionError("pointwise_step: one coefficient block per slice");
  const bool ran = flush ? ftz::run(rule, coeffs, slices, stream) : ieee::run(rule, coeffs, slices, stream);
  if (!ran) throw InvalidInput(str(rule, " has no CUDA kernel (the device runs ", kernel_rules(), ")"));
}

}  // namespace distopt::cuda
