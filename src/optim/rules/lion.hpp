// Lion's per-element math (lion.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct LionMath {
  struct Coeffs {
    GradPrologue pro;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
  };
  static constexpr int kFlags = 0;
  static unsigned flags(const Coeffs&) { return 0; }
  template <class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* m = s.s[0];
    const float gi = c.pro.grad(to_float(s.g[i]));
    const float mi = m[i];
    const float update = sign(mi * c.beta1 + c.one_minus_beta1 * gi);
    const float pi = s.p[i] * c.pro.decay + c.neg_lr * update;
    m[i] = mi * c.beta2 + c.one_minus_beta2 * gi;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
