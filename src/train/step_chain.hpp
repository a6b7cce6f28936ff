// What a training step does around the optimizer's update, as a chain of
// small transforms (optax's idea): each transform of the reduced gradient
// runs in the order it was added (torch's: unscale, clip by norm, clip by
// value), then the step (the optimizer's, or the loss scaler's, which skips
// it on inf/NaN), then each thing that follows an update (the scaler's
// update, the EMA, a per-batch scheduler). Private to the train room.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "distopt/optim/optimizer.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::train {

class StepChain {
 public:
  using GradTransform = std::function<void(Optimizer&, const parallel::GradShard&)>;
  // Steps the optimizer; false: the step was skipped.
  using Step = std::function<bool(Optimizer&, const parallel::GradShard&)>;
  using After = std::function<void(bool stepped)>;

  StepChain& then(GradTransform t) {
    transforms_.push_back(std::move(t));
    return *this;
  }
  StepChain& step_with(Step s) {
    step_ = std::move(s);
    return *this;
  }
  StepChain& after(After a) {
    after_.push_back(std::move(a));
    return *this;
  }

  // What the strategy calls with the rank's reduced gradient.
  parallel::UpdateFn update() {
    return [this](Optimizer& opt, const parallel::GradShard& g) {
      for (const GradTransform& t : transforms_) t(opt, g);
      if (step_) {
        stepped_ = step_(opt, g);
      } else {
        opt.step();
        stepped_ = true;
      }
    };
  }
  // Before the strategy's step: a step counts as taken until the chain says otherwise.
  void begin_step() { stepped_ = true; }
  // What follows the update, in order.
  void after_update() const {
    for (const After& a : after_) a(stepped_);
  }
  bool stepped() const { return stepped_; }

 private:
  std::vector<GradTransform> transforms_;
  Step step_;
  std::vector<After> after_;
  bool stepped_ = true;
};

}  // namespace distopt::train
