// Adam/AdamW's per-element math (adam.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct AdamMath {
  struct Coeffs {
    GradPrologue pro;
    Moments mom;
    float bc2_sqrt, eps, neg_step_size;
    bool amsgrad;
  };
  static constexpr int kFlags = 2;  // l2, amsgrad
  static unsigned flags(const Coeffs& c) { return (c.pro.l2 ? 1u : 0u) | (c.amsgrad ? 2u : 0u); }
  template <bool kL2, bool kAmsgrad, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float pi = s.p[i] * c.pro.decay;
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    auto [mi, vi] = c.mom.update(s.s[0], s.s[1], i, gi);
    if constexpr (kAmsgrad) {
      float* vmax = s.s[2];
      vi = hd::max(vmax[i], vi);
      vmax[i] = vi;
    }
    const float denom = hd::sqrt(vi) / c.bc2_sqrt + c.eps;
    pi = pi + c.neg_step_size * mi / denom;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
