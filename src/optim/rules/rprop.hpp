// Rprop's per-element math (rprop.cpp has the options and the per-step
// scalars), shared by the CPU loop and the CUDA kernel (element.hpp).
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct RpropMath {
  struct Coeffs {
    GradPrologue pro;
    float eta_minus, eta_plus, step_min, step_max;
  };
  static constexpr int kFlags = 0;
  static unsigned flags(const Coeffs&) { return 0; }
  template <class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float* prev = s.s[0];
    float* step_size = s.s[1];
    const float gi = c.pro.grad(to_float(s.g[i]));
    const float prod = gi * prev[i];
    // Written as selects so the loop vectorizes. The factor is eta- exactly
    // when prod < 0 (eta- < 1 < eta+), which is torch's sign.eq(etaminus).
    const float factor = prod > 0.0f ? c.eta_plus : (prod < 0.0f ? c.eta_minus : 1.0f);
    const float ss = hd::min(hd::max(step_size[i] * factor, c.step_min), c.step_max);
    const float gz = prod < 0.0f ? 0.0f : gi;
    // torch's p.addcmul_(sign(g), step_size, value=-1): p + (-1 · sign · ss),
    // written as p - step with step = sign · ss (the same bits for ss >= 0,
    // a zero sign included: p - (+0) is p + (-0)). Not as a select of the
    // constants 1, -1 and -0 times ss: ptxas folds that select into a
    // compare that yields +0 for the -0 (sm_90), which turned a -0
    // parameter into +0 on the GPU.
    const float step = gz > 0.0f ? ss : (gz < 0.0f ? -ss : 0.0f * ss);
    const float pi = s.p[i] - step;
    step_size[i] = ss;
    prev[i] = gz;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
};

}  // namespace distopt::rules
