// Adamax's per-element math (adamax.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct AdamaxMath {
  struct Coeffs {
    GradPrologue pro;
    float beta1, one_minus_beta1, beta2, eps, neg_clr;
  };
  static constexpr int kFlags = 1;  // l2
  static unsigned flags(const Coeffs& c) { return c.pro.l2 ? 1u : 0u; }
  template <bool kL2, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* m = s.s[0];
    float* u = s.s[1];
    float pi = s.p[i];
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const float mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
    const float ui = hd::max(u[i] * c.beta2, hd::abs(gi) + c.eps);
    m[i] = mi;
    u[i] = ui;
    pi = pi + c.neg_clr * mi / ui;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
