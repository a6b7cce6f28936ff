// Adafactor's per-element math (adafactor.cpp has the options, the
// per-step scalars and the statistics), shared by the CPU loops and the
// CUDA kernels (element.hpp, "tensor_stats rules").
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct AdafactorMath {
  struct Coeffs {
    double t, rel_step, eps2, decay_rate;
    float eps1, clip_threshold, beta1, one_minus_beta1;
    bool use_first_moment, decay;
    // From pass 0: the step's lr and the second-moment decay.
    float lr, wd_alpha, beta2t, one_minus_beta2t;
    // From pass 1: the update's clipping divisor.
    float den;
    double weight_decay;
    bool scale_parameter;
  };
  static constexpr int kPasses = 2;
  // Pass 0: ||p||^2 (and the row and column sums of q); pass 1: ||U||^2.
  static constexpr Squares kSquares[kPasses] = {{{Source::param, Source::none}}, {{Source::work, Source::none}}};
  static constexpr bool kRowColSums = true;
  static constexpr bool kTransforms[kPasses] = {false, true};
  static bool gathers(const Coeffs&, int) { return true; }
  // q = g^2 + eps1, whose rows and columns the factored moments average.
  DISTOPT_HD static float row_col(const Coeffs& c, float g) { return g * g + c.eps1; }
  // rsqrt(row / mean(row)) and rsqrt(col), as torch computes them.
  DISTOPT_HD static float row_factor(float row, float row_mean) { return 1.0f / hd::sqrt(row / row_mean); }
  DISTOPT_HD static float col_factor(float col) { return 1.0f / hd::sqrt(col); }
  // The unfactored second moment and U of element i.
  template <class T>
  DISTOPT_HD static float vector_direction(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    const float gi = to_float(s.g[i]);
    const float vi = s.s[0][i] * c.beta2t + c.one_minus_beta2t * row_col(c, gi);
    s.s[0][i] = vi;
    return (1.0f / hd::sqrt(vi)) * gi;
  }

  // Pass 1: U into the scratch (and the unfactored second moment). The
  // small state is the row averages (blocks x rows), the column averages
  // (blocks x cols) and each block's mean of its row averages.
  template <class T>
  DISTOPT_HD static void transform(const Coeffs& c, int pass, const Typed<T>& s, const Place& at, float* work,
                                   std::size_t i) {
    if (pass != 1) return;
    if (!at.factored) {
      work[i] = vector_direction(c, s, i);
      return;
    }
    const std::size_t e = at.offset + i, r = e / at.cols, b = r / at.rows;
    const float* row = at.aux;
    const float* col = at.aux + at.blocks * at.rows;
    const float* row_mean = col + at.blocks * at.cols;
    work[i] = (row_factor(row[r], row_mean[b]) * col_factor(col[b * at.cols + e % at.cols])) * to_float(s.g[i]);
  }
  template <class T>
  DISTOPT_HD static void update(const Coeffs& c, const Typed<T>& s, const float* work, std::size_t i) {
    float u = (work[i] / c.den) * c.lr;
    if (c.use_first_moment) {
      const float mi = s.s[1][i] * c.beta1 + c.one_minus_beta1 * u;
      s.s[1][i] = mi;
      u = mi;
    }
    float pi = s.p[i];
    if (c.decay) pi = pi + c.wd_alpha * pi;
    pi = pi + (-u);
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
