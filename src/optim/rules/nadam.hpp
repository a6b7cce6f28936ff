// NAdam's per-element math (nadam.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct NadamMath {
  struct Coeffs {
    GradPrologue pro;
    Moments mom;
    float bc2, eps, coef_grad, coef_avg;
  };
  static constexpr int kFlags = 1;  // l2
  static unsigned flags(const Coeffs& c) { return c.pro.l2 ? 1u : 0u; }
  template <bool kL2, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float pi = s.p[i] * c.pro.decay;
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const auto [mi, vi] = c.mom.update(s.s[0], s.s[1], i, gi);
    const float denom = hd::sqrt(vi / c.bc2) + c.eps;
    pi = pi + c.coef_grad * gi / denom;
    pi = pi + c.coef_avg * mi / denom;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
