// Adagrad's per-element math (adagrad.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct AdagradMath {
  struct Coeffs {
    GradPrologue pro;
    float eps, neg_clr;
  };
  static constexpr int kFlags = 1;  // l2
  static unsigned flags(const Coeffs& c) { return c.pro.l2 ? 1u : 0u; }
  template <bool kL2, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* sum = s.s[0];
    float pi = s.p[i];
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const float si = sum[i] + 1.0f * gi * gi;
    sum[i] = si;
    pi = pi + c.neg_clr * gi / (hd::sqrt(si) + c.eps);
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
