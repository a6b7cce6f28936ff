// Adamax (Kingma & Ba 2015, §7; torch.optim.Adamax; docs/optimizers.md,
// "Pointwise rules"):
//   g <- -g if maximize;  g <- g + wd*p
//   m <- m*b1 + (1-b1)*g;  u <- max(u*b2, |g| + eps)
//   p <- p - (lr / (1 - b1^t)) * m / u
// Pointwise.
#include <algorithm>

#include "../rule_impl.hpp"
#include "adamax.hpp"

namespace distopt::rules {
namespace {

struct AdamaxRule : AdamaxMath {
  static constexpr std::string_view kName = "adamax";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, beta1, beta2, eps, weight_decay;
    bool maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(2e-3),
      U::betas(0.9, 0.999, "decay rates of the moment and of the infinity norm"),
      U::eps(1e-8, "added to |g| before the maximum"),
      U::weight_decay(),
      U::maximize(),
  };
  static void validate(const Options& o) { check_adam_family(o); }
  static StateLayout layout(const Options&) { return {{"exp_avg", "exp_inf"}, {"step"}}; }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    Coeffs c{};
    c.pro = GradPrologue::l2_decay(o.maximize, o.weight_decay);
    c.beta1 = static_cast<float>(o.beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
    c.beta2 = static_cast<float>(o.beta2);
    c.eps = static_cast<float>(o.eps);
    c.neg_clr = static_cast<float>(-(o.lr / (1.0 - std::pow(o.beta1, t))));
    return c;
  }
};

}  // namespace

const RuleInfo& adamax_rule() { return rule_info_of<AdamaxRule>(); }

}  // namespace distopt::rules
