// Averaged SGD (Polyak & Juditsky 1992; torch.optim.ASGD;
// docs/optimizers.md, "Pointwise rules"):
//   g <- -g if maximize;  g <- g + wd*p
//   p <- p*(1 - lambd*eta);  p <- p - eta*g
//   ax <- ax + (p - ax)*mu if mu != 1, else ax <- p
//   eta <- lr / (1 + lambd*lr*t)^alpha;  mu <- 1/max(1, t - t0)
// eta and mu are float32 state re-rounded every step, as in torch.
// Pointwise.
#include <algorithm>

#include "../rule_impl.hpp"
#include "asgd.hpp"

namespace distopt::rules {
namespace {

struct AsgdRule : AsgdMath {
  static constexpr std::string_view kName = "asgd";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, lambd, alpha, t0, weight_decay;
    bool maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-2),
      {"lambd", 1e-4, "decay term", &Options::lambd},
      {"alpha", 0.75, "power for the eta update", &Options::alpha},
      {"t0", 1e6, "step at which averaging starts", &Options::t0},
      U::weight_decay(),
      U::maximize(),
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options&) { return {{"ax"}, {"step", "eta", "mu"}}; }
  static void init(const Options& o, float* fill, float* scalars) {
    fill[0] = 0.0f;
    scalars[0] = 0.0f;
    scalars[1] = static_cast<float>(o.lr);
    scalars[2] = 1.0f;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    const double eta = scalars[1];
    const double mu = scalars[2];
    Coeffs c{};
    c.pro = GradPrologue::l2_decay(o.maximize, o.weight_decay);
    c.decay = static_cast<float>(1.0 - o.lambd * eta);
    c.neg_eta = static_cast<float>(-eta);
    c.mu = static_cast<float>(mu);
    c.average = mu != 1.0;
    scalars[1] = static_cast<float>(o.lr / std::pow(1.0 + o.lambd * o.lr * t, o.alpha));
    scalars[2] = static_cast<float>(1.0 / std::max(1.0, t - o.t0));
    return c;
  }
};

}  // namespace

const RuleInfo& asgd_rule() { return rule_info_of<AsgdRule>(); }

}  // namespace distopt::rules
