// Adadelta's per-element math (adadelta.cpp has the options and the
// per-step scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct AdadeltaMath {
  struct Coeffs {
    GradPrologue pro;
    float rho, one_minus_rho, eps, neg_lr;
  };
  static constexpr int kFlags = 1;  // l2
  static unsigned flags(const Coeffs& c) { return c.pro.l2 ? 1u : 0u; }
  template <bool kL2, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* v = s.s[0];
    float* u = s.s[1];
    float pi = s.p[i];
    const float gi = c.pro.grad(std::bool_constant<kL2>{}, to_float(s.g[i]), pi);
    const float vi = v[i] * c.rho + c.one_minus_rho * gi * gi;
    const float std_i = hd::sqrt(vi + c.eps);
    const float d = hd::sqrt(u[i] + c.eps) / std_i * gi;
    v[i] = vi;
    u[i] = u[i] * c.rho + c.one_minus_rho * d * d;
    pi = pi + c.neg_lr * d;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
