// optim/cuda_step.hpp for a build without CUDA: no rule has a kernel.
#include "cuda_step.hpp"

#include "distopt/core/error.hpp"

namespace distopt::cuda {

bool has_kernel(std::string_view) { return false; }
std::string_view kernel_rules() { return ""; }
void pointwise_step(std::string_view, std::span<const RuleBlob* const>, std::span<const Slice>, bool,
                    std::optional<std::uintptr_t>, const float*) {
  throw InvalidInput("this build has no CUDA (configure with -DDISTOPT_CUDA=ON on a machine with nvcc)");
}

FlagCopy* new_flag_copy() {
  throw InvalidInput("this build has no CUDA (configure with -DDISTOPT_CUDA=ON on a machine with nvcc)");
}
void copy_flag(FlagCopy*, const float*, std::optional<std::uintptr_t>) {}
float flag_value(FlagCopy*) { return 0.0f; }
void free_flag(FlagCopy*) noexcept {}

}  // namespace distopt::cuda
