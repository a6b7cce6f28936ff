#include "distopt/optim/grad_scaler.hpp"

#include <cmath>
#include <vector>

#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/optim/optimizer.hpp"

namespace distopt {

namespace {

constexpr std::int64_t kInt32Max = 2147483647;  // torch's tracker and interval are C ints in the kernel

void check_growth_factor(double f) {
  if (!(f > 1.0)) throw InvalidInput(str("The growth factor must be > 1.0 (got ", f, ")"));
}
void check_backoff_factor(double f) {
  if (!(f < 1.0)) throw InvalidInput(str("The backoff factor must be < 1.0 (got ", f, ")"));
}
void check_growth_interval(std::int64_t n) {
  if (n < 1 || n > kInt32Max)
    throw InvalidInput(str("growth_interval must be in [1, 2^31 - 1] (got ", n, ")"));
}
void check_factors(double growth_factor, double backoff_factor, std::int64_t growth_interval) {
  check_growth_factor(growth_factor);
  check_backoff_factor(backoff_factor);
  check_growth_interval(growth_interval);
}

}  // namespace

bool unscale_grads(std::span<const TensorView> grads, float inv_scale, bool allow_fp16) {
  for (const TensorView& g : grads) require_on_cpu(g, "the loss scaler");
  if (!allow_fp16)
    for (const TensorView& g : grads)
      if (g.dtype == DType::f16) throw InvalidInput("Attempting to unscale FP16 gradients.");
  // torch computes in IEEE arithmetic: a reciprocal or product that is
  // denormal must not be flushed to zero by the caller's mode.
  const DenormalMode ieee(DenormalMode::ieee);
  bool found = false;
  for (const TensorView& g : grads) {
    const auto n = static_cast<std::size_t>(g.numel());
    dispatch_dtype(g.dtype, [&]<class T>() {
      T* p = g.as<T>();
      bool bad = false;
      if (inv_scale == 1.0f) {
        for (std::size_t i = 0; i < n; ++i) bad |= !std::isfinite(to_float(p[i]));
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          const float x = to_float(p[i]);
          bad |= !std::isfinite(x);
          p[i] = from_float<T>(x * inv_scale);
        }
      }
      found |= bad;
    });
  }
  return found;
}

void GradScaler::set_growth_factor(double f) {
  check_growth_factor(f);
  options_.growth_factor = f;
}

void GradScaler::set_backoff_factor(double f) {
  check_backoff_factor(f);
  options_.backoff_factor = f;
}

void GradScaler::set_growth_interval(std::int64_t n) {
  check_growth_interval(n);
  options_.growth_interval = n;
}

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  if (options_.enabled) check_factors(options_.growth_factor, options_.backoff_factor, options_.growth_interval);
}

float GradScaler::scale(float loss) {
  if (!options_.enabled) return loss;
  const DenormalMode ieee(DenormalMode::ieee);
  if (!initialized_) {
    scale_ = static_cast<float>(options_.init_scale);
    tracker_ = static_cast<std::int32_t>(init_tracker_);
    initialized_ = true;
  }
  return loss * scale_;
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  const DenormalMode ieee(DenormalMode::ieee);  // a denormal scale reads as itself
  return initialized_ ? static_cast<double>(scale_) : options_.init_scale;
}

std::int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled) return 0;
  return initialized_ ? tracker_ : init_tracker_;
}

void GradScaler::require_initialized(const char* what) const {
  if (!initialized_)
    throw InvalidInput(str("Attempted ", what,
                           " but _scale is None.  This may indicate your script did not use scaler.scale(loss or "
                           "outputs) earlier in the iteration."));
}

void GradScaler::unscale(Optimizer& opt, const StatReduce& reduce) {
  if (!options_.enabled) return;
  require_initialized("unscale_");
  PerOptimizer& st = per_opt_[&opt];
  if (st.stage == Stage::unscaled)
    throw InvalidInput("unscale_() has already been called on this optimizer since the last update().");
  if (st.stage == Stage::stepped) throw InvalidInput("unscale_() is being called after step().");
  // torch: self._scale.double().reciprocal().float() -- denormal, not
  // zero, for a scale above 2^126 whatever the caller's denormal mode.
  const DenormalMode ieee(DenormalMode::ieee);
  const auto inv = static_cast<float>(1.0 / static_cast<double>(scale_));
  std::vector<TensorView> grads;
  for (std::size_t i = 0; i < opt.num_params(); ++i)
    if (opt.param(i).has_grad) grads.push_back(opt.param(i).grad);
  double found = unscale_grads(grads, inv, options_.allow_fp16) ? 1.0 : 0.0;
  if (reduce) reduce(found, true);
  st.found_inf = static_cast<float>(found);
  st.stage = Stage::unscaled;
}

bool GradScaler::step(Optimizer& opt, const StatReduce& reduce) {
  if (!options_.enabled) {
    opt.step();
    return true;
  }
  require_initialized("step");
  PerOptimizer& st = per_opt_[&opt];  // map entries stay put: unscale() fills this one
  if (st.stage == Stage::stepped) throw InvalidInput("step() has already been called since the last update().");
  if (st.stage == Stage::ready) unscale(opt, reduce);
  const bool run = *st.found_inf == 0.0f;
  if (run) opt.step();
  st.stage = Stage::stepped;
  return run;
}

std::optional<bool> GradScaler::found_inf(const Optimizer& opt) const {
  const auto it = per_opt_.find(&opt);
  if (it == per_opt_.end() || !it->second.found_inf) return std::nullopt;
  return *it->second.found_inf != 0.0f;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled) return;
  require_initialized("update");
  const DenormalMode ieee(DenormalMode::ieee);
  if (new_scale) {
    scale_ = static_cast<float>(*new_scale);  // fill_
  } else {
    float found = 0;
    bool any = false;
    for (const auto& [opt, st] : per_opt_)
      if (st.found_inf) {
        found += *st.found_inf;
        any = true;
      }
    if (!any) throw InvalidInput("No inf checks were recorded prior to update.");
    // torch._amp_update_scale_ (the CUDA kernel; 2.x's CPU kernel is the same):
    // float * double products, rounded back to the float32 scale.
    if (found != 0.0f) {
      scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
      tracker_ = 0;
    } else {
      const std::int64_t successful = static_cast<std::int64_t>(tracker_) + 1;
      if (successful == options_.growth_interval) {
        const auto grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
        if (std::isfinite(grown)) scale_ = grown;
        tracker_ = 0;
      } else {
        tracker_ = static_cast<std::int32_t>(successful);
      }
    }
  }
  per_opt_.clear();
}

std::optional<GradScalerState> GradScaler::state_dict() const {
  if (!options_.enabled) return std::nullopt;
  return GradScalerState{get_scale(), options_.growth_factor, options_.backoff_factor, options_.growth_interval,
                         growth_tracker()};
}

void GradScaler::load_state_dict(const GradScalerState& s) {
  if (!options_.enabled) return;
  check_factors(s.growth_factor, s.backoff_factor, s.growth_interval);
  // A scale backed off to 0 and a tracker at or past a lowered
  // growth_interval are states torch saves and loads; negative or
  // non-finite ones are not.
  if (!std::isfinite(s.scale) || !(s.scale >= 0))
    throw InvalidInput(str("GradScaler state: scale ", s.scale, " is not a finite number >= 0"));
  if (s.growth_tracker < 0 || s.growth_tracker > kInt32Max)
    throw InvalidInput(str("GradScaler state: _growth_tracker ", s.growth_tracker, " is outside [0, 2^31 - 1]"));
  options_.init_scale = s.scale;
  options_.growth_factor = s.growth_factor;
  options_.backoff_factor = s.backoff_factor;
  options_.growth_interval = s.growth_interval;
  init_tracker_ = s.growth_tracker;
  if (initialized_) {
    scale_ = static_cast<float>(s.scale);
    tracker_ = static_cast<std::int32_t>(s.growth_tracker);
  }
}

}  // namespace distopt
