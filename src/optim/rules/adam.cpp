// Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), as
// torch.optim.Adam / AdamW compute them on the CPU single-tensor path
// (docs/optimizers.md, "Pointwise rules"; torch 1.13's rounding,
// m = m*b1 + (1-b1)*g: "Where torch 1.13 and torch 2.x differ").
//   g  <- -g if maximize;  L2: g <- g + wd*p   |  decoupled: p <- p*(1 - lr*wd)
//   m  <- m*b1 + (1-b1)*g;  v <- v*b2 + (1-b2)*g*g;  amsgrad: vmax <- max(vmax, v)
//   p  <- p - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps),  bc_k = 1 - b_k^t
// AdamW is Adam with decoupled weight decay forced on and weight_decay 1e-2.
// Pointwise. Bias corrections are computed once per step in double.
#include <algorithm>

#include "../rule_impl.hpp"
#include "adam.hpp"

namespace distopt::rules {
namespace {

template <bool kAdamW>
struct AdamRule : AdamMath {
  static constexpr std::string_view kName = kAdamW ? "adamw" : "adam";
  static constexpr Locality kLocality = Locality::pointwise;
  static constexpr QuantSign kQuantized[] = {QuantSign::is_signed, QuantSign::non_negative, QuantSign::non_negative};
  struct Options {
    double lr, beta1, beta2, eps, weight_decay;
    bool amsgrad, maximize, decoupled;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-3),
      U::betas(),
      U::eps(1e-8),
      U::weight_decay(kAdamW ? 1e-2 : 0.0, "weight decay (L2 for adam, decoupled for adamw)"),
      {"amsgrad", false, "use the maximum of past second moments", &Options::amsgrad},
      U::maximize(),
      U::decoupled_weight_decay(kAdamW, "decoupled (AdamW) weight decay; always on for adamw"),
  };
  static void validate(const Options& o) { check_adam_family(o); }
  static StateLayout layout(const Options& o) {
    StateLayout l{{"exp_avg", "exp_avg_sq"}, {"step"}};
    if (o.amsgrad) l.tensors.push_back("max_exp_avg_sq");
    return l;
  }
  // 1-bit Adam (RuleInfo::moment): the rank's own moment, and the step that
  // takes the ranks' averaged moment in the gradient's place, the variance
  // (and its bias correction) as after the warm-up's `frozen_at` steps.
  static constexpr std::string_view kMomentState = "exp_avg";
  static void local_moment(const Options& o, const float* m, const float* g, const float* p, float* out,
                           std::size_t n) {
    const GradPrologue pro = GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, kAdamW || o.decoupled, o.lr);
    const Moments mom = Moments::of(o.beta1, o.beta2);
    for (std::size_t i = 0; i < n; ++i) {
      const float gi = pro.l2 ? pro.grad(std::true_type{}, g[i], p[i]) : pro.grad(g[i]);
      out[i] = m[i] * mom.beta1 + mom.one_minus_beta1 * gi;
    }
  }
  static std::string_view variance_state(const Options& o) { return o.amsgrad ? "max_exp_avg_sq" : "exp_avg_sq"; }
  static float frozen_bc2_sqrt(const Options& o, std::uint64_t frozen_at) {
    return static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(frozen_at))));
  }
  static void frozen_denominator(const Options& o, const float* v, std::uint64_t frozen_at, float* out, std::size_t n) {
    const float bc2_sqrt = frozen_bc2_sqrt(o, frozen_at), eps = static_cast<float>(o.eps);
    for (std::size_t i = 0; i < n; ++i) out[i] = std::sqrt(v[i]) / bc2_sqrt + eps;
  }
  static Coeffs prepare_frozen(const Options& o, float* scalars, std::uint64_t frozen_at) {
    Coeffs c = prepare(o, scalars, false);
    c.pro = GradPrologue::l2_or_decoupled(false, o.weight_decay, kAdamW || o.decoupled, o.lr);
    c.pro.l2 = false;                  // the local moments took the L2 term
    c.mom = {0.0f, 1.0f, 1.0f, 0.0f};  // m <- 0*m + 1*average; v <- 1*v + 0*g*g
    c.bc2_sqrt = frozen_bc2_sqrt(o, frozen_at);
    return c;
  }
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    const double bc1 = 1.0 - std::pow(o.beta1, t);
    const double bc2 = 1.0 - std::pow(o.beta2, t);
    Coeffs c{};
    c.pro = GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, kAdamW || o.decoupled, o.lr);
    c.mom = Moments::of(o.beta1, o.beta2);
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.eps = static_cast<float>(o.eps);
    c.neg_step_size = static_cast<float>(-(o.lr / bc1));
    c.amsgrad = o.amsgrad;
    return c;
  }
};

}  // namespace

const RuleInfo& adam_rule() { return rule_info_of<AdamRule<false>>(); }
const RuleInfo& adamw_rule() { return rule_info_of<AdamRule<true>>(); }

}  // namespace distopt::rules
