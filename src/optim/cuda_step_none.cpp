// optim/cuda_step.hpp for a build without CUDA: no rule has a kernel.
#include "cuda_step.hpp"

#include "distopt/core/error.hpp"

namespace distopt::cuda {

namespace {
[[noreturn]] void no_cuda() {
  throw InvalidInput("this build has no CUDA (configure with -DDISTOPT_CUDA=ON on a machine with nvcc)");
}
}  // namespace

bool has_kernel(std::string_view) { return false; }
std::string_view kernel_rules() { return ""; }
void pointwise_step(std::string_view, std::span<const RuleBlob* const>, std::span<const Slice>, bool,
                    std::optional<std::uintptr_t>, const float*) {
  no_cuda();
}
void quantized_step(std::string_view, quant::StateDType, std::span<const RuleBlob* const>, std::span<const Slice>,
                    std::span<const QuantizedSlice>, bool, std::optional<std::uintptr_t>, const float*) {
  no_cuda();
}
bool has_stats_kernel(std::string_view) {
  return false;
}
void stats_pass(std::string_view, int, std::span<const RuleBlob* const>, std::span<const Slice>,
                std::span<const StatRange>, std::span<const std::span<const float>>, std::span<double* const>, bool,
                std::optional<std::uintptr_t>) {
  no_cuda();
}
void stats_update(std::string_view, std::span<const RuleBlob* const>, std::span<const Slice>, bool,
                  std::optional<std::uintptr_t>) {
  no_cuda();
}

bool has_whole_kernel(std::string_view) {
  return false;
}
void check_whole_step(std::string_view, const OptionMap&) {}
void whole_step(std::string_view, std::span<const RuleBlob* const>, std::span<const Slice>,
                std::optional<std::uintptr_t>) {
  no_cuda();
}

double grad_norm_partial(std::span<const TensorView>, double) {
  no_cuda();
}
void scale_grads(std::span<const TensorView>, float) {
  no_cuda();
}
void clamp_grads(std::span<const TensorView>, float) {
  no_cuda();
}

FlagCopy* new_flag_copy() {
  no_cuda();
}
void copy_flag(FlagCopy*, const float*, std::optional<std::uintptr_t>) {}
float flag_value(FlagCopy*) { return 0.0f; }
void free_flag(FlagCopy*) noexcept {}

}  // namespace distopt::cuda
