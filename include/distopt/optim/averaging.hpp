// Weight averaging: torch.optim.swa_utils.AveragedModel over flat fp32
// parameters (docs/optimizers.md, "Weight averaging (SWA, EMA)").
//
// AveragedParams keeps a running average of a parameter vector -- a model's
// flat buffer, or the shard of it that one rank owns: every formula here is
// pointwise, so averaging each shard gives exactly the shards of the
// unsharded average. update() copies on its first call (n_averaged = 0),
// then folds the new values in with one of torch's averaging functions, all
// computed in float32 as torch computes them on float32 tensors:
//
//   swa       avg + (p - avg) / (n + 1)        AveragedModel's default (torch 1.13)
//   swa_lerp  lerp(avg, p, 1 / (n + 1))        the default since torch 2.1
//   ema       decay * avg + (1 - decay) * p    get_ema_avg_fn(decay)
//   ema_lerp  lerp(avg, p, 1 - decay)          get_ema_multi_avg_fn(decay)
//   custom    fn(avg, p, n) per element        AveragedModel(avg_fn=...)
//
// n is the number of averages already taken (n_averaged before the update).
// The average is always kept in fp32, also for bf16/f16 models (their fp32
// master weights are what gets averaged); torch would average a bf16 model
// in bf16. Models with batch-norm buffers would need update_bn(); the
// built-in models have none.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace distopt {

enum class AveragingKind { swa, swa_lerp, ema, ema_lerp, custom };

// fn(averaged, current, n_averaged) -> new averaged value, for `custom`.
using AveragingFn = std::function<float(float averaged, float current, std::int64_t n_averaged)>;

struct AveragingOptions {
  AveragingKind kind = AveragingKind::swa;
  double decay = 0.999;  // ema, ema_lerp: in [0, 1]
  AveragingFn fn;        // custom
};

// Parses "swa", "swa_lerp", "ema", "ema_lerp"; throws InvalidInput otherwise.
AveragingKind averaging_kind(std::string_view name);
std::string_view averaging_name(AveragingKind kind);

// What state_dict() returns: the averaged values and torch's n_averaged.
struct AveragedState {
  std::int64_t n_averaged = 0;
  std::vector<float> params;
};

class AveragedParams {
 public:
  // Averages vectors of `elements` floats. Throws InvalidInput for a decay
  // outside [0, 1] or a custom kind without a function.
  AveragedParams(std::size_t elements, AveragingOptions options = {});

  // Folds `current` (elements() values) into the average.
  void update(std::span<const float> current);

  // The average; zeros before the first update() (torch's AveragedModel
  // starts from a copy of the model, which its first update overwrites).
  std::span<const float> params() const { return avg_; }
  std::int64_t n_averaged() const { return n_; }
  std::size_t elements() const { return avg_.size(); }
  const AveragingOptions& options() const { return options_; }

  AveragedState state_dict() const { return {n_, avg_}; }
  // Checks the size and n_averaged >= 0 before changing anything.
  void load_state_dict(const AveragedState& state);

 private:
  AveragingOptions options_;
  std::vector<float> avg_;
  std::int64_t n_ = 0;
};

// torch's lerp on floats, as its CPU kernel computes it (fused
// multiply-adds; the golden files tell the fused and unfused forms apart):
// fma(w, end - start, start) for |w| < 0.5, else
// fma(-(end - start), 1 - w, end), so that w = 1 gives `end` exactly.
inline float lerp_torch(float start, float end, float weight) {
  const float diff = end - start;
  return (weight < 0.5f && weight > -0.5f) ? std::fma(weight, diff, start) : std::fma(-diff, 1.0f - weight, end);
}

}  // namespace distopt
