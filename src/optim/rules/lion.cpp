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

namespace distopt::rules {
namespace {

struct LionRule {
  static constexpr std::string_view kName = "lion";
  static constexpr Locality kLocality = Locality::pointwise;
  static constexpr bool kEagerState = false;
  static constexpr OptionSpec kOptions[] = {
      {"lr", 1e-4, "learning rate"},
      {"betas", OptionValue(0.9, 0.99), "interpolation for the update (b1) and the moment (b2)"},
      {"weight_decay", 0.0, "decoupled weight decay"},
      {"maximize", false, "maximize the objective"},
  };
  struct Options {
    double lr, beta1, beta2, weight_decay;
    bool maximize;
  };
  static Options parse(const OptionMap& m) {
    const auto b = pair(m, "betas");
    return {num(m, "lr"), b[0], b[1], num(m, "weight_decay"), flag(m, "maximize")};
  }
  static void validate(const Options& o) {
    check_lr(o.lr);
    check_betas({o.beta1, o.beta2});
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options&) { return {{"exp_avg"}, {}}; }
  static void init(const Options&, float* fill, float*) { fill[0] = 0.0f; }
  struct Coeffs {
    GradPrologue pro;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
  };
  static Coeffs prepare(const Options& o, float*, bool) {
    return {GradPrologue::l2_or_decoupled(o.maximize, o.weight_decay, /*decoupled=*/true, o.lr),
            static_cast<float>(o.beta1),
            static_cast<float>(1.0 - o.beta1),
            static_cast<float>(o.beta2),
            static_cast<float>(1.0 - o.beta2),
            static_cast<float>(-o.lr)};
  }
  template <class T>
  static void kernel(const Coeffs& c, const Typed<T>& s) {
    float* __restrict p = s.p;
    T* __restrict lp = s.lp;
    const T* __restrict g = s.g;
    float* __restrict m = s.s[0];
    for (std::size_t i = 0; i < s.n; ++i) {
      const float gi = c.pro.grad(to_float(g[i]));
      const float mi = m[i];
      const float update = sign(mi * c.beta1 + c.one_minus_beta1 * gi);
      const float pi = p[i] * c.pro.decay + c.neg_lr * update;
      m[i] = mi * c.beta2 + c.one_minus_beta2 * gi;
      p[i] = pi;
      store(lp, i, pi);
    }
  }
};

}  // namespace

const RuleInfo& lion_rule() { return rule_info_of<LionRule>(); }

}  // namespace distopt::rules
