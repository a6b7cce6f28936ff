// The Optimizer's step of CUDA parameters (include/distopt/optim/optimizer.hpp,
// docs/gpu.md): the pointwise rules in one multi-tensor launch per group,
// and those whose state is kept quantized in another (quant.hpp); the
// tensor_stats rules (LAMB, LARS, Adafactor) pass by pass with their
// statistics finished on the host, as the CPU finishes them; muon's
// Newton-Schulz on cuBLAS (src/cuda/muon.cu).
#include <string>
#include <vector>

#include "cuda_step.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/optim/optimizer.hpp"
#include "optimizer_impl.hpp"

namespace distopt {

void Optimizer::step_on_device(const float* skip) {
  // One call per group: every active tensor of it, whole, in few launches.
  // The kernels are built twice, so that they flush denormals exactly when
  // this thread's CPU would (DenormalMode).
  const bool flush = flushing_denormals();
  // Tensors whose state is kept quantized (quant.hpp) step in a launch of their own.
  std::vector<const RuleBlob*> coeffs, quantized_coeffs;
  std::vector<Slice> slices, quantized_slices;
  std::vector<cuda::QuantizedSlice> codes;
  bool stats = false;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    coeffs.clear();
    slices.clear();
    quantized_coeffs.clear();
    quantized_slices.clear();
    codes.clear();
    for (std::size_t i : active_) {
      if (group_of_[i] != g) continue;
      const Slice s = slice_of(i, 0, static_cast<std::size_t>(params_[i].value.numel()));
      const ParamState& st = *state_[i];
      if (!st.any_quantized()) {
        coeffs.push_back(&coeffs_[i]);
        slices.push_back(s);
        continue;
      }
      cuda::QuantizedSlice q;
      for (std::size_t k = 0; k < st.quantized.size(); ++k)
        if (st.quantized[k].on()) {
          q.codes[k] = const_cast<std::uint8_t*>(st.quantized[k].codes.as<std::uint8_t>());
          q.absmax[k] = const_cast<float*>(st.quantized[k].absmax.as<float>());
          q.is_signed[k] = st.quantized[k].is_signed;
        }
      quantized_coeffs.push_back(&coeffs_[i]);
      quantized_slices.push_back(s);
      codes.push_back(q);
    }
    if (slices.empty() && quantized_slices.empty()) continue;
    const RuleInfo& rule = *group_rules_[g];
    if (rule.stat_passes > 0) {
      DISTOPT_CHECK(quantized_slices.empty(), rule.name, " with quantized state");
      stats = true;
      continue;
    }
    if (!slices.empty()) cuda::pointwise_step(rule.name, coeffs, slices, flush, cuda_stream_, skip);
    if (!quantized_slices.empty())
      cuda::quantized_step(rule.name, state_dtype_of(groups_[g].options), quantized_coeffs, quantized_slices, codes,
                           flush, cuda_stream_, skip);
  }
  if (!stats) return;
  // The tensor_stats rules wait for their statistics on the host anyway:
  // they read the skip flag there first, and a skipped step runs nothing of
  // them (their small state, which finish_pass changes on the host, stays),
  // nor the ranks' reduction of their statistics: a flag must agree over
  // the ranks (GradScaler's found_inf is all-reduced).
  if (skip != nullptr) {
    cuda::copy_flag(skip_->flag, skip, cuda_stream_);
    if (cuda::flag_value(skip_->flag) != 0.0f) return;
  }
  run_stat_passes(false);
}

void Optimizer::stat_passes_on_device(const RuleInfo& rule) {
  const bool flush = flushing_denormals();
  std::vector<const RuleBlob*> coeffs;
  std::vector<Slice> slices;
  std::vector<cuda::StatRange> ranges;
  std::vector<std::span<const float>> aux;  // host memory: finish_pass keeps it there
  for (std::size_t i : pass_active_) {
    ParamState& st = *state_[i];
    const auto n = static_cast<std::size_t>(params_[i].value.numel());
    if (rule.workspace && st.work.size_bytes() != n * sizeof(float))
      st.work = Buffer(n * sizeof(float), kFirstStateSlot + kMaxStateTensors, device_,
                       str("scratch of ", param_label(params_[i], i)));
    coeffs.push_back(&coeffs_[i]);
    slices.push_back(slice_of(i, 0, n));
    const auto [begin, end] = stat_range(params_[i]);
    ranges.push_back({begin, end});
    aux.emplace_back(st.aux.empty() ? nullptr : st.aux.as<float>(), st.aux.size_bytes() / sizeof(float));
  }
  // A whole_tensor rule (muon) steps its whole tensors in one call.
  if (rule.whole != nullptr) {
    cuda::whole_step(rule.name, coeffs, slices, cuda_stream_);
    return;
  }
  std::vector<double*> out(pass_active_.size());
  for (int pass = 0; pass < rule.stat_passes; ++pass) {
    size_stats(rule, pass);
    for (std::size_t j = 0; j < pass_active_.size(); ++j) out[j] = stats_.data() + stat_offsets_[j];
    // The small state as the last pass's finish_pass left it travels with
    // this pass's metadata.
    cuda::stats_pass(rule.name, pass, coeffs, slices, ranges, aux, out, flush, cuda_stream_);
    finish_stat_pass(rule, pass);
  }
  cuda::stats_update(rule.name, coeffs, slices, flush, cuda_stream_);
}

}  // namespace distopt
