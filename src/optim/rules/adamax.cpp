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
  static constexpr bool kEagerState = false;
  static constexpr OptionSpec kOptions[] = {
      {"lr", 2e-3, "learning rate"},
      {"betas", OptionValue(0.9, 0.999), "decay rates of the moment and of the infinity norm"},
      {"eps", 1e-8, "added to |g| before the maximum"},
      {"weight_decay", 0.0, "L2 penalty"},
      {"maximize", false, "maximize the objective"},
  };
  struct Options {
    double lr, beta1, beta2, eps, weight_decay;
    bool maximize;
  };
  static Options parse(const OptionMap& m) {
    const auto b = pair(m, "betas");
    return {num(m, "lr"), b[0], b[1], num(m, "eps"), num(m, "weight_decay"), flag(m, "maximize")};
  }
  static void validate(const Options& o) {
    check_lr(o.lr);
    check_eps(o.eps);
    check_betas({o.beta1, o.beta2});
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options&) { return {{"exp_avg", "exp_inf"}, {"step"}}; }
  static void init(const Options&, float* fill, float* scalars) {
    fill[0] = fill[1] = 0.0f;
    scalars[0] = 0.0f;
  }
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
