// RMSprop's per-element math (rmsprop.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct RmspropMath {
  struct Coeffs {
    GradPrologue pro;
    float alpha, one_minus_alpha, eps, momentum, neg_lr;
    bool centered, has_momentum;
  };
  static constexpr int kFlags = 3;  // l2, centered, has_momentum
  static unsigned flags(const Coeffs& c) {
    return (c.pro.l2 ? 1u : 0u) | (c.centered ? 2u : 0u) | (c.has_momentum ? 4u : 0u);
  }
  template <bool kL2, bool kCentered, bool kMomentum, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* v = s.s[0];
    // The layout puts momentum_buffer before grad_avg when both exist.
    float* b = s.s[1];
    float* gbar = kMomentum ? s.s[2] : s.s[1];
    float pi = s.p[i];
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const float vi = v[i] * c.alpha + c.one_minus_alpha * gi * gi;
    v[i] = vi;
    float avg;
    if constexpr (kCentered) {
      const float ga = gbar[i] * c.alpha + c.one_minus_alpha * gi;
      gbar[i] = ga;
      avg = hd::sqrt(vi + -1.0f * ga * ga);
    } else {
      avg = hd::sqrt(vi);
    }
    avg = avg + c.eps;
    if constexpr (kMomentum) {
      const float bi = b[i] * c.momentum + 1.0f * gi / avg;
      b[i] = bi;
      pi = pi + c.neg_lr * bi;
    } else {
      pi = pi + c.neg_lr * gi / avg;
    }
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
