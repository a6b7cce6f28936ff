// RMSprop (Hinton's lecture 6e; centered form of Graves 2013;
// torch.optim.RMSprop; docs/optimizers.md, "Pointwise rules"):
//   g <- -g if maximize;  g <- g + wd*p
//   v <- v*a + (1-a)*g*g
//   centered: gbar <- gbar*a + (1-a)*g;  avg = sqrt(v - gbar*gbar)   else avg = sqrt(v)
//   avg <- avg + eps
//   momentum > 0: b <- b*mom + g/avg;  p <- p - lr*b     else p <- p - lr*g/avg
// Pointwise. Buffers start at zero.
#include "../rule_impl.hpp"
#include "rmsprop.hpp"

namespace distopt::rules {
namespace {

struct RmspropRule : RmspropMath {
  static constexpr std::string_view kName = "rmsprop";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, alpha, eps, weight_decay, momentum;
    bool centered, maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-2),   {"alpha", 0.99, "smoothing constant", &Options::alpha},
      U::eps(1e-8),  U::weight_decay(),
      U::momentum(), {"centered", false, "normalize by an estimate of the variance", &Options::centered},
      U::maximize(),
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    check_eps(o.eps);
    require(o.momentum >= 0.0, "Invalid momentum value: ", o.momentum);
    check_weight_decay(o.weight_decay);
    require(o.alpha >= 0.0, "Invalid alpha value: ", o.alpha);
  }
  static StateLayout layout(const Options& o) {
    StateLayout l{{"square_avg"}, {"step"}};
    if (o.momentum > 0.0) l.tensors.push_back("momentum_buffer");
    if (o.centered) l.tensors.push_back("grad_avg");
    return l;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    scalars[0] += 1.0f;
    Coeffs c{};
    c.pro = GradPrologue::l2_decay(o.maximize, o.weight_decay);
    c.alpha = static_cast<float>(o.alpha);
    c.one_minus_alpha = static_cast<float>(1.0 - o.alpha);
    c.eps = static_cast<float>(o.eps);
    c.momentum = static_cast<float>(o.momentum);
    c.neg_lr = static_cast<float>(-o.lr);
    c.centered = o.centered;
    c.has_momentum = o.momentum > 0.0;
    return c;
  }
};

}  // namespace

const RuleInfo& rmsprop_rule() { return rule_info_of<RmspropRule>(); }

}  // namespace distopt::rules
