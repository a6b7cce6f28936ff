// LAMB's per-element math (lamb.cpp has the options, the per-step scalars
// and the statistics), shared by the CPU loops and the CUDA kernels
// (element.hpp, "tensor_stats rules").
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct LambMath {
  struct Coeffs {
    float beta1, beta2, beta3, one_minus_beta2, bc1, bc2, eps, decay, lr, max_grad_norm;
    float clip;   // from pass 0
    float ratio;  // from pass 1
    bool adam_w_mode, adapt;
  };
  static constexpr int kPasses = 2;
  // Pass 0: ||g||^2 over every tensor; pass 1: ||p||^2 and ||u||^2.
  static constexpr Squares kSquares[kPasses] = {{{Source::grad, Source::none}}, {{Source::param, Source::work}}};
  static constexpr bool kRowColSums = false;
  static constexpr bool kTransforms[kPasses] = {false, true};
  static bool gathers(const Coeffs&, int) { return true; }
  DISTOPT_HD static float row_col(const Coeffs&, float) { return 0.0f; }

  // Pass 1: the moments and apex's stage 1, the update direction u.
  template <class T>
  DISTOPT_HD static void transform(const Coeffs& c, int pass, const Typed<T>& s, const Place&, float* u,
                                   std::size_t i) {
    if (pass != 1) return;
    // apex reads p only when decay != 0 (0 otherwise, whatever p is).
    const float pi = c.decay != 0.0f ? s.p[i] : 0.0f;
    float gi = to_float(s.g[i]) / c.clip;
    if (!c.adam_w_mode) gi = gi + c.decay * pi;
    const float mi = s.s[0][i] * c.beta1 + c.beta3 * gi;
    const float vi = s.s[1][i] * c.beta2 + c.one_minus_beta2 * gi * gi;
    s.s[0][i] = mi;
    s.s[1][i] = vi;
    const float denom = hd::sqrt(vi / c.bc2) + c.eps;
    float ui = (mi / c.bc1) / denom;
    if (c.adam_w_mode) ui = ui + c.decay * pi;
    u[i] = ui;
  }
  // Stage 2: p <- p - ratio*u.
  template <class T>
  DISTOPT_HD static void update(const Coeffs& c, const Typed<T>& s, const float* u, std::size_t i) {
    const float pi = s.p[i] - c.ratio * u[i];
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
