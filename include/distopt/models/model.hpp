// The built-in models. A model owns no parameters: they live in one flat,
// aligned float32 buffer that the parallel strategy owns (DESIGN.md, data
// layout), and the model describes where each parameter sits in it. Units
// (layers) are contiguous ranges of that buffer, so ZeRO-3 can gather one
// unit at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/core/flat.hpp"

namespace distopt::models {

using distopt::ParamSlot;  // offsets are 64-byte aligned

struct Unit {
  std::string name;            // e.g. "fc1"
  std::size_t begin, end;      // element range of the flat buffer
  std::vector<std::size_t> params;  // indices into Model::params()
};

// Sums over a batch: loss (cross-entropy or squared error), correct
// predictions (classification), samples.
struct BatchStats {
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string_view name() const = 0;
  const std::vector<ParamSlot>& params() const { return params_; }
  const std::vector<Unit>& units() const { return units_; }
  // Elements of the flat buffer, padding included.
  std::size_t buffer_elements() const { return buffer_elements_; }
  std::size_t features() const { return features_; }
  std::size_t outputs() const { return outputs_; }

  // PyTorch's default for nn.Linear: weight and bias ~ U(-1/sqrt(fan_in),
  // 1/sqrt(fan_in)); padding is zeroed. Deterministic in `seed`.
  virtual void init(std::span<float> buffer, std::uint64_t seed) const = 0;

  // Forward and backward over n samples (x: n × features, y: labels or
  // targets). Writes d(grad_scale · loss_sum)/d(params) into `grads` (same
  // layout as the buffer; padding zeroed) and returns the batch's sums.
  virtual BatchStats forward_backward(std::span<const float> buffer, const float* x, const float* y, std::size_t n,
                                      float grad_scale, std::span<float> grads) = 0;
  virtual BatchStats evaluate(std::span<const float> buffer, const float* x, const float* y, std::size_t n) = 0;

 protected:
  std::vector<ParamSlot> params_;
  std::vector<Unit> units_;
  std::size_t buffer_elements_ = 0, features_ = 0, outputs_ = 0;
};

// "mlp" (features-256-128-classes, ReLU, softmax cross-entropy), "logreg"
// (softmax regression), "linreg" (linear regression, squared error / 2);
// `hidden` overrides the mlp's hidden widths. Throws InvalidInput for an
// unknown name, listing the known ones.
std::unique_ptr<Model> make_model(std::string_view name, std::size_t features, std::size_t classes,
                                  std::vector<std::size_t> hidden = {});
std::vector<std::string_view> model_names();

}  // namespace distopt::models
