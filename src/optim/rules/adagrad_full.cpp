// Full-matrix Adagrad (Duchi, Hazan & Singer 2011; docs/optimizers.md,
// "Non-pointwise rules"), in the paper's form, with torch Adagrad's options:
//   t <- t + 1;  clr = lr / (1 + (t - 1) * lr_decay)
//   g <- g + weight_decay * p                         (in float)
//   per block b of the flattened tensor (block_size elements; 0: one block):
//     H_b <- H_b + g_b g_b^T                          (H_b = initial_accumulator_value * I at first)
//     every update_freq steps (the first included):
//       R_b = (eps I + H_b^(1/2))^-1, by symmetric eigendecomposition
//     U_b = R_b g_b
//   p <- p - clr * U
// On blocks of one element this is torch's Adagrad. H and R are kept in
// float (state "sum", "inverse_root", per block, and "sum_tail",
// "inverse_root_tail" for a shorter last block); the algebra runs in double.
// A block of d elements keeps two d x d matrices and costs O(d^3) per
// refresh, so d is limited (max_size) and a parameter above it is refused
// with the remedy named.
// whole_tensor: the product R g needs the whole block, so a piece is
// gathered whole first (Optimizer::set_tensor_gather) and the own piece kept.
#include <cmath>
#include <string>

#include "../rule_impl.hpp"
#include "spectral.hpp"

namespace distopt::rules {
namespace {

// The blocks of a tensor of n elements: `full` blocks of d, then a tail.
struct Blocks {
  std::size_t d = 0, full = 0, tail = 0;
  static Blocks of(double block_size, std::size_t n) {
    Blocks b;
    b.d = block_size > 0 ? std::min(static_cast<std::size_t>(block_size), n) : n;
    b.full = b.d == 0 ? 0 : n / b.d;
    b.tail = b.d == 0 ? 0 : n % b.d;
    return b;
  }
};

struct AdagradFullRule : WholeTensorRule {
  static constexpr std::string_view kName = "adagrad_full";
  struct Options {
    double lr, lr_decay, weight_decay, initial_accumulator_value, eps, block_size, max_size, update_freq;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-2),
      {"lr_decay", 0.0, "learning rate decay: lr / (1 + (t-1) lr_decay)", &Options::lr_decay},
      U::weight_decay(0.0, "L2 penalty added to the gradient"),
      {"initial_accumulator_value", 0.0, "the accumulated matrix starts as this times I",
       &Options::initial_accumulator_value},
      U::eps(1e-10, "added to the square root of the accumulated matrix"),
      {"block_size", 0, "elements per diagonal block of the flattened tensor (0: the whole tensor)",
       &Options::block_size},
      {"max_size", 4096, "the largest block, in elements (two d x d float matrices each)", &Options::max_size},
      {"update_freq", 1, "steps between recomputations of the inverse root", &Options::update_freq},
  };
  static void validate(const Options& o) {
    check_lr(o.lr);
    require(o.lr_decay >= 0.0, "Invalid lr_decay value: ", o.lr_decay);
    check_weight_decay(o.weight_decay);
    require(o.initial_accumulator_value >= 0.0, "Invalid initial_accumulator value: ", o.initial_accumulator_value);
    check_eps(o.eps);
    auto whole_number = [](double v, double least) { return v >= least && v == std::floor(v) && v < 1e12; };
    require(whole_number(o.block_size, 0), "block_size must be a whole number >= 0 (got ", o.block_size, ")");
    require(whole_number(o.max_size, 1), "max_size must be a whole number >= 1 (got ", o.max_size, ")");
    require(whole_number(o.update_freq, 1), "update_freq must be a whole number >= 1 (got ", o.update_freq, ")");
  }
  static StateLayout layout(const Options&) { return {{}, {"step"}}; }
  static void check_param(const OptionMap& options, const Shape& s) {
    const Options o = read_options(kOptions, options);
    const Blocks b = Blocks::of(o.block_size, static_cast<std::size_t>(numel(s)));
    if (static_cast<double>(b.d) <= o.max_size) return;
    const double gib = 2.0 * static_cast<double>(b.d) * static_cast<double>(b.d) * 4.0 / (1u << 30);
    require(false, "adagrad_full keeps two d x d matrices per block: a parameter of shape ", to_string(s), " in ",
            o.block_size > 0 ? "blocks" : "one block", " of ", b.d, " elements needs ", gib,
            " GiB; the limit is max_size=", o.max_size,
            " elements per block (set block_size for a block-diagonal preconditioner, raise max_size, "
            "or use adagrad or shampoo)");
  }

  static constexpr bool kAux = true;
  static std::size_t aux_size(const Options& o, const Shape& s) {
    const Blocks b = Blocks::of(o.block_size, static_cast<std::size_t>(numel(s)));
    return 2 * (b.full * b.d * b.d + b.tail * b.tail);
  }
  static std::vector<AuxPart> aux_parts(const Options& o, const Shape& s) {
    const Blocks b = Blocks::of(o.block_size, static_cast<std::size_t>(numel(s)));
    const auto d = static_cast<std::int64_t>(b.d), t = static_cast<std::int64_t>(b.tail);
    const std::size_t full = b.full * b.d * b.d;
    std::vector<AuxPart> parts;
    if (b.full > 0) {
      parts.push_back({"sum", 0, {static_cast<std::int64_t>(b.full), d, d}});
      parts.push_back({"inverse_root", full, {static_cast<std::int64_t>(b.full), d, d}});
    }
    if (b.tail > 0) {
      parts.push_back({"sum_tail", 2 * full, {t, t}});
      parts.push_back({"inverse_root_tail", 2 * full + b.tail * b.tail, {t, t}});
    }
    return parts;
  }
  static bool tensor_needed(const Options&, std::size_t, const Shape&) { return true; }

  struct Coeffs {
    double eps, initial, block_size;
    float neg_clr, weight_decay;
    bool first, refresh;
  };
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    Coeffs c{};
    c.eps = o.eps;
    c.initial = o.initial_accumulator_value;
    c.block_size = o.block_size;
    c.neg_clr = static_cast<float>(-(o.lr / (1.0 + (t - 1.0) * o.lr_decay)));
    c.weight_decay = static_cast<float>(o.weight_decay);
    c.first = t == 1.0;
    c.refresh = std::fmod(t - 1.0, o.update_freq) == 0.0;
    return c;
  }


  template <class T>
  static void transform(const Coeffs& c, int, const Typed<T>& s, const Slice& slice) {
    l2_gradient(c.weight_decay, s, slice.work);
  }

  // 1 / (eps + sqrt(v)) of an eigenvalue v of H; 0 for one below the
  // resolution of the float-stored H. g lies in the range of H (H holds g
  // g^T), so its component along a zero eigenvalue is zero, and what float
  // rounding leaves there is noise that 1/eps (1e10 by default) would blow
  // up: the paper's form with exact arithmetic, a pseudo-inverse on H's
  // null space. (A stale root, update_freq > 1, leaves a gradient direction
  // new since the refresh without an update until the next one.)
  static double inverse_root(double eps, double v, double resolution) {
    return v <= resolution ? 0.0 : 1.0 / (eps + std::sqrt(v));
  }

  // One block of d elements at work, with its sum and root: U = R g.
  static void block(const Coeffs& c, Eigen::Index d, float* work, float* sum, float* root) {
    const Eigen::VectorXd g = Eigen::Map<const Eigen::VectorXf>(work, d).cast<double>();
    accumulate(sum, g * g.transpose(), c.first ? c.initial : 0.0);
    if (c.refresh)
      spectral_function(
          sum, d, [&](double v, double resolution) { return inverse_root(c.eps, v, resolution); }, root);
    Eigen::Map<Eigen::VectorXf>(work, d) = (MapF(root, d, d).cast<double>() * g).cast<float>();
  }

  // The blocks in order, laid out as aux_parts says.
  static void whole(const Coeffs& c, const Shape& shape, float* work, float* aux) {
    const Blocks b = Blocks::of(c.block_size, static_cast<std::size_t>(numel(shape)));
    const std::size_t dd = b.d * b.d, full = b.full * dd;
    for (std::size_t k = 0; k < b.full; ++k)
      block(c, static_cast<Eigen::Index>(b.d), work + k * b.d, aux + k * dd, aux + full + k * dd);
    if (b.tail > 0)
      block(c, static_cast<Eigen::Index>(b.tail), work + b.full * b.d, aux + 2 * full,
            aux + 2 * full + b.tail * b.tail);
  }

  template <class T>
  static void apply_update(const Coeffs& c, const Typed<T>& s, const float* work) {
    float* __restrict p = s.p;
    T* __restrict lp = s.lp;
    for (std::size_t i = 0; i < s.n; ++i) {
      const float pi = p[i] + c.neg_clr * work[i];
      p[i] = pi;
      store(lp, i, pi);
    }
  }
};

}  // namespace

const RuleInfo& adagrad_full_rule() { return rule_info_of<AdagradFullRule>(); }

}  // namespace distopt::rules
