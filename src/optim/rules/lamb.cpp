// LAMB (You et al. 2020) as NVIDIA apex's FusedLAMB computes it
// (apex/optimizers/fused_lamb.py, csrc/multi_tensor_lamb.cu;
// docs/optimizers.md, "Non-pointwise rules"), in float32:
//   G = ||all gradients of all groups||  (max_grad_norm: the optimizer's own
//       option, not a group's, as apex reads self.defaults)
//   c = G / max_grad_norm if G > max_grad_norm else 1;  g <- g / c
//   L2 mode (adam_w_mode false): g <- g + wd*p
//   m <- m*b1 + b3*g  (b3 = 1 - b1 with grad_averaging, else 1)
//   v <- v*b2 + (1 - b2)*g*g
//   u = (m / bc1) / (sqrt(v / bc2) + eps)  (+ wd*p in adamw mode)
//   ratio = lr * (||p|| / ||u||) if (wd != 0 or use_nvlamb) and both norms
//           are non-zero, else lr   (||p|| taken before the update)
//   p <- p - ratio*u
// bc_k = 1 - b_k^t (1 without bias_correction) with t the group's step,
// which apex counts per group: every step() advances it, whether or not a
// parameter had a gradient (RuleInfo::group_step).
// tensor_stats: pass 0 is global (sum g^2 over every tensor); pass 1 writes
// u into the scratch and gathers sum p^2 and sum u^2 per tensor.
// Weight decay is apex's, not GradPrologue's: no maximize, L2 on the clipped
// gradient with p read as 0 when wd is 0, and in adam_w_mode wd*p added to
// u rather than p scaled by 1 - lr*wd.
#include "lamb.hpp"

#include "../rule_impl.hpp"

namespace distopt::rules {
namespace {

struct LambRule {
  static constexpr std::string_view kName = "lamb";
  static constexpr Locality kLocality = Locality::tensor_stats;
  struct Options {
    double lr, beta1, beta2, eps, weight_decay, max_grad_norm;
    bool bias_correction, adam_w_mode, grad_averaging, use_nvlamb;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-3),
      U::betas(),
      U::eps(1e-6),
      U::weight_decay(0.01, "weight decay (decoupled in adam_w_mode, else L2)"),
      {"bias_correction", true, "correct the moments' bias", &Options::bias_correction},
      {"adam_w_mode", true, "decoupled weight decay (false: L2 on the gradient)", &Options::adam_w_mode},
      {"grad_averaging", true, "scale the gradient by 1 - beta1 in the first moment", &Options::grad_averaging},
      {"max_grad_norm", 1.0, "clip the global gradient norm to this (optimizer-level, as apex)",
       &Options::max_grad_norm},
      {"use_nvlamb", false, "apply the trust ratio also without weight decay", &Options::use_nvlamb},
  };
  static void validate(const Options& o) {
    check_adam_family(o);
    require(o.max_grad_norm >= 0.0, "Invalid max_grad_norm value: ", o.max_grad_norm);
  }
  static StateLayout layout(const Options&) { return {{"exp_avg", "exp_avg_sq"}, {"step"}}; }
  using Coeffs = LambMath::Coeffs;
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    Coeffs c{};
    // apex: float hyper-parameters; bias corrections by std::pow(float, int)
    // (in double), stored as float.
    c.beta1 = static_cast<float>(o.beta1);
    c.beta2 = static_cast<float>(o.beta2);
    c.beta3 = o.grad_averaging ? 1.0f - c.beta1 : 1.0f;
    c.one_minus_beta2 = 1.0f - c.beta2;
    c.bc1 = o.bias_correction ? static_cast<float>(1.0 - std::pow(static_cast<double>(c.beta1), t)) : 1.0f;
    c.bc2 = o.bias_correction ? static_cast<float>(1.0 - std::pow(static_cast<double>(c.beta2), t)) : 1.0f;
    c.eps = static_cast<float>(o.eps);
    c.decay = static_cast<float>(o.weight_decay);
    c.lr = static_cast<float>(o.lr);
    c.max_grad_norm = static_cast<float>(o.max_grad_norm);
    c.adam_w_mode = o.adam_w_mode;
    c.adapt = o.use_nvlamb || o.weight_decay != 0.0;
    c.clip = 1.0f;
    c.ratio = c.lr;
    return c;
  }

  static constexpr int kStatPasses = 2;
  static constexpr bool kWorkspace = true;
  static constexpr bool kGroupStep = true;
  static constexpr std::string_view kOptimizerLevel[] = {"max_grad_norm", "adam_w_mode", "use_nvlamb"};
  static std::size_t num_stats(int pass, const Shape&) { return pass == 0 ? 1 : 2; }
  static bool global_pass(int pass) { return pass == 0; }

  // Pass 1: stage 1 of apex, the update direction u into the scratch.
  template <class T>
  static void transform(const Coeffs& c, int pass, const Typed<T>& s, const Slice& slice) {
    if (pass == 1) cpu_transform<LambMath>(c, pass, s, slice);
  }
  template <class T>
  static void partial(const Coeffs&, int pass, const Typed<T>& s, const Slice& slice, double* out) {
    if (pass == 0) {
      out[0] += sum_squares(s.g, s.n);
      return;
    }
    out[0] += sum_squares(s.p, s.n);
    out[1] += sum_squares(slice.work, s.n);
  }
  static void finish_pass(int pass, const Shape&, const double* stats, Coeffs& c, float*) {
    if (pass == 0) {
      const auto norm = static_cast<float>(std::sqrt(stats[0]));
      c.clip = norm > c.max_grad_norm ? norm / c.max_grad_norm : 1.0f;
      return;
    }
    if (!c.adapt) return;
    const auto param_norm = static_cast<float>(std::sqrt(stats[0]));
    const auto update_norm = static_cast<float>(std::sqrt(stats[1]));
    c.ratio = update_norm != 0.0f && param_norm != 0.0f ? c.lr * (param_norm / update_norm) : c.lr;
  }

  template <class T>
  static void apply_update(const Coeffs& c, const Typed<T>& s, const float* work) {
    cpu_update<LambMath>(c, s, work);
  }
};

}  // namespace

const RuleInfo& lamb_rule() { return rule_info_of<LambRule>(); }

}  // namespace distopt::rules
