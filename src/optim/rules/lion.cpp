// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
// Algorithm 2; not in torch.optim -- tested against an independent
// reference in tests/):
//   g <- -g if maximize
//   p <- p*(1 - lr*wd)
//   c = m*b1 + (1-b1)*g;   p <- p - lr*sign(c)
//   m <- m*b2 + (1-b2)*g
// Defaults of the paper's reference code: lr 1e-4, betas (0.9, 0.99), wd 0.
// Pointwise. No `step` state.
#include "../rule_impl.hpp"
#include "lion.hpp"

namespace distopt::rules {
namespace {

struct LionRule : LionMath {
  static constexpr std::string_view kName = "lion";
  static constexpr Locality kLocality = Locality::pointwise;
  static constexpr QuantSign kQuantized[] = {QuantSign::is_signed};
  struct Options {
    double lr, beta1, beta2, weight_decay;
    bool maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-4),
      U::betas(0.9, 0.99, "interpolation for the update (b1) and the moment (b2)"),
      U::weight_decay(0.0, "decoupled weight decay"),
      U::maximize(),
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    check_betas({o.beta1, o.beta2});
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options&) { return {{"exp_avg"}, {}}; }
  static Coeffs prepare(const Options& o, float*, bool) {
    return {GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, /*decoupled=*/true, o.lr),
            static_cast<float>(o.beta1),
            static_cast<float>(1.0 - o.beta1),
            static_cast<float>(o.beta2),
            static_cast<float>(1.0 - o.beta2),
            static_cast<float>(-o.lr)};
  }
};

}  // namespace

const RuleInfo& lion_rule() { return rule_info_of<LionRule>(); }

}  // namespace distopt::rules
