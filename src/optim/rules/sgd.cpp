// SGD with momentum, dampening, Nesterov momentum and L2 weight decay
// (torch.optim.SGD; docs/optimizers.md, "Pointwise rules"):
//   g <- -g if maximize;  g <- g + wd*p
//   momentum != 0:  b <- g on the parameter's first step, else b <- b*mu + (1-damp)*g
//                   g <- g + mu*b (nesterov) or g <- b
//   p <- p - lr*g
// Pointwise. No `step` state, as in torch.
#include "../rule_impl.hpp"
#include "sgd.hpp"

namespace distopt::rules {
namespace {

struct SgdRule : SgdMath {
  static constexpr std::string_view kName = "sgd";
  static constexpr Locality kLocality = Locality::pointwise;
  static constexpr QuantSign kQuantized[] = {QuantSign::is_signed};
  struct Options {
    double lr, momentum, dampening, weight_decay;
    bool nesterov, maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-3), U::momentum(), U::dampening(), U::weight_decay(), U::nesterov(), U::maximize(),
  };
  static void validate(const Options& o) { check_sgd_family(o); }
  static StateLayout layout(const Options& o) { return momentum_layout(o.momentum); }
  static Coeffs prepare(const Options& o, float*, bool fresh) {
    Coeffs c{};
    c.pro = GradPrologue::l2_decay(o.maximize, o.weight_decay);
    c.has_momentum = o.momentum != 0.0;
    c.momentum = static_cast<float>(o.momentum);
    c.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
    c.neg_lr = static_cast<float>(-o.lr);
    c.first = fresh;
    c.nesterov = o.nesterov;
    return c;
  }
};

}  // namespace

const RuleInfo& sgd_rule() { return rule_info_of<SgdRule>(); }

}  // namespace distopt::rules
