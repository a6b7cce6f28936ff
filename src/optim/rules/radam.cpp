// RAdam (Liu et al. 2020; torch.optim.RAdam; docs/optimizers.md, "Pointwise
// rules"):
//   g <- -g if maximize;  L2: g <- g + wd*p  |  decoupled: p <- p*(1 - lr*wd)
//   m <- m*b1 + (1-b1)*g;  v <- v*b2 + (1-b2)*g*g;  mhat = m/bc1
//   rho_inf = 2/(1-b2) - 1;  rho_t = rho_inf - 2t*b2^t/bc2
//   rho_t > 5:  r = sqrt((rho_t-4)(rho_t-2)rho_inf / ((rho_inf-4)(rho_inf-2)rho_t))
//               p <- p - mhat*lr * (sqrt(bc2) * 1/(sqrt(v)+eps)) * r
//   otherwise:  p <- p - mhat*lr
// The rectification is per step (host), so the rule is pointwise.
// decoupled_weight_decay and maximize follow torch 2.x (1.13 lacks them).
#include "../rule_impl.hpp"
#include "radam.hpp"

namespace distopt::rules {
namespace {

struct RadamRule : RadamMath {
  static constexpr std::string_view kName = "radam";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, beta1, beta2, eps, weight_decay;
    bool decoupled, maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-3),
      U::betas(),
      U::eps(1e-8),
      U::weight_decay(0.0, "weight decay (L2 unless decoupled)"),
      U::decoupled_weight_decay(),
      U::maximize("maximize the objective (torch 2.x)"),
  };
  static void validate(const Options& o) { check_adam_family(o); }
  static StateLayout layout(const Options&) { return {{"exp_avg", "exp_avg_sq"}, {"step"}}; }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    const double bc1 = 1.0 - std::pow(o.beta1, t);
    const double bc2 = 1.0 - std::pow(o.beta2, t);
    const double rho_inf = 2.0 / (1.0 - o.beta2) - 1.0;
    const double rho_t = rho_inf - 2.0 * t * std::pow(o.beta2, t) / bc2;
    Coeffs c{};
    c.pro = GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, o.decoupled, o.lr);
    c.mom = Moments::of(o.beta1, o.beta2);
    c.bc1 = static_cast<float>(bc1);
    c.lr = static_cast<float>(o.lr);
    c.eps = static_cast<float>(o.eps);
    c.rectified = rho_t > 5.0;
    if (c.rectified) {
      c.rect =
          static_cast<float>(std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)));
      c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    }
    return c;
  }
};

}  // namespace

const RuleInfo& radam_rule() { return rule_info_of<RadamRule>(); }

}  // namespace distopt::rules
