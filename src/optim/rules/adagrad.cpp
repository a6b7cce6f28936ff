// Adagrad, diagonal (Duchi et al. 2011; torch.optim.Adagrad;
// docs/optimizers.md, "Pointwise rules"):
//   g <- -g if maximize;  g <- g + wd*p
//   clr = lr / (1 + (t-1)*lr_decay)
//   S <- S + g*g;   p <- p - clr * g / (sqrt(S) + eps)
// Pointwise (element i reads only its own accumulator). Like torch, the
// state exists from construction: sum = initial_accumulator_value, step = 0.
#include "../rule_impl.hpp"
#include "adagrad.hpp"

namespace distopt::rules {
namespace {

struct AdagradRule : AdagradMath {
  static constexpr std::string_view kName = "adagrad";
  static constexpr Locality kLocality = Locality::pointwise;
  static constexpr bool kEagerState = true;
  struct Options {
    double lr, lr_decay, weight_decay, initial_accumulator_value, eps;
    bool maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-2),
      {"lr_decay", 0.0, "learning-rate decay per step", &Options::lr_decay},
      U::weight_decay(),
      {"initial_accumulator_value", 0.0, "initial value of the sum of squares", &Options::initial_accumulator_value},
      U::eps(1e-10),
      U::maximize(),
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    require(o.lr_decay >= 0.0, "Invalid lr_decay value: ", o.lr_decay);
    check_weight_decay(o.weight_decay);
    require(o.initial_accumulator_value >= 0.0, "Invalid initial_accumulator_value value: ",
            o.initial_accumulator_value);
    check_eps(o.eps);
  }
  static StateLayout layout(const Options&) { return {{"sum"}, {"step"}}; }
  static void init(const Options& o, float* fill, float* scalars) {
    fill[0] = static_cast<float>(o.initial_accumulator_value);
    scalars[0] = 0.0f;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    Coeffs c{};
    c.pro = GradPrologue::l2_decay(o.maximize, o.weight_decay);
    c.eps = static_cast<float>(o.eps);
    c.neg_clr = static_cast<float>(-(o.lr / (1.0 + (t - 1.0) * o.lr_decay)));
    return c;
  }
};

}  // namespace

const RuleInfo& adagrad_rule() { return rule_info_of<AdagradRule>(); }

}  // namespace distopt::rules
