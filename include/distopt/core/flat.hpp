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

// Where a model places a parameter in its unit: one of at least
// kLargeParamElements elements starts on a multiple of kLargeParamAlign
// elements of its unit. The sharded layouts cut units on such multiples when
// the optimizer keeps block-quantized state (include/distopt/optim/quant.hpp,
// whose threshold and largest block these are), so that they cut such a
// parameter only between its blocks. `at` is the first free element of the
// unit; the result is where the parameter goes.
inline constexpr std::size_t kLargeParamElements = 4096, kLargeParamAlign = 256;
inline std::size_t place_in_unit(std::size_t at, std::size_t numel) {
  if (numel < kLargeParamElements) return at;
  return (at + kLargeParamAlign - 1) / kLargeParamAlign * kLargeParamAlign;
}

}  // namespace distopt
