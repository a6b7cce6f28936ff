#include "distopt/models/model.hpp"

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

}  // namespace distopt::models
