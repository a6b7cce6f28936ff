// Adafactor (Shazeer & Stern 2018) as transformers' Adafactor computes it
// (src/transformers/optimization.py, the same math as fairseq's;
// docs/optimizers.md, "Non-pointwise rules"), in float32 like torch:
//   t <- t + 1;  RMS = ||p|| / sqrt(n)  (before the update)
//   rho = lr, or min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t)) with
//         relative_step;  lr_t = max(eps2, RMS) * rho with scale_parameter
//   b2 = 1 - t^decay_rate;  q = g^2 + eps1
//   factored (>= 2-D: rows are the last dim, R x C per leading index):
//     row <- row*b2 + (1-b2)*mean_last(q);  col <- col*b2 + (1-b2)*mean_rows(q)
//     U = rsqrt(row / mean(row)) * rsqrt(col) * g
//   else: v <- v*b2 + (1-b2)*q;  U = rsqrt(v) * g
//   U <- U / max(RMS(U) / clip_threshold, 1) * lr_t
//   beta1: m <- m*beta1 + (1-beta1)*U;  U = m
//   weight_decay: p <- p + (-weight_decay*lr_t)*p;  p <- p - U
//     (transformers' add_ with alpha, which rounds differently from
//     decoupled_decay's p*(1 - lr*wd) in rule_impl.hpp, so it stays here)
// lr and beta1 are None by default (NaN here): relative steps, no first
// moment. tensor_stats: pass 0 gathers sum p^2 and, factored, the row and
// column sums of q (all-reduced as vectors; every rank keeps the whole row
// and column averages); pass 1 writes U into the scratch and gathers
// sum U^2. transformers' state "RMS" is not kept: it is recomputed first
// thing every step.
#include "adafactor.hpp"

#include <algorithm>
#include <limits>

#include "../rule_impl.hpp"

namespace distopt::rules {
namespace {

// A factored tensor's geometry: B leading blocks of R rows of C.
struct Grid {
  std::size_t b = 1, r = 1, c = 1;
  static Grid of(const Shape& s) {
    Grid g;
    g.c = static_cast<std::size_t>(s[s.size() - 1]);
    g.r = static_cast<std::size_t>(s[s.size() - 2]);
    for (std::size_t k = 0; k + 2 < s.size(); ++k) g.b *= static_cast<std::size_t>(s[k]);
    return g;
  }
};

bool factored(const Shape& s) { return s.size() >= 2; }

struct AdafactorRule {
  static constexpr std::string_view kName = "adafactor";
  static constexpr Locality kLocality = Locality::tensor_stats;
  static constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
  struct Options {
    double lr, eps1, eps2, clip_threshold, decay_rate, beta1, weight_decay;
    bool scale_parameter, relative_step, warmup_init;
  };
  using U = Usual<Options>;
  static constexpr Field<Options> kOptions[] = {
      U::lr(kNone, "learning rate; null (the default): relative steps"),
      {"eps", OptionValue(1e-30, 1e-3), "added to the squared gradient, and the smallest parameter scale",
       &Options::eps1, &Options::eps2},
      {"clip_threshold", 1.0, "the update's RMS is clipped to this", &Options::clip_threshold},
      {"decay_rate", -0.8, "second-moment decay: 1 - t^decay_rate", &Options::decay_rate},
      {"beta1", kNone, "first-moment decay; null (the default): no first moment", &Options::beta1},
      U::weight_decay(0.0, "weight decay, scaled by the step's lr"),
      {"scale_parameter", true, "scale the step by the parameter's RMS", &Options::scale_parameter},
      {"relative_step", true, "time-dependent step size instead of lr", &Options::relative_step},
      {"warmup_init", false, "relative steps grow linearly at first", &Options::warmup_init},
  };
  static void validate(const Options& o) {
    const bool has_lr = !std::isnan(o.lr);
    require(!(has_lr && o.relative_step), "Cannot combine manual `lr` and `relative_step=True` options");
    require(!(o.warmup_init && !o.relative_step), "`warmup_init=True` requires `relative_step=True`");
    require(has_lr || o.relative_step, "Adafactor needs an lr when relative_step is false");
    if (has_lr) check_lr(o.lr);
    require(o.eps1 >= 0.0 && o.eps2 >= 0.0, "Invalid epsilon value: (", o.eps1, ", ", o.eps2, ")");
    require(o.clip_threshold > 0.0, "Invalid clip_threshold value: ", o.clip_threshold);
    require(std::isnan(o.beta1) || (o.beta1 >= 0.0 && o.beta1 < 1.0), "Invalid beta1 value: ", o.beta1);
    check_weight_decay(o.weight_decay);
  }
  static StateLayout layout(const Options& o) {
    StateLayout l{{"exp_avg_sq"}, {"step"}};
    if (!std::isnan(o.beta1)) l.tensors.push_back("exp_avg");
    return l;
  }

  // Small state: the row and column averages (and, as scratch, the mean of
  // each block's rows) of a factored tensor.
  static constexpr bool kAux = true;
  static std::size_t aux_size(const Options&, const Shape& s) {
    if (!factored(s)) return 0;
    const Grid g = Grid::of(s);
    return g.b * g.r + g.b * g.c + g.b;
  }
  static std::vector<AuxPart> aux_parts(const Options&, const Shape& s) {
    if (!factored(s)) return {};
    const Grid g = Grid::of(s);
    Shape row(s.begin(), s.end() - 1), col(s.begin(), s.end() - 2);
    col.push_back(s.back());
    return {{"exp_avg_sq_row", 0, row}, {"exp_avg_sq_col", g.b * g.r, col}};
  }
  static bool tensor_needed(const Options&, std::size_t k, const Shape& s) { return k != 0 || !factored(s); }

  using Coeffs = AdafactorMath::Coeffs;
  static Coeffs prepare(const Options& o, float* scalars, bool) {
    const double t = scalars[0] += 1.0f;
    Coeffs c{};
    c.t = t;
    c.rel_step = o.relative_step ? std::min(o.warmup_init ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t)) : o.lr;
    c.scale_parameter = o.scale_parameter;
    c.eps2 = o.eps2;
    c.eps1 = static_cast<float>(o.eps1);
    c.decay_rate = o.decay_rate;
    c.clip_threshold = static_cast<float>(o.clip_threshold);
    c.use_first_moment = !std::isnan(o.beta1);
    c.beta1 = c.use_first_moment ? static_cast<float>(o.beta1) : 0.0f;
    c.one_minus_beta1 = c.use_first_moment ? static_cast<float>(1.0 - o.beta1) : 0.0f;
    c.weight_decay = o.weight_decay;
    c.decay = o.weight_decay != 0.0;
    const double b2 = 1.0 - std::pow(t, o.decay_rate);
    c.beta2t = static_cast<float>(b2);
    c.one_minus_beta2t = static_cast<float>(1.0 - b2);
    c.den = 1.0f;
    return c;
  }

  static constexpr int kStatPasses = 2;
  static constexpr bool kWorkspace = true;
  static constexpr bool kGroupStep = false;
  static constexpr std::span<const std::string_view> kOptimizerLevel{};
  static std::size_t num_stats(int pass, const Shape& s) {
    if (pass == 1 || !factored(s)) return 1;
    const Grid g = Grid::of(s);
    return 1 + g.b * g.r + g.b * g.c;
  }
  static bool global_pass(int) { return false; }

  // Pass 0: sum p^2 and, factored, the row and column sums of
  // q = g^2 + eps1 over the slice (at its place in the tensor), in element
  // order. Pass 1: sum U^2.
  template <class T>
  static void partial(const Coeffs& c, int pass, const Typed<T>& s, const Slice& slice, double* out) {
    if (pass == 1) {
      out[0] += sum_squares(slice.work, s.n);
      return;
    }
    out[0] += sum_squares(s.p, s.n);
    if (!factored(*slice.shape)) return;
    const std::size_t offset = slice.offset;
    const Grid g = Grid::of(*slice.shape);
    double* rows = out + 1;
    double* cols = out + 1 + g.b * g.r;
    // Row segment by row segment (the slice may start and end mid-row).
    for (std::size_t i = 0, e = offset; i < s.n;) {
      const std::size_t r = e / g.c, j0 = e % g.c, len = std::min(g.c - j0, s.n - i);
      double& row = rows[r];
      double* col = cols + (r / g.r) * g.c + j0;
      for (std::size_t k = 0; k < len; ++k) {
        const float q = AdafactorMath::row_col(c, to_float(s.g[i + k]));
        row += q;
        col[k] += q;
      }
      i += len;
      e += len;
    }
  }

  static void finish_pass(int pass, const Shape& shape, const double* stats, Coeffs& c, float* aux) {
    const double n = static_cast<double>(numel(shape));
    if (pass == 0) {
      // lr_t: torch's float RMS against the float eps2 (Python's max), the
      // product in float when RMS wins, in double otherwise.
      const float rms = static_cast<float>(std::sqrt(stats[0])) / static_cast<float>(std::sqrt(n));
      bool lr_is_float = false;
      double lr = c.rel_step;
      if (c.scale_parameter) {
        if (rms > static_cast<float>(c.eps2)) {
          lr = rms * static_cast<float>(c.rel_step);
          lr_is_float = true;
        } else {
          lr = c.eps2 * c.rel_step;
        }
      }
      c.lr = static_cast<float>(lr);
      c.wd_alpha = lr_is_float ? static_cast<float>(-c.weight_decay) * c.lr : static_cast<float>(-c.weight_decay * lr);
      if (!factored(shape)) return;
      const Grid g = Grid::of(shape);
      float* row = aux;
      float* col = aux + g.b * g.r;
      float* row_mean = aux + g.b * g.r + g.b * g.c;
      const double* row_sum = stats + 1;
      const double* col_sum = stats + 1 + g.b * g.r;
      for (std::size_t k = 0; k < g.b * g.r; ++k)
        row[k] = row[k] * c.beta2t + c.one_minus_beta2t * static_cast<float>(row_sum[k] / static_cast<double>(g.c));
      for (std::size_t k = 0; k < g.b * g.c; ++k)
        col[k] = col[k] * c.beta2t + c.one_minus_beta2t * static_cast<float>(col_sum[k] / static_cast<double>(g.r));
      for (std::size_t b = 0; b < g.b; ++b) {
        double sum = 0;
        for (std::size_t r = 0; r < g.r; ++r) sum += row[b * g.r + r];
        row_mean[b] = static_cast<float>(sum / static_cast<double>(g.r));
      }
      return;
    }
    const float rms_u = static_cast<float>(std::sqrt(stats[0])) / static_cast<float>(std::sqrt(n));
    c.den = std::max(rms_u / c.clip_threshold, 1.0f);
  }

  // Pass 1: U into the scratch (and the unfactored second moment): the
  // Math's transform, with each row's factor computed once per row.
  template <class T>
  static void transform(const Coeffs& c, int pass, const Typed<T>& s, const Slice& slice) {
    if (pass != 1) return;
    float* work = slice.work;
    if (!factored(*slice.shape)) {
      for (std::size_t i = 0; i < s.n; ++i) work[i] = AdafactorMath::vector_direction(c, s, i);
      return;
    }
    const Grid g = Grid::of(*slice.shape);
    const float* row = slice.aux;
    const float* col = slice.aux + g.b * g.r;
    const float* row_mean = slice.aux + g.b * g.r + g.b * g.c;
    for (std::size_t i = 0, e = slice.offset; i < s.n;) {
      const std::size_t r = e / g.c, j0 = e % g.c, len = std::min(g.c - j0, s.n - i);
      const float r_factor = AdafactorMath::row_factor(row[r], row_mean[r / g.r]);
      const float* cols = col + (r / g.r) * g.c + j0;
      for (std::size_t k = 0; k < len; ++k)
        work[i + k] = (r_factor * AdafactorMath::col_factor(cols[k])) * to_float(s.g[i + k]);
      i += len;
      e += len;
    }
  }
  template <class T>
  static void apply_update(const Coeffs& c, const Typed<T>& s, const float* work) {
    cpu_update<AdafactorMath>(c, s, work);
  }
};

}  // namespace

const RuleInfo& adafactor_rule() { return rule_info_of<AdafactorRule>(); }

}  // namespace distopt::rules
