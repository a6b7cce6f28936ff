// Dynamic loss scaling: torch.cuda.amp.GradScaler (torch 1.13; the same
// logic as torch.amp.GradScaler in 2.x; docs/optimizers.md, "Dynamic loss
// scaling (GradScaler)").
//
// The loss is multiplied by the scale before backward, so small gradients
// survive f16; unscale() multiplies the gradients by the float32 reciprocal
// of the scale and records whether any element is inf or NaN; step() runs
// the optimizer only when none is; update() backs the scale off after a
// skipped step and grows it after growth_interval good steps in a row:
//
//   found inf:  scale <- float(scale * backoff_factor), tracker <- 0
//   otherwise:  tracker + 1 == growth_interval ?
//                 (scale <- float(scale * growth_factor) if finite, tracker <- 0)
//               : tracker <- tracker + 1
//
// The scale and its tracker are created by the first scale() call, as torch
// creates them lazily; unscale/step/update before that are errors.
//
// Arithmetic is IEEE's whatever the caller's denormal mode (training
// flushes denormals): a scale above 2^126 has a denormal reciprocal, and
// flushing it would zero every gradient.
//
// One difference from torch: an optimizer none of whose parameters has a
// gradient records "no inf" (torch records nothing and its step() then
// asserts), because a rank whose shard holds no gradient must still take
// part in the found-inf reduction.
//
// Sharding: the found-inf flag of an optimizer is a reduction hook. A rank
// that holds only a shard of the gradient passes a StatReduce (max over the
// ranks holding the other shards), so every rank takes the same skip
// decision and the same scale update.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>

#include "distopt/core/tensor.hpp"
#include "distopt/optim/clip.hpp"

namespace distopt {

class Optimizer;

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // > 1
  double backoff_factor = 0.5;  // < 1
  std::int64_t growth_interval = 2000;
  bool enabled = true;  // false: scale() returns its input, step() just steps
  // Unscale f16 gradients in place instead of refusing them (torch's
  // internal allow_fp16 of _unscale_grads_). For f16 parameters with fp32
  // master weights: the unscaled gradient is rounded to f16 once more, so
  // gradients below f16's normal range (6.1e-5) keep fewer bits.
  bool allow_fp16 = false;
};

// torch's state_dict(): {scale, growth_factor, backoff_factor,
// growth_interval, _growth_tracker}.
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0, backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t growth_tracker = 0;
};

// torch._amp_foreach_non_finite_check_and_unscale_: returns whether any
// element of `grads` is inf or NaN, and multiplies every element by
// inv_scale unless inv_scale is 1. f32 and bf16 gradients; f16 ones throw
// InvalidInput ("Attempting to unscale FP16 gradients.") unless allow_fp16.
bool unscale_grads(std::span<const TensorView> grads, float inv_scale, bool allow_fp16 = false);

class GradScaler {
 public:
  // Throws InvalidInput unless growth_factor > 1, backoff_factor < 1 and
  // 1 <= growth_interval <= 2^31 - 1 (torch asserts the first two; its
  // kernel takes the interval as a C int).
  explicit GradScaler(GradScalerOptions options = {});

  bool enabled() const { return options_.enabled; }
  // loss * scale in float32 (the scale tensor's dtype); creates the scale on
  // the first call. Disabled: loss unchanged.
  float scale(float loss);
  // get_scale(): the current scale (init_scale before the first scale()),
  // 1 when disabled.
  double get_scale() const;
  std::int64_t growth_tracker() const;

  // unscale_(opt): unscales the gradients of opt's parameters that have one
  // and records their found-inf flag, reduced with `reduce` when given.
  // Throws InvalidInput when already unscaled or stepped since update().
  void unscale(Optimizer& opt, const StatReduce& reduce = {});
  // step(opt): unscale() unless done, then opt.step() only if no gradient
  // had an inf or NaN. Returns whether the optimizer stepped. Throws
  // InvalidInput when called twice without update().
  bool step(Optimizer& opt, const StatReduce& reduce = {});
  // The found-inf flag recorded for opt since the last update().
  std::optional<bool> found_inf(const Optimizer& opt) const;
  // update(new_scale): sets the scale to new_scale when given, else applies
  // the rule above to the sum of the recorded flags. Forgets every
  // optimizer's stage. Throws InvalidInput when no flag was recorded.
  void update(std::optional<double> new_scale = std::nullopt);

  // Setters check their value as the constructor does (torch's setters do
  // not check; a factor the constructor refuses is refused here too).
  void set_growth_factor(double f);
  void set_backoff_factor(double f);
  void set_growth_interval(std::int64_t n);

  // Disabled: empty (nullopt), as torch returns {}.
  std::optional<GradScalerState> state_dict() const;
  // Validates the factors first; a disabled scaler ignores it.
  void load_state_dict(const GradScalerState& state);

 private:
  enum class Stage { ready, unscaled, stepped };
  struct PerOptimizer {
    Stage stage = Stage::ready;
    std::optional<float> found_inf;
  };
  void require_initialized(const char* what) const;

  GradScalerOptions options_;
  bool initialized_ = false;
  float scale_ = 0;
  std::int32_t tracker_ = 0;
  std::int64_t init_tracker_ = 0;
  std::map<const Optimizer*, PerOptimizer> per_opt_;
};

}  // namespace distopt
