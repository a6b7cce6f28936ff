// NAdam's per-element math (nadam.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct NadamMath {
  struct Coeffs {
    GradPrologue pro;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, bc2, eps, coef_grad, coef_avg;
  };
  static constexpr int kFlags = 1;  // l2
  static unsigned flags(const Coeffs& c) { return c.pro.l2 ? 1u : 0u; }
  template <bool kL2, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* m = s.s[0];
    float* v = s.s[1];
    float pi = s.p[i] * c.pro.decay;
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const float mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
    const float vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = hd::sqrt(vi / c.bc2) + c.eps;
    pi = pi + c.coef_grad * gi / denom;
    pi = pi + c.coef_avg * mi / denom;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
