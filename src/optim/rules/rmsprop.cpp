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
  static constexpr bool kEagerState = false;
  static constexpr OptionSpec kOptions[] = {
      {"lr", 1e-2, "learning rate"},
      {"alpha", 0.99, "smoothing constant"},
      {"eps", 1e-8, "added to the denominator"},
      {"weight_decay", 0.0, "L2 penalty"},
      {"momentum", 0.0, "momentum factor"},
      {"centered", false, "normalize by an estimate of the variance"},
      {"maximize", false, "maximize the objective"},
  };
  struct Options {
    double lr, alpha, eps, weight_decay, momentum;
    bool centered, maximize;
  };
  static Options parse(const OptionMap& m) {
    return {num(m, "lr"),       num(m, "alpha"),     num(m, "eps"),      num(m, "weight_decay"),
            num(m, "momentum"), flag(m, "centered"), flag(m, "maximize")};
  }
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
  static void init(const Options&, float* fill, float* scalars) {
    fill[0] = fill[1] = fill[2] = 0.0f;
    scalars[0] = 0.0f;
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
