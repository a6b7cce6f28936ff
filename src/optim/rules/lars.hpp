// LARS's per-element math (lars.cpp has the options, the per-step scalars
// and the trust ratio), shared by the CPU loop and the CUDA kernels
// (element.hpp, "tensor_stats rules").
#pragma once

#include "element.hpp"

namespace distopt::rules {

struct LarsMath {
  struct Coeffs {
    float wd, momentum, one_minus_dampening, neg_lr, lr, trust_coeff, eps;
    float trust;  // from the statistics
    bool adapt, trust_clip, has_momentum, first, nesterov;
  };
  static constexpr int kPasses = 1;
  // ||p||^2 and ||g||^2 (used when adapting).
  static constexpr Squares kSquares[kPasses] = {{{Source::param, Source::grad}}};
  static constexpr bool kRowColSums = false;
  static constexpr bool kTransforms[kPasses] = {false};
  // Without adaptation the norms are not used: the pass is skipped.
  static bool gathers(const Coeffs& c, int) { return c.adapt; }
  DISTOPT_HD static float row_col(const Coeffs&, float) { return 0.0f; }

  template <class T>
  DISTOPT_HD static void transform(const Coeffs&, int, const Typed<T>&, const Place&, float*, std::size_t) {}

  // timm's adapted gradient, then torch SGD's momentum and step.
  template <bool kAdapt, bool kMomentum, bool kNesterov, class T>
  DISTOPT_HD static void element(const Coeffs& c, const Typed<T>& s, std::size_t i) {
    float pi = s.p[i];
    float gi = to_float(s.g[i]);
    if constexpr (kAdapt) gi = (gi + c.wd * pi) * c.trust;
    if constexpr (kMomentum) gi = sgd_momentum<kNesterov>(gi, s.s[0][i], c.first, c.momentum, c.one_minus_dampening);
    pi = pi + c.neg_lr * gi;
    s.p[i] = pi;
    store(s.lp, i, pi);
  }
  // element() with the switches read per element (the device's loop).
  template <class T>
  DISTOPT_HD static void update(const Coeffs& c, const Typed<T>& s, const float*, std::size_t i) {
    if (c.adapt) {
      if (!c.has_momentum) element<true, false, false>(c, s, i);
      else if (c.nesterov) element<true, true, true>(c, s, i);
      else element<true, true, false>(c, s, i);
    } else {
      if (!c.has_momentum) element<false, false, false>(c, s, i);
      else if (c.nesterov) element<false, true, true>(c, s, i);
      else element<false, true, false>(c, s, i);
    }
  }
};

}  // namespace distopt::rules
