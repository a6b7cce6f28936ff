#include "distopt/core/tensor.hpp"

#include "distopt/core/error.hpp"

namespace distopt {

void require_on_cpu(const TensorView& t, std::string_view what) {
  if (t.device != Device::cpu)
    throw InvalidInput(str(what, " reads tensors on the CPU; this one is on ", name_of(t.device), " (docs/gpu.md)"));
}

std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (auto d : shape) {
    DISTOPT_CHECK(d >= 0, "negative dimension ", d, " in shape ", to_string(shape));
    n *= d;
  }
  return n;
}

std::string to_string(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace distopt
