#include "distopt/models/model.hpp"

#include <algorithm>
#include <vector>

#include "distopt/core/error.hpp"

namespace distopt::models {

BufferAccess::BufferAccess(const Model& model, std::span<const float> params, std::span<float> grads)
    : model_(model), params_(params), grads_(grads) {
  DISTOPT_CHECK(params.size() == model.buffer_elements(), params.size(), " vs ", model.buffer_elements());
  DISTOPT_CHECK(grads.empty() || grads.size() == model.buffer_elements(), grads.size(), " vs ",
                model.buffer_elements());
}

std::span<const float> BufferAccess::acquire(std::size_t u, Pass) {
  const Unit& unit = model_.units().at(u);
  return params_.subspan(unit.begin, unit.end - unit.begin);
}

std::span<float> BufferAccess::grads(std::size_t u) {
  DISTOPT_CHECK(!grads_.empty(), "backward needs a gradient buffer");
  const Unit& unit = model_.units().at(u);
  return grads_.subspan(unit.begin, unit.end - unit.begin);
}

BatchStats Model::forward_backward(std::span<const float> buffer, const float* x, const float* y, std::size_t n,
                                   float grad_scale, std::span<float> grads) {
  BufferAccess access(*this, buffer, grads);
  return do_forward_backward(access, x, y, n, grad_scale);
}

BatchStats Model::evaluate(std::span<const float> buffer, const float* x, const float* y, std::size_t n) {
  BufferAccess access(*this, buffer);
  return do_evaluate(access, x, y, n);
}

void Model::init_range(std::size_t begin, std::span<float> out, std::uint64_t seed) const {
  DISTOPT_CHECK(begin <= buffer_elements_ && out.size() <= buffer_elements_ - begin, begin, " + ", out.size(),
                " vs ", buffer_elements_);
  std::vector<float> whole(buffer_elements_);
  init(whole, seed);
  std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(begin), out.size(), out.begin());
}

void Model::init_each_param(std::size_t begin, std::span<float> out, const ParamFill& fill) const {
  DISTOPT_CHECK(begin <= buffer_elements_ && out.size() <= buffer_elements_ - begin);
  std::fill(out.begin(), out.end(), 0.0f);
  const std::size_t end = begin + out.size();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamSlot& p = params_[i];
    const std::size_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel());
    if (lo >= hi) continue;
    fill(i, lo - p.offset, out.subspan(lo - begin, hi - lo));
  }
}

}  // namespace distopt::models
