// LARS (You et al. 2017) as timm's Lars computes it (timm/optim/lars.py;
// docs/optimizers.md, "Non-pointwise rules"), in float32 like torch:
//   adapt iff weight_decay != 0 or always_adapt:
//     w = ||p||, n = ||g||   (whole tensors, before the update)
//     trust = trust_coeff * w / (n + w*wd + eps), or 1 if w or n is 0
//     trust_clip: trust = min(trust / lr, 1)
//     g <- (g + wd*p) * trust
//   then torch SGD: b <- g on the first step, else b <- b*mu + (1-damp)*g;
//   g <- g + mu*b (nesterov) or b;  p <- p - lr*g
// tensor_stats: one pass of two statistics per tensor, sum p^2 and sum g^2.
// The L2 term is timm's, scaled by trust and only when adapting, and there
// is no maximize: not GradPrologue's.
#include "lars.hpp"

#include "../rule_impl.hpp"

namespace distopt::rules {
namespace {

struct LarsRule {
  static constexpr std::string_view kName = "lars";
  static constexpr Locality kLocality = Locality::tensor_stats;
  struct Options {
    double lr, momentum, dampening, weight_decay, trust_coeff, eps;
    bool nesterov, trust_clip, always_adapt;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1.0),
      U::momentum(),
      U::dampening(),
      U::weight_decay(0.0, "L2 penalty (also switches the adaptation on)"),
      U::nesterov(),
      {"trust_coeff", 0.001, "trust coefficient of the layer-wise rate", &Options::trust_coeff},
      U::eps(1e-8, "added to the trust ratio's denominator"),
      {"trust_clip", false, "LARC clipping: min(trust / lr, 1)", &Options::trust_clip},
      {"always_adapt", false, "adapt the rate also without weight decay", &Options::always_adapt},
  };
  static void validate(const Options& o) { check_sgd_family(o); }
  static StateLayout layout(const Options& o) { return momentum_layout(o.momentum); }
  using Coeffs = LarsMath::Coeffs;
  static Coeffs prepare(const Options& o, float*, bool fresh) {
    Coeffs c{};
    c.wd = static_cast<float>(o.weight_decay);
    c.has_momentum = o.momentum != 0.0;
    c.momentum = static_cast<float>(o.momentum);
    c.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
    c.neg_lr = static_cast<float>(-o.lr);
    c.lr = static_cast<float>(o.lr);
    c.trust_coeff = static_cast<float>(o.trust_coeff);
    c.eps = static_cast<float>(o.eps);
    c.adapt = o.weight_decay != 0.0 || o.always_adapt;
    c.trust_clip = o.trust_clip;
    c.first = fresh;
    c.nesterov = o.nesterov;
    c.trust = 1.0f;
    return c;
  }

  static constexpr int kStatPasses = 1;
  static constexpr bool kWorkspace = false;
  static constexpr bool kGroupStep = false;
  static constexpr std::span<const std::string_view> kOptimizerLevel{};
  static std::size_t num_stats(int, const Shape&) { return 2; }
  static bool global_pass(int) { return false; }
  template <class T>
  static void transform(const Coeffs&, int, const Typed<T>&, const Slice&) {}
  template <class T>
  static void partial(const Coeffs& c, int, const Typed<T>& s, const Slice&, double* out) {
    if (!c.adapt) return;
    out[0] += sum_squares(s.p, s.n);
    out[1] += sum_squares(s.g, s.n);
  }
  static void finish_pass(int, const Shape&, const double* stats, Coeffs& c, float*) {
    if (!c.adapt) return;
    // torch: float32 norms and float32 arithmetic on 0-dim tensors.
    const auto w = static_cast<float>(std::sqrt(stats[0]));
    const auto n = static_cast<float>(std::sqrt(stats[1]));
    float trust = c.trust_coeff * w / (n + w * c.wd + c.eps);
    if (!(w > 0.0f) || !(n > 0.0f)) trust = 1.0f;
    if (c.trust_clip) trust = std::min(trust / c.lr, 1.0f);
    c.trust = trust;
  }

  template <class T>
  static void apply_update(const Coeffs& coeffs, const Typed<T>& slice, const float*) {
    dispatch_bools(
        [&](auto adapt, auto has_momentum, auto nesterov) {
          const Coeffs c = coeffs;
          const Typed<T> s = slice;
#pragma GCC ivdep
          for (std::size_t i = 0; i < s.n; ++i) LarsMath::element<adapt, has_momentum, nesterov>(c, s, i);
        },
        coeffs.adapt, coeffs.has_momentum, coeffs.nesterov);
  }
};

}  // namespace

const RuleInfo& lars_rule() { return rule_info_of<LarsRule>(); }

}  // namespace distopt::rules
