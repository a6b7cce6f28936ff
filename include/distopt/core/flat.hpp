// Parameters packed into one flat buffer (docs/architecture.md, "Data layout"): each
// parameter is a view {name, offset, shape} into it. Gradients mirror it.
#pragma once

#include <cstddef>
#include <string>

#include "distopt/core/tensor.hpp"

namespace distopt {

struct ParamSlot {
  std::string name;    // torch-style, e.g. "fc1.weight"
  std::size_t offset;  // in elements, into the flat buffer
  Shape shape;
  std::size_t numel() const { return static_cast<std::size_t>(distopt::numel(shape)); }
};

}  // namespace distopt
