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
  static constexpr bool kEagerState = false;
  static constexpr OptionSpec kOptions[] = {
      {"lr", 1e-3, "learning rate"},
      {"momentum", 0.0, "momentum factor"},
      {"dampening", 0.0, "dampening of the momentum"},
      {"weight_decay", 0.0, "L2 penalty"},
      {"nesterov", false, "Nesterov momentum"},
      {"maximize", false, "maximize the objective"},
  };
  struct Options {
    double lr, momentum, dampening, weight_decay;
    bool nesterov, maximize;
  };
  static Options parse(const OptionMap& m) {
    return {num(m, "lr"),           num(m, "momentum"),  num(m, "dampening"),
            num(m, "weight_decay"), flag(m, "nesterov"), flag(m, "maximize")};
  }
  static void validate(const Options& o) {
    check_lr(o.lr);
    require(o.momentum >= 0.0, "Invalid momentum value: ", o.momentum);
    check_weight_decay(o.weight_decay);
    require(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
            "Nesterov momentum requires a momentum and zero dampening");
  }
  static StateLayout layout(const Options& o) {
    StateLayout l;
    if (o.momentum != 0.0) l.tensors.push_back("momentum_buffer");
    return l;
  }
  static void init(const Options&, float* fill, float*) { fill[0] = 0.0f; }
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
