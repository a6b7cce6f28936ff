// Private to the Optimizer's files (src/optim/optimizer.cpp, optimizer_state.cpp):
// the state it keeps for each parameter.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt {

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
  mutable std::vector<float> host_copy;  // state_tensor() of device state
};

}  // namespace distopt
