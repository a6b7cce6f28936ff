// Private to the Optimizer's files (src/optim/optimizer.cpp, optimizer_device.cpp,
// optimizer_state.cpp):
// the state it keeps for each parameter, and a step awaiting its skip flag.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cuda_step.hpp"
#include "distopt/core/buffer.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/quant.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt {

// A state tensor kept quantized (quant.hpp): its codes and block scales
// (ParamState::tensors[k] is then empty); dtype f32: kept in tensors[k].
struct QuantizedTensor {
  quant::StateDType dtype = quant::StateDType::f32;
  bool is_signed = false;
  Buffer codes, absmax;
  bool on() const { return dtype != quant::StateDType::f32; }
};

// q in place, as quantized_views shows it (n elements on `device`, the
// optimizer's: an empty buffer does not know it).
inline Optimizer::QuantizedView view_of(const QuantizedTensor& q, std::string_view key, std::size_t n, Device device) {
  return {std::string(key),
          q.dtype,
          q.is_signed,
          const_cast<std::uint8_t*>(q.codes.as<std::uint8_t>()),
          const_cast<float*>(q.absmax.as<float>()),
          n,
          device};
}

// n elements of value 0 in q, on `device`.
inline void fill_zero(QuantizedTensor& q, std::size_t n, Device device) {
  const Optimizer::HostQuantized h(view_of(q, "", n, device), false);
  quant::fill_zero(q.dtype, q.is_signed, h.view().codes, h.view().absmax, n);
  h.commit();
}

// The suffix of a quantized state tensor's scales in state_dict ("exp_avg.absmax").
inline constexpr std::string_view kAbsmaxSuffix = quant::kAbsmaxSuffix;

struct Optimizer::ParamState {
  bool initialized = false;
  std::uint64_t layout_version = 0;
  std::vector<std::string_view> tensor_names;  // matches tensors
  std::vector<Buffer> tensors;
  std::vector<std::string_view> scalar_names;
  float scalars[kMaxStateScalars] = {};
  Buffer master;  // fp32 copy of a bf16/f16 parameter
  Buffer work;    // fp32 scratch of tensor_stats rules (RuleInfo::workspace)
  Buffer aux;     // small per-tensor state (RuleInfo::aux_size), whole
  std::vector<QuantizedTensor> quantized;  // matches tensors
  bool any_quantized() const {
    return std::any_of(quantized.begin(), quantized.end(), [](const QuantizedTensor& q) { return q.on(); });
  }
  mutable std::vector<float> host_copy;  // state_tensor() of device state
};

// Stagger slots: 0 = parameter, 1 = gradient (by convention of the callers
// that allocate them), 2 = master weights, 3.. = state tensors, then the
// scratch and the small state.
constexpr int kMasterSlot = 2;
constexpr int kFirstStateSlot = 3;

// Whether state tensor k of a tensor of this shape is kept quantized under
// storage sd: a tensor the rule may quantize, of at least quant::min_elements(sd)
// elements in all (whatever piece of it a rank holds).
inline bool quantizes(const RuleInfo& rule, quant::StateDType sd, std::size_t k, const Shape& tensor) {
  return sd != quant::StateDType::f32 && rule.quantized[k] != QuantSign::none &&
         static_cast<std::size_t>(numel(tensor)) >= quant::min_elements(sd);
}

// "parameter 3 ('fc.weight')" in messages.
inline std::string param_label(const Param& p, std::size_t i) {
  return p.name.empty() ? str("parameter ", i) : str("parameter ", i, " ('", p.name, "')");
}

// The elements [begin, end) of parameter p whose statistics this rank
// gathers (Param::stat_begin, stat_count).
inline std::pair<std::size_t, std::size_t> stat_range(const Param& p) {
  const auto n = static_cast<std::size_t>(p.value.numel());
  const std::size_t begin = std::min(p.stat_begin, n);
  return {begin, p.stat_count == Param::kAll ? n : std::min(n, begin + p.stat_count)};
}

// The skip flags of GradScaler's protocol (skip_next_step_if): the host copy
// of the last flag (made once, reused), and while it is unread, what that
// step changed on the host, to put back if the flag says it was skipped.
struct Optimizer::SkipState {
  cuda::FlagCopy* flag = nullptr;
  bool pending = false;
  std::vector<std::uint64_t> group_steps;  // before the step
  std::vector<std::pair<std::size_t, std::array<float, kMaxStateScalars>>> scalars;  // of stepped parameters
  std::vector<std::size_t> created;  // parameters whose state it created
  ~SkipState() { cuda::free_flag(flag); }
};

}  // namespace distopt
