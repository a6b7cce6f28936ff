// ASGD's per-element math (asgd.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct AsgdMath {
  struct Coeffs {
    GradPrologue pro;
    float decay, neg_eta, mu;  // decay: ASGD's 1 - lambd*eta, after the L2 term
    bool average;
  };
  static constexpr int kFlags = 2;  // l2, average
  static unsigned flags(const Coeffs& c) { return (c.pro.l2 ? 1u : 0u) | (c.average ? 2u : 0u); }
  template <bool kL2, bool kAverage, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* ax = s.s[0];
    float pi = s.p[i];
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    pi = pi * c.decay;
    pi = pi + c.neg_eta * gi;
    if constexpr (kAverage) ax[i] = ax[i] + (pi - ax[i]) * c.mu;
    else ax[i] = pi;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
