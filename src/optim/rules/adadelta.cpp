// Adadelta (Zeiler 2012; torch.optim.Adadelta; docs/optimizers.md,
// "Pointwise rules"):
//   g <- -g if maximize;  g <- g + wd*p
//   v <- v*rho + (1-rho)*g*g
//   d <- sqrt(u + eps) / sqrt(v + eps) * g
//   u <- u*rho + (1-rho)*d*d
//   p <- p - lr*d
// Pointwise. eps sits inside both square roots.
#include "../rule_impl.hpp"
#include "adadelta.hpp"

namespace distopt::rules {
namespace {

struct AdadeltaRule : AdadeltaMath {
  static constexpr std::string_view kName = "adadelta";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, rho, eps, weight_decay;
    bool maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1.0, "scale of the update"),
      {"rho", 0.9, "decay rate of the running averages", &Options::rho},
      U::eps(1e-6, "added inside the square roots"),
      U::weight_decay(),
      U::maximize(),
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    require(0.0 <= o.rho && o.rho <= 1.0, "Invalid rho value: ", o.rho);
    check_eps(o.eps);
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options&) { return {{"square_avg", "acc_delta"}, {"step"}}; }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    scalars[0] += 1.0f;
    Coeffs c{};
    c.pro = GradPrologue::l2_decay(o.maximize, o.weight_decay);
    c.rho = static_cast<float>(o.rho);
    c.one_minus_rho = static_cast<float>(1.0 - o.rho);
    c.eps = static_cast<float>(o.eps);
    c.neg_lr = static_cast<float>(-o.lr);
    return c;
  }
};

}  // namespace

const RuleInfo& adadelta_rule() { return rule_info_of<AdadeltaRule>(); }

}  // namespace distopt::rules
