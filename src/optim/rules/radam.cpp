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
  static constexpr bool kEagerState = false;
  static constexpr OptionSpec kOptions[] = {
      {"lr", 1e-3, "learning rate"},
      {"betas", OptionValue(0.9, 0.999), "decay rates of the first and second moments"},
      {"eps", 1e-8, "added to the denominator"},
      {"weight_decay", 0.0, "weight decay (L2 unless decoupled)"},
      {"decoupled_weight_decay", false, "AdamW-style decoupled weight decay (torch 2.x)"},
      {"maximize", false, "maximize the objective (torch 2.x)"},
  };
  struct Options {
    double lr, beta1, beta2, eps, weight_decay;
    bool decoupled, maximize;
  };
  static Options parse(const OptionMap& m) {
    const auto b = pair(m, "betas");
    return {num(m, "lr"), b[0], b[1], num(m, "eps"), num(m, "weight_decay"), flag(m, "decoupled_weight_decay"),
            flag(m, "maximize")};
  }
  static void validate(const Options& o) {
    check_lr(o.lr);
    check_eps(o.eps);
    check_betas({o.beta1, o.beta2});
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options&) { return {{"exp_avg", "exp_avg_sq"}, {"step"}}; }
  static void init(const Options&, float* fill, float* scalars) {
    fill[0] = fill[1] = 0.0f;
    scalars[0] = 0.0f;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    const double bc1 = 1.0 - std::pow(o.beta1, t);
    const double bc2 = 1.0 - std::pow(o.beta2, t);
    const double rho_inf = 2.0 / (1.0 - o.beta2) - 1.0;
    const double rho_t = rho_inf - 2.0 * t * std::pow(o.beta2, t) / bc2;
    Coeffs c{};
    c.pro = GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, o.decoupled, o.lr);
    c.beta1 = static_cast<float>(o.beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
    c.beta2 = static_cast<float>(o.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
    c.bc1 = static_cast<float>(bc1);
    c.lr = static_cast<float>(o.lr);
    c.eps = static_cast<float>(o.eps);
    c.rectified = rho_t > 5.0;
    if (c.rectified) {
      c.rect = static_cast<float>(
          std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)));
      c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    }
    return c;
  }
};

}  // namespace

const RuleInfo& radam_rule() { return rule_info_of<RadamRule>(); }

}  // namespace distopt::rules
