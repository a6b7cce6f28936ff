// optim/cuda_step.hpp for a build without CUDA: no rule has a kernel.
#include "cuda_step.hpp"

#include "distopt/core/error.hpp"

namespace distopt::cuda {

bool has_kernel(std::string_view) { return false; }
std::string_view kernel_rules() { return ""; }
void pointwise_step(std::string_view, std::span<const RuleBlob* const>, std::span<const Slice>, bool,
                    std::optional<std::uintptr_t>) {
  throw InvalidInput("this build has no CUDA (configure with -DDISTOPT_CUDA=ON on a machine with nvcc)");
}

}  // namespace distopt::cuda
