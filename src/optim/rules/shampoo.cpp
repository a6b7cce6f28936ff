// Shampoo (Gupta, Koren & Singer 2018, Algorithm 2; docs/optimizers.md,
// "Non-pointwise rules") for a tensor of order k with dimensions d_1 .. d_k:
//   g <- g + weight_decay * p                       (L2, in float)
//   H_i <- H_i + G_(i) G_(i)^T  for every mode i    (H_i = epsilon*I at first)
//   every update_freq steps (the first included): P_i = H_i^(-1/(2k)), by
//       symmetric eigendecomposition (eigenvalues floored at epsilon)
//   U = G x_1 P_1 x_2 ... x_k P_k                   (modes in order)
//   momentum > 0: b <- momentum*b + U;  U = b       (b = 0 at first)
//   p <- p - lr*U
// G_(i) is the mode-i unfolding (d_i rows; the other modes' elements as
// columns). Every statistic comes from the gradient itself, as in the paper:
// moskomule/shampoo.pytorch instead accumulates each mode's statistic from
// the gradient already preconditioned along the earlier modes, raises to
// -1/k, not -1/(2k), and mixes momentum into the gradient; docs/optimizers.md
// has the comparison. A 0-d tensor has no modes: U = G. The statistics and
// the roots are kept in float (state "preconditioner_i", "inverse_root_i");
// the algebra runs in double.
// whole_tensor: H_1 = G G^T needs every column of G, so a piece is gathered
// whole first (Optimizer::set_tensor_gather), the step computed on the whole
// tensor on every rank that holds a piece of it, and the own piece kept.
#include <cmath>
#include <string>

#include "../rule_impl.hpp"
#include "spectral.hpp"

namespace distopt::rules {
namespace {

// Mode i of a row-major tensor as (pre, d, post): element (a, j, b) at
// (a*d + j)*post + b.
struct Mode {
  Eigen::Index pre = 1, d = 1, post = 1;
  static Mode of(const Shape& s, std::size_t i) {
    Mode m;
    m.d = static_cast<Eigen::Index>(s[i]);
    for (std::size_t k = 0; k < i; ++k) m.pre *= static_cast<Eigen::Index>(s[k]);
    for (std::size_t k = i + 1; k < s.size(); ++k) m.post *= static_cast<Eigen::Index>(s[k]);
    return m;
  }
};

// G_(i) G_(i)^T = sum over a of M_a M_a^T, M_a = (d x post) block a.
MatD mode_gram(const MatD& g, const Mode& m) {
  if (m.post == 1) {  // G as (pre x d): its Gram matrix in one product
    const Eigen::Map<const MatD> x(g.data(), m.pre, m.d);
    return x.transpose() * x;
  }
  MatD h = MatD::Zero(m.d, m.d);
  for (Eigen::Index a = 0; a < m.pre; ++a) {
    const Eigen::Map<const MatD> x(g.data() + a * m.d * m.post, m.d, m.post);
    h.noalias() += x * x.transpose();
  }
  return h;
}

// G <- G x_i P (P symmetric): every block M_a <- P M_a.
void apply_mode(MatD& g, const Mode& m, const MatD& p) {
  if (m.post == 1) {
    Eigen::Map<MatD> x(g.data(), m.pre, m.d);
    x = (x * p).eval();
    return;
  }
  for (Eigen::Index a = 0; a < m.pre; ++a) {
    Eigen::Map<MatD> x(g.data() + a * m.d * m.post, m.d, m.post);
    x = (p * x).eval();
  }
}

struct ShampooRule : WholeTensorRule {
  static constexpr std::string_view kName = "shampoo";
  struct Options {
    double lr, momentum, weight_decay, epsilon, update_freq, max_precond_dim;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-1),
      U::momentum(0.0, "momentum of the preconditioned update (0: none)"),
      U::weight_decay(0.0, "L2 penalty added to the gradient"),
      {"epsilon", 1e-4, "each preconditioner starts as epsilon * I", &Options::epsilon},
      {"update_freq", 1, "steps between recomputations of the inverse roots", &Options::update_freq},
      {"max_precond_dim", 4096, "the largest dimension preconditioned (two d x d float matrices each)",
       &Options::max_precond_dim},
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    require(o.momentum >= 0.0 && o.momentum < 1.0, "Invalid momentum value: ", o.momentum);
    check_weight_decay(o.weight_decay);
    require(o.epsilon > 0.0 && std::isfinite(o.epsilon), "Invalid epsilon value: ", o.epsilon,
            " (the preconditioners start as epsilon * I: it must be positive)");
    require(o.update_freq >= 1 && o.update_freq == std::floor(o.update_freq) && o.update_freq < 1e9,
            "update_freq must be a whole number >= 1 (got ", o.update_freq, ")");
    require(o.max_precond_dim >= 1 && o.max_precond_dim == std::floor(o.max_precond_dim) && o.max_precond_dim < 1e6,
            "max_precond_dim must be a whole number >= 1 (got ", o.max_precond_dim, ")");
  }
  static StateLayout layout(const Options& o) {
    StateLayout l{{}, {"step"}};
    if (o.momentum > 0.0) l.tensors.push_back("momentum_buffer");
    return l;
  }
  static void check_param(const OptionMap& options, const Shape& s) {
    const double limit = read_options(kOptions, options).max_precond_dim;
    require(s.size() <= static_cast<std::size_t>(kNamed), "shampoo takes tensors of up to ", kNamed,
            " dimensions; a parameter has shape ", to_string(s));
    for (std::size_t i = 0; i < s.size(); ++i)
      require(static_cast<double>(s[i]) <= limit, "shampoo keeps a d x d preconditioner per dimension: dimension ", i,
              " of a parameter of shape ", to_string(s), " is ", s[i], ", above max_precond_dim=", limit,
              " (raise max_precond_dim, or give the parameter to another optimizer)");
  }

  // Small state: per mode, the statistic and its inverse root.
  static constexpr bool kAux = true;
  static std::size_t aux_size(const Options&, const Shape& s) {
    std::size_t n = 0;
    for (std::int64_t d : s) n += 2 * static_cast<std::size_t>(d) * static_cast<std::size_t>(d);
    return n;
  }
  static std::vector<AuxPart> aux_parts(const Options&, const Shape& s) {
    std::vector<AuxPart> parts;
    std::size_t offset = 0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const std::size_t dd = static_cast<std::size_t>(s[i]) * static_cast<std::size_t>(s[i]);
      parts.push_back({kNames[i % kNamed][0], offset, {s[i], s[i]}});
      parts.push_back({kNames[i % kNamed][1], offset + dd, {s[i], s[i]}});
      offset += 2 * dd;
    }
    return parts;
  }
  static bool tensor_needed(const Options&, std::size_t, const Shape&) { return true; }
  static constexpr int kNamed = 8;
  static constexpr std::string_view kNames[kNamed][2] = {
      {"preconditioner_0", "inverse_root_0"}, {"preconditioner_1", "inverse_root_1"},
      {"preconditioner_2", "inverse_root_2"}, {"preconditioner_3", "inverse_root_3"},
      {"preconditioner_4", "inverse_root_4"}, {"preconditioner_5", "inverse_root_5"},
      {"preconditioner_6", "inverse_root_6"}, {"preconditioner_7", "inverse_root_7"}};

  struct Coeffs {
    float neg_lr, momentum, weight_decay;
    double epsilon;
    bool first, refresh, use_momentum;
  };
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    Coeffs c{};
    c.neg_lr = static_cast<float>(-o.lr);
    c.momentum = static_cast<float>(o.momentum);
    c.weight_decay = static_cast<float>(o.weight_decay);
    c.epsilon = o.epsilon;
    c.first = t == 1.0;
    c.refresh = std::fmod(t - 1.0, o.update_freq) == 0.0;
    c.use_momentum = o.momentum > 0.0;
    return c;
  }


  template <class T>
  static void transform(const Coeffs& c, int, const Typed<T>& s, const Slice& slice) {
    l2_gradient(c.weight_decay, s, slice.work);
  }

  // The preconditioned update of the whole tensor, in place.
  static void whole(const Coeffs& c, const Shape& shape, float* work, float* aux) {
    const std::size_t k = shape.size();
    if (k == 0) return;
    const auto n = static_cast<Eigen::Index>(numel(shape));
    MatD g = Eigen::Map<const Eigen::Matrix<float, 1, Eigen::Dynamic>>(work, n).cast<double>();
    const double exponent = -1.0 / (2.0 * static_cast<double>(k));
    const double floor = c.epsilon;
    float* part = aux;
    for (std::size_t i = 0; i < k; ++i) {
      const Mode m = Mode::of(shape, i);
      accumulate(part, mode_gram(g, m), c.first ? c.epsilon : 0.0);
      if (c.refresh)
        spectral_function(
            part, m.d, [&](double v, double) { return std::pow(std::max(v, floor), exponent); }, part + m.d * m.d);
      part += 2 * m.d * m.d;
    }
    part = aux;
    for (std::size_t i = 0; i < k; ++i) {
      const Mode m = Mode::of(shape, i);
      apply_mode(g, m, MapF(part + m.d * m.d, m.d, m.d).cast<double>());
      part += 2 * m.d * m.d;
    }
    Eigen::Map<Eigen::Matrix<float, 1, Eigen::Dynamic>>(work, n) = g.cast<float>();
  }

  template <class T>
  static void apply_update(const Coeffs& c, const Typed<T>& s, const float* work) {
    float* __restrict p = s.p;
    T* __restrict lp = s.lp;
    float* __restrict b = c.use_momentum ? s.s[0] : nullptr;
    for (std::size_t i = 0; i < s.n; ++i) {
      float u = work[i];
      if (b != nullptr) u = b[i] = c.momentum * b[i] + u;
      const float pi = p[i] + c.neg_lr * u;
      p[i] = pi;
      store(lp, i, pi);
    }
  }
};

}  // namespace

const RuleInfo& shampoo_rule() { return rule_info_of<ShampooRule>(); }

}  // namespace distopt::rules
