// Muon (Jordan et al. 2024) as torch.optim.Muon computes it
// (torch/optim/_muon.py; docs/optimizers.md, "Non-pointwise rules"), for
// 2-D parameters:
//   b <- lerp(b, g, 1 - momentum)                  (torch's lerp, in float)
//   u = lerp(g, b, momentum) if nesterov else b
//   O = NS(u): X = u (transposed if rows > cols), X /= max(||X||, eps), then
//       ns_steps times  A = X X^T;  B = b*A + (c*A) A;  X = a*X + B X
//   p <- p * (1 - lr*weight_decay);  p <- p - lr*ratio * O
//   ratio = sqrt(max(1, rows/cols)) ("original") or 0.2*sqrt(max(rows, cols))
//           ("match_rms_adamw")
// torch runs NS in bfloat16. distopt runs it in float32 by default
// (ns_dtype "float32", documented in docs/optimizers.md) and emulates
// torch's rounding with ns_dtype "bfloat16": every operand rounded to
// bfloat16 and every operation's result too, the products accumulated in
// float as torch's CPU bfloat16 matmul does.
// whole_tensor: the matrix products need the whole update; the sharded
// strategies gather it (Optimizer::set_tensor_gather).
#include "muon.hpp"

#include <Eigen/Core>
#include <cmath>

#include "../rule_impl.hpp"

namespace distopt::rules {
namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

float round_bf16(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }

void round_all(Mat& m) {
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = round_bf16(m.data()[i]);
}

struct MuonRule : WholeTensorRule {
  static constexpr std::string_view kName = "muon";
  struct Options {
    double lr, weight_decay, momentum, a, b, c, eps, ns_steps;
    bool nesterov, bf16, valid_fn, valid_dtype;
    AdjustLr adjust;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(1e-3),
      U::weight_decay(0.1, "decoupled weight decay"),
      U::momentum(0.95),
      U::nesterov(true),
      {"ns_coefficients", OptionValue(3.4445, -4.7750, 2.0315), "Newton-Schulz coefficients a, b, c", &Options::a,
       &Options::b, &Options::c},
      U::eps(1e-7, "the smallest norm the update is divided by"),
      {"ns_steps", 5, "Newton-Schulz iterations", &Options::ns_steps},
      {"adjust_lr_fn", "original", "original (sqrt(max(1, rows/cols))) or match_rms_adamw (0.2 sqrt(max(rows, cols)))"},
      {"ns_dtype", "float32", "float32 (distopt's default) or bfloat16 (torch's rounding, emulated)"},
  };
  static Options parse(const OptionMap& m) {
    Options o = read_options(kOptions, m);
    const std::string_view fn = m.find("adjust_lr_fn")->second.word();
    const std::string_view dtype = m.find("ns_dtype")->second.word();
    o.bf16 = dtype == "bfloat16";
    o.valid_fn = fn == "original" || fn == "match_rms_adamw";
    o.valid_dtype = dtype == "float32" || dtype == "bfloat16";
    o.adjust = fn == "match_rms_adamw" ? AdjustLr::match_rms_adamw : AdjustLr::original;
    return o;
  }
  static void validate(const Options& o) {
    require(o.lr >= 0.0, "Learning rate should be >= 0 but is: ", o.lr);
    require(o.momentum >= 0.0, "momentum should be >= 0 but is: ", o.momentum);
    require(o.weight_decay >= 0.0, "weight decay should be >= 0 but is: ", o.weight_decay);
    require(o.valid_fn, "Adjust learning rate function is not supported: use original or match_rms_adamw");
    require(o.valid_dtype, "ns_dtype must be float32 or bfloat16");
    require(o.ns_steps >= 0 && o.ns_steps < 100 && o.ns_steps == std::floor(o.ns_steps),
            "Number of steps must be a whole number less than 100 for computational efficiency (got ", o.ns_steps, ")");
    check_eps(o.eps);
  }
  static StateLayout layout(const Options&) { return {{"momentum_buffer"}, {}}; }
  static constexpr std::string_view kCompanion = "adamw";  // torch's advice for the rest
  static void check_param(const OptionMap&, const Shape& s) {
    require(s.size() == 2, "Muon only supports 2D parameters whereas we found a parameter with size: ", to_string(s),
            " (give such parameters to another optimizer)");
  }

  using Coeffs = MuonMath::Coeffs;
  static Coeffs prepare(const Options& o, float*, bool) {
    Coeffs c{};
    c.w = static_cast<float>(1.0 - o.momentum);
    c.momentum = static_cast<float>(o.momentum);
    c.a = static_cast<float>(o.a);
    c.b = static_cast<float>(o.b);
    c.c = static_cast<float>(o.c);
    c.eps = static_cast<float>(o.eps);
    c.decay = decoupled_decay(o.lr, o.weight_decay);
    c.lr = o.lr;
    c.ns_steps = static_cast<int>(o.ns_steps);
    c.nesterov = o.nesterov;
    c.bf16 = o.bf16;
    c.adjust = o.adjust;
    return c;
  }


  // The momentum and the update to orthogonalize, into the scratch.
  template <class T>
  static void transform(const Coeffs& c, int, const Typed<T>& s, const Slice& slice) {
    for (std::size_t i = 0; i < s.n; ++i) MuonMath::transform<T>(c, s, slice.work, i);
  }

  // Newton-Schulz on the whole matrix, in place.
  static void whole(Coeffs& c, const Shape& shape, float* work, float*) {
    const auto rows = static_cast<Eigen::Index>(shape[0]), cols = static_cast<Eigen::Index>(shape[1]);
    const Eigen::Map<Mat> u(work, rows, cols);
    const bool transpose = rows > cols;
    Mat x = transpose ? Mat(u.transpose()) : Mat(u);
    if (c.bf16) round_all(x);
    float norm = static_cast<float>(std::sqrt(static_cast<double>(x.cast<double>().squaredNorm())));
    if (c.bf16) norm = round_bf16(norm);
    x /= std::max(norm, c.eps);
    if (c.bf16) round_all(x);
    Mat gram, update;
    for (int k = 0; k < c.ns_steps; ++k) {
      gram.noalias() = x * x.transpose();
      if (c.bf16) {
        round_all(gram);
        Mat b_gram = c.b * gram, c_gram = c.c * gram;
        round_all(b_gram);
        round_all(c_gram);
        Mat prod = c_gram * gram;
        round_all(prod);
        update = b_gram + prod;
        round_all(update);
        Mat ax = c.a * x;
        round_all(ax);
        Mat ux = update * x;
        round_all(ux);
        x = ax + ux;
        round_all(x);
      } else {
        // torch's order: (c*A) rounded, then its product with A.
        const Mat c_gram = c.c * gram;
        Mat prod;
        prod.noalias() = c_gram * gram;
        update = c.b * gram + prod;
        Mat ux;
        ux.noalias() = update * x;
        x = c.a * x + ux;
      }
    }
    Eigen::Map<Mat> out(work, rows, cols);
    if (transpose) out = x.transpose();
    else out = x;
    c.neg_adjusted_lr = MuonMath::adjusted_lr(c, static_cast<std::size_t>(rows), static_cast<std::size_t>(cols));
  }

  template <class T>
  static void apply_update(const Coeffs& c, const Typed<T>& s, const float* work) {
    for (std::size_t i = 0; i < s.n; ++i) MuonMath::update<T>(c, s, work, i);
  }
};

}  // namespace

const RuleInfo& muon_rule() { return rule_info_of<MuonRule>(); }

}  // namespace distopt::rules
