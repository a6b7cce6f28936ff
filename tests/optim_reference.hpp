// Scalar double-precision references of the update rules, written from the
// formulas of docs/optimizers.md, "Pointwise rules" (torch 1.13 for NAdam's momentum
// product) independently of src/optim: one element at a time, plain math.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "distopt/optim/options.hpp"

namespace distopt::reference {

struct State {
  bool initialized = false;
  std::map<std::string, std::vector<double>> tensors;
  std::map<std::string, double> scalars;
};

// One step of `rule` with fully resolved options (every option present).
void step(const std::string& rule, const OptionMap& options, std::vector<double>& param,
          const std::vector<double>& grad, State& state);

}  // namespace distopt::reference
