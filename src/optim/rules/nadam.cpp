// NAdam (Dozat 2016; torch.optim.NAdam; docs/optimizers.md, "Pointwise
// rules"):
//   g <- -g if maximize;  L2: g <- g + wd*p  |  decoupled: p <- p*(1 - lr*wd)
//   mu_t = b1*(1 - 0.5*0.96^(t*psi)),  mu_t+1 likewise
//   P_t <- P_{t-1}*mu_t            (mu_product, a float32 re-rounded every step)
//   m <- m*b1 + (1-b1)*g;  v <- v*b2 + (1-b2)*g*g;  denom = sqrt(v/bc2) + eps
//   p <- p - lr*(1-mu_t)/(1-P_t) * g/denom
//   p <- p - lr*mu_t+1/(1-Pn) * m/denom
// Pn is torch 1.13's `mu_product * mu * mu_next` (float32 products). torch
// 2.x computes P_t * mu_t+1 instead; where the two differ the golden files
// (torch 1.13) decide (docs/optimizers.md, "Where torch 1.13 and torch 2.x
// differ", which records this difference).
// decoupled_weight_decay and maximize follow torch 2.x (1.13 lacks them).
// Pointwise.
#include "../rule_impl.hpp"
#include "nadam.hpp"

namespace distopt::rules {
namespace {

struct NadamRule : NadamMath {
  static constexpr std::string_view kName = "nadam";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, beta1, beta2, eps, weight_decay, momentum_decay;
    bool decoupled, maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(2e-3),
      U::betas(),
      U::eps(1e-8),
      U::weight_decay(0.0, "weight decay (L2 unless decoupled)"),
      {"momentum_decay", 4e-3, "psi, the momentum schedule's decay", &Options::momentum_decay},
      U::decoupled_weight_decay(),
      U::maximize("maximize the objective (torch 2.x)"),
  };
  static void validate(const Options& o) {
    check_adam_family(o);
    require(o.momentum_decay >= 0.0, "Invalid momentum_decay value: ", o.momentum_decay);
  }
  static StateLayout layout(const Options&) { return {{"exp_avg", "exp_avg_sq"}, {"step", "mu_product"}}; }
  static void init(const Options&, float* fill, float* scalars) {
    fill[0] = fill[1] = 0.0f;
    scalars[0] = 0.0f;
    scalars[1] = 1.0f;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    const double bc2 = 1.0 - std::pow(o.beta2, t);
    const double mu = o.beta1 * (1.0 - 0.5 * std::pow(0.96, t * o.momentum_decay));
    const double mu_next = o.beta1 * (1.0 - 0.5 * std::pow(0.96, (t + 1.0) * o.momentum_decay));
    const float mu_product = scalars[1] * static_cast<float>(mu);
    scalars[1] = mu_product;
    const float mu_product_next = mu_product * static_cast<float>(mu) * static_cast<float>(mu_next);
    Coeffs c{};
    c.pro = GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, o.decoupled, o.lr);
    c.mom = Moments::of(o.beta1, o.beta2);
    c.bc2 = static_cast<float>(bc2);
    c.eps = static_cast<float>(o.eps);
    c.coef_grad = static_cast<float>(-o.lr * (1.0 - mu) / (1.0 - static_cast<double>(mu_product)));
    c.coef_avg = static_cast<float>(-o.lr * mu_next / (1.0 - static_cast<double>(mu_product_next)));
    return c;
  }
};

}  // namespace

const RuleInfo& nadam_rule() { return rule_info_of<NadamRule>(); }

}  // namespace distopt::rules
