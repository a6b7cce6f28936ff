// Rprop (Riedmiller & Braun 1993; torch.optim.Rprop; docs/optimizers.md,
// "Pointwise rules"):
//   g <- -g if maximize
//   s = sign(g*prev) mapped to eta+ (s>0), eta- (s<0), 1 (s=0)
//   step_size <- clamp(step_size*s, step_min, step_max)
//   g' = 0 where s == eta-, else g
//   p <- p - sign(g')*step_size;   prev <- g'
// Pointwise. step_size starts at lr, prev at zero. No weight decay.
#include <algorithm>

#include "../rule_impl.hpp"
#include "rprop.hpp"

namespace distopt::rules {
namespace {

struct RpropRule : RpropMath {
  static constexpr std::string_view kName = "rprop";
  static constexpr Locality kLocality = Locality::pointwise;
  struct Options {
    double lr, eta_minus, eta_plus, step_min, step_max;
    bool maximize;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-2, "initial step size"),
      {"etas", OptionValue(0.5, 1.2), "(eta-, eta+): step-size factors", &Options::eta_minus, &Options::eta_plus},
      {"step_sizes", OptionValue(1e-6, 50.0), "(min, max) step size", &Options::step_min, &Options::step_max},
      U::maximize(),
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    require(0.0 < o.eta_minus && o.eta_minus < 1.0 && 1.0 < o.eta_plus, "Invalid eta values: ", o.eta_minus,
            ", ", o.eta_plus);
  }
  static StateLayout layout(const Options&) { return {{"prev", "step_size"}, {"step"}}; }
  static void init(const Options& o, float* fill, float* scalars) {
    fill[0] = 0.0f;
    fill[1] = static_cast<float>(o.lr);
    scalars[0] = 0.0f;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    scalars[0] += 1.0f;
    return {GradPrologue::l2_decay(o.maximize, 0.0), static_cast<float>(o.eta_minus), static_cast<float>(o.eta_plus),
            static_cast<float>(o.step_min), static_cast<float>(o.step_max)};
  }
};

}  // namespace

const RuleInfo& rprop_rule() { return rule_info_of<RpropRule>(); }

}  // namespace distopt::rules
