#include "distopt/optim/clip.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cuda_step.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"

namespace distopt {
namespace {

// Calls fn(float) for every element of a gradient, whatever its dtype.
template <class Fn>
void for_each_value(const TensorView& g, Fn&& fn) {
  require_on_cpu(g, "clipping");
  const auto n = static_cast<std::size_t>(g.numel());
  dispatch_dtype(g.dtype, [&]<class T>() {
    const T* p = g.as<const T>();
    for (std::size_t i = 0; i < n; ++i) fn(to_float(p[i]));
  });
}

// Replaces every element x of a gradient by fn(x) (computed in float,
// stored back rounded to the gradient's dtype).
template <class Fn>
void transform(const TensorView& g, Fn&& fn) {
  require_on_cpu(g, "clipping");
  const auto n = static_cast<std::size_t>(g.numel());
  dispatch_dtype(g.dtype, [&]<class T>() {
    T* p = g.as<T>();
    for (std::size_t i = 0; i < n; ++i) p[i] = from_float<T>(fn(to_float(p[i])));
  });
}

// The gradients of an optimizer's parameters that have one. Device
// gradients are clipped on the calling thread's stream: a caller's stream
// the optimizer steps on (torch's current one) is waited for first.
std::vector<TensorView> grads_of(Optimizer& opt) {
  std::vector<TensorView> out;
  for (std::size_t i = 0; i < opt.num_params(); ++i)
    if (opt.param(i).has_grad) out.push_back(opt.param(i).grad);
  if (opt.cuda_stream() &&
      std::any_of(out.begin(), out.end(), [](const TensorView& g) { return g.device == Device::cuda; }))
    synchronize_stream(*opt.cuda_stream());
  return out;
}

void check_norm_type(double p) {
  if (!(p > 0)) throw InvalidInput(str("norm_type must be positive (or inf), got ", p));
}

// The gradients on the CPU and those on the device (src/cuda/clip.cu runs
// the latter; with none usable, one line says why before anything is read).
struct ByDevice {
  std::vector<TensorView> cpu, cuda;
  explicit ByDevice(std::span<const TensorView> grads) {
    for (const TensorView& g : grads) (g.device == Device::cpu ? cpu : cuda).push_back(g);
    if (!cuda.empty()) require_device(Device::cuda, "clipping on cuda");
  }
};

double cpu_norm_partial(std::span<const TensorView> grads, double norm_type);

}  // namespace

double grad_norm_partial(std::span<const TensorView> grads, double norm_type) {
  check_norm_type(norm_type);
  const ByDevice split(grads);
  const double host = cpu_norm_partial(split.cpu, norm_type);
  if (split.cuda.empty()) return host;
  const double device = cuda::grad_norm_partial(split.cuda, norm_type);
  if (!std::isinf(norm_type)) return host + device;
  return std::isnan(host) || std::isnan(device) ? std::numeric_limits<double>::quiet_NaN() : std::max(host, device);
}

namespace {
double cpu_norm_partial(std::span<const TensorView> grads, double norm_type) {
  if (std::isinf(norm_type)) {
    double m = 0;
    bool nan = false;
    for (const TensorView& g : grads)
      for_each_value(g, [&](float x) {
        if (std::isnan(x)) nan = true;
        m = std::max(m, static_cast<double>(std::abs(x)));
      });
    return nan ? std::numeric_limits<double>::quiet_NaN() : m;
  }
  double s = 0;
  if (norm_type == 2) {
    for (const TensorView& g : grads) for_each_value(g, [&](float x) { s += static_cast<double>(x) * x; });
  } else if (norm_type == 1) {
    for (const TensorView& g : grads) for_each_value(g, [&](float x) { s += std::abs(static_cast<double>(x)); });
  } else {
    for (const TensorView& g : grads)
      for_each_value(g, [&](float x) { s += std::pow(std::abs(static_cast<double>(x)), norm_type); });
  }
  return s;
}
}  // namespace

double finish_grad_norm(double partial, double norm_type) {
  check_norm_type(norm_type);
  if (std::isinf(norm_type) || norm_type == 1) return partial;
  if (norm_type == 2) return std::sqrt(partial);
  return std::pow(partial, 1.0 / norm_type);
}

double clip_grad_norm(std::span<const TensorView> grads, double max_norm, double norm_type, bool error_if_nonfinite,
                      const StatReduce& reduce) {
  return clip_grad_norm(grads, grads, max_norm, norm_type, error_if_nonfinite, reduce);
}

double clip_grad_norm(std::span<const TensorView> owned, std::span<const TensorView> grads, double max_norm,
                      double norm_type, bool error_if_nonfinite, const StatReduce& reduce) {
  check_norm_type(norm_type);
  if (!std::isfinite(max_norm)) throw InvalidInput(str("max_norm must be finite, got ", max_norm));
  double partial = grad_norm_partial(owned, norm_type);
  if (reduce) reduce(partial, std::isinf(norm_type));
  else if (owned.empty()) return 0.0;
  // Torch holds the norm in a float32 tensor and computes the coefficient
  // with float32 tensor ops: (total + 1e-6).reciprocal() * max_norm, at most 1.
  const auto total = static_cast<float>(finish_grad_norm(partial, norm_type));
  if (error_if_nonfinite && !std::isfinite(total))
    throw InvalidInput(str("The total norm of order ", norm_type,
                           " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`"));
  const float denom = total + static_cast<float>(1e-6);
  float coef = (1.0f / denom) * static_cast<float>(max_norm);
  if (!(coef <= 1.0f) && !std::isnan(coef)) coef = 1.0f;  // clamp(max=1) keeps NaN
  const ByDevice split(grads);
  for (const TensorView& g : split.cpu) transform(g, [coef](float x) { return x * coef; });
  if (!split.cuda.empty()) cuda::scale_grads(split.cuda, coef);
  return total;
}

double clip_grad_norm(Optimizer& opt, double max_norm, double norm_type, bool error_if_nonfinite,
                      const StatReduce& reduce) {
  const auto grads = grads_of(opt);
  return clip_grad_norm(grads, max_norm, norm_type, error_if_nonfinite, reduce);
}

double clip_grad_norm(Optimizer& opt, std::span<const TensorView> owned, double max_norm, double norm_type,
                      bool error_if_nonfinite, const StatReduce& reduce) {
  const auto grads = grads_of(opt);
  return clip_grad_norm(owned, grads, max_norm, norm_type, error_if_nonfinite, reduce);
}

void clip_grad_value(std::span<const TensorView> grads, double clip_value) {
  if (std::isnan(clip_value)) throw InvalidInput("clip_value must not be NaN");
  const auto v = static_cast<float>(clip_value);
  const ByDevice split(grads);
  for (const TensorView& g : split.cpu)
    transform(g, [v](float x) { return std::isnan(x) ? x : std::min(std::max(x, -v), v); });
  if (!split.cuda.empty()) cuda::clamp_grads(split.cuda, v);
}

void clip_grad_value(Optimizer& opt, double clip_value) {
  const auto grads = grads_of(opt);
  clip_grad_value(grads, clip_value);
}

}  // namespace distopt
