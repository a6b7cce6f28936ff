// RAdam's per-element math (radam.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct RadamMath {
  struct Coeffs {
    GradPrologue pro;
    Moments mom;
    float bc1, lr, eps, bc2_sqrt, rect;
    bool rectified;
  };
  static constexpr int kFlags = 2;  // l2, rectified
  static unsigned flags(const Coeffs& c) { return (c.pro.l2 ? 1u : 0u) | (c.rectified ? 2u : 0u); }
  template <bool kL2, bool kRectified, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float pi = s.p[i] * c.pro.decay;
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const auto [mi, vi] = c.mom.update(s.s[0], s.s[1], i, gi);
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
