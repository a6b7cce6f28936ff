// Muon's per-element math (muon.cpp has the options, the Newton-Schulz
// iteration on the CPU and the formula; src/cuda/muon.cu runs the same
// iteration on cuBLAS): the momentum and the update to orthogonalize, and
// the step, shared by the CPU loops and the CUDA kernels (element.hpp). An
// internal interface of optim for src/cuda/ (docs/architecture.md,
// "Layers").
#pragma once

#include <algorithm>
#include <cmath>

#include "element.hpp"

namespace distopt::rules {

enum class AdjustLr : int { original, match_rms_adamw };

struct MuonMath {
  struct Coeffs {
    float w, momentum, a, b, c, eps, decay;
    double lr;
    int ns_steps;
    bool nesterov, bf16;
    AdjustLr adjust;
    float neg_adjusted_lr;  // adjusted_lr(), per tensor shape
  };

  // torch's lerp: start + w*(end - start) for |w| < 0.5, else
  // end - (end - start)*(1 - w), in float.
  DISTOPT_HD static float lerp(float start, float end, float w) {
    return (w < 0.5f && w > -0.5f) ? start + w * (end - start) : end - (end - start) * (1.0f - w);
  }

  // b <- lerp(b, g, 1 - momentum); u = lerp(g, b, momentum) if nesterov else b, into work.
  template <class T>
  DISTOPT_HD static void transform(const Coeffs& c, const Typed<T>& s, float* work, std::size_t i) {
    const float g = to_float(s.g[i]);
    const float b = lerp(s.s[0][i], g, c.w);
    s.s[0][i] = b;
    work[i] = c.nesterov ? lerp(g, b, c.momentum) : b;
  }

  // p <- p * (1 - lr*weight_decay); p <- p - lr*ratio * O (O in work).
  template <class T>
  DISTOPT_HD static void update(const Coeffs& c, const Typed<T>& s, const float* work, std::size_t i) {
    float pi = s.p[i] * c.decay;
    pi = pi + c.neg_adjusted_lr * work[i];
    s.p[i] = pi;
    store(s.lp, i, pi);
  }

  // -(lr * ratio) for a rows x cols tensor: ratio = sqrt(max(1, rows/cols))
  // ("original") or 0.2 * sqrt(max(rows, cols)) ("match_rms_adamw").
  static float adjusted_lr(const Coeffs& c, std::size_t rows, std::size_t cols) {
    const double r = static_cast<double>(rows), k = static_cast<double>(cols);
    const double ratio =
        c.adjust == AdjustLr::original ? std::sqrt(std::max(1.0, r / k)) : 0.2 * std::sqrt(std::max(r, k));
    return static_cast<float>(-(c.lr * ratio));
  }
};

}  // namespace distopt::rules
