// SGD's per-element math (sgd.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct SgdMath {
  struct Coeffs {
    GradPrologue pro;
    float momentum, one_minus_dampening, neg_lr;
    bool has_momentum, first, nesterov;
  };
  static constexpr int kFlags = 4;  // l2, has_momentum, nesterov, first
  static unsigned flags(const Coeffs& c) {
    return (c.pro.l2 ? 1u : 0u) | (c.has_momentum ? 2u : 0u) | (c.nesterov ? 4u : 0u) | (c.first ? 8u : 0u);
  }
  template <bool kL2, bool kMomentum, bool kNesterov, bool kFirst, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float pi = s.p[i];
    float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    if constexpr (kMomentum)
      gi = sgd_momentum<kNesterov>(gi, s.s[0][i], kFirst, c.momentum, c.one_minus_dampening);
    pi = pi + c.neg_lr * gi;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
