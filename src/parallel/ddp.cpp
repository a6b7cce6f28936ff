// ddp: every rank holds the full parameters, gradients and optimizer state.
// A step all-reduces (sums) the gradient buffer — reduce-scatter then
// all-gather in rank order, so the result is the same on every backend —
// and every rank then runs the same full optimizer step.
#include <algorithm>

#include "distopt/core/buffer.hpp"
#include "distopt/core/error.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::parallel {

namespace {

constexpr std::string_view kStrategies[] = {"ddp", "zero1", "zero2", "zero3", "sgp",
                                            "osgp", "dpsgd", "adpsgd", "slowmo"};

std::vector<Param> views(const FlatLayout& layout, float* params, float* grads) {
  std::vector<Param> out;
  for (const ParamSlot& s : layout.params)
    out.push_back(Param{s.name, TensorView{params + s.offset, DType::f32, s.shape},
                        TensorView{grads + s.offset, DType::f32, s.shape}, true});
  return out;
}

class Ddp final : public Strategy {
 public:
  Ddp(Communicator& comm, const FlatLayout& layout, std::span<const float> initial, const OptimizerSpec& spec)
      : comm_(comm),
        layout_(layout),
        params_(layout.elements * sizeof(float), 0),
        grads_(layout.elements * sizeof(float), 1),
        optimizer_(spec.name, views(layout, params_.as<float>(), grads_.as<float>()), spec.options) {
    DISTOPT_CHECK(initial.size() == layout.elements, initial.size(), " vs ", layout.elements);
    std::copy(initial.begin(), initial.end(), params_.as<float>());
    std::fill_n(grads_.as<float>(), layout.elements, 0.0f);
  }

  std::string_view name() const override { return "ddp"; }
  std::span<const float> params() const override { return {params_.as<float>(), layout_.elements}; }
  std::span<float> grads() override { return {grads_.as<float>(), layout_.elements}; }

  void step(const UpdateFn& update) override {
    if (comm_.size() > 1)
      comm_.all_reduce(grads_.data(), grads_.data(), layout_.elements, ElemType::f32, ReduceOp::sum);
    for (std::size_t i = 0; i < optimizer_.num_params(); ++i) optimizer_.param(i).has_grad = true;
    // Every rank holds the whole summed gradient: statistics need no reduction.
    if (update)
      update(optimizer_, {});
    else
      optimizer_.step();
  }

  Optimizer& optimizer() override { return optimizer_; }

  MemoryUse memory() const override {
    MemoryUse m;
    m.params = layout_.elements * sizeof(float);
    m.grads = layout_.elements * sizeof(float);
    m.optimizer_state = optimizer_.state_bytes();
    return m;
  }

  std::vector<float> gather_params() override { return unpadded(layout_, params()); }

 private:
  Communicator& comm_;
  FlatLayout layout_;
  Buffer params_, grads_;
  Optimizer optimizer_;
};

}  // namespace

std::vector<float> unpadded(const FlatLayout& layout, std::span<const float> buffer) {
  DISTOPT_CHECK(buffer.size() >= layout.elements, buffer.size(), " vs ", layout.elements);
  std::vector<float> out;
  for (const ParamSlot& s : layout.params)
    out.insert(out.end(), buffer.begin() + static_cast<std::ptrdiff_t>(s.offset),
               buffer.begin() + static_cast<std::ptrdiff_t>(s.offset + s.numel()));
  return out;
}

std::span<const std::string_view> strategy_names() { return kStrategies; }

void require_strategy(std::string_view name) {
  if (name == "ddp") return;
  if (std::find(std::begin(kStrategies), std::end(kStrategies), name) != std::end(kStrategies))
    throw InvalidInput(str("strategy '", name, "' is not available yet in this build (available: ddp)"));
  std::string known;
  for (auto s : kStrategies) known += (known.empty() ? "" : ", ") + std::string(s);
  throw InvalidInput(str("unknown strategy '", name, "' (known: ", known, ")"));
}

std::unique_ptr<Strategy> make_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                        std::span<const float> initial, const OptimizerSpec& optimizer) {
  require_strategy(name);
  return std::make_unique<Ddp>(comm, layout, initial, optimizer);
}

}  // namespace distopt::parallel
