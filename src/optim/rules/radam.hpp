// RAdam's per-element math (radam.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct RadamMath {
  struct Coeffs {
    GradPrologue pro;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, bc1, lr, eps, bc2_sqrt, rect;
    bool rectified;
  };
  static constexpr int kFlags = 2;  // l2, rectified
  static unsigned flags(const Coeffs& c) { return (c.pro.l2 ? 1u : 0u) | (c.rectified ? 2u : 0u); }
  template <bool kL2, bool kRectified, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* m = s.s[0];
    float* v = s.s[1];
    float pi = s.p[i] * c.pro.decay;
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const float mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
    const float vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / c.bc1;
    if constexpr (kRectified) {
      const float adaptive = 1.0f / (hd::sqrt(vi) + c.eps) * c.bc2_sqrt;
      pi = pi - mhat * c.lr * adaptive * c.rect;
    } else {
      pi = pi - mhat * c.lr;
    }
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
