// What a pointwise rule's per-element math is written with: compiled for the
// CPU loop and, under nvcc, for the CUDA kernel (docs/gpu.md). No standard
// library beyond <type_traits>; every function is DISTOPT_HD.
//
// A pointwise rule keeps its math in src/optim/rules/<rule>.hpp as a struct
// with
//   struct Coeffs { ... };                 the per-step scalars (host-made)
//   static constexpr int kFlags;           compile-time switches of the loop
//   static unsigned flags(const Coeffs&);  their values, bit k = switch k
//   template <bool... F, class T>
//   DISTOPT_HD static void element(const Coeffs&, const Typed<T>&, std::size_t i);
// and both the CPU (cpu_loop in rule_impl.hpp) and the GPU (src/cuda/) run
// element(c, s, i) for every i of a slice, in no particular order.
#pragma once

#include <cstddef>
#include <type_traits>

#include "distopt/core/dtype.hpp"
#include "distopt/core/hd.hpp"

namespace distopt::rules {

// A slice with its element type resolved. `p` is the fp32 value being
// updated (the parameter itself, or its fp32 master copy); for bf16/f16
// parameters `lp` receives the rounded result.
template <class T>
struct Typed {
  float* p;
  T* lp;
  const T* g;
  float* const* s;
  std::size_t n;
};

template <class T>
DISTOPT_HD void store(T* lp, std::size_t i, float v) {
  if constexpr (!std::is_same_v<T, float>) lp[i] = from_float<T>(v);
}

DISTOPT_HD float sign(float x) { return static_cast<float>((x > 0.0f) - (x < 0.0f)); }

// Calls f(std::bool_constant<bit 0 of mask>{}, ..., bit N-1): a pointwise
// rule's flags (element.hpp) as compile-time switches.
template <int N, class F, class... B>
void dispatch_mask(unsigned mask, F&& f, B... picked) {
  if constexpr (N == 0) f(picked...);
  else if (mask & (1u << (N - 1))) dispatch_mask<N - 1>(mask, f, std::true_type{}, picked...);
  else dispatch_mask<N - 1>(mask, f, std::false_type{}, picked...);
}

// Decoupled (AdamW) weight decay's factor for p <- p*(1 - lr*wd), computed in
// double and rounded to float once per step (host only).
inline float decoupled_decay(double lr, double weight_decay) {
  return static_cast<float>(1.0 - lr * weight_decay);
}

// Adam's two moments (Adam, NAdam, RAdam): m <- m*b1 + (1-b1)*g and
// v <- v*b2 + (1-b2)*g*g in float; update() stores and returns both.
struct Moments {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  static Moments of(double b1, double b2) {
    return {static_cast<float>(b1), static_cast<float>(1.0 - b1), static_cast<float>(b2), static_cast<float>(1.0 - b2)};
  }
  struct Values {
    float m, v;
  };
  DISTOPT_HD Values update(float* m, float* v, std::size_t i, float g) const {
    const float mi = m[i] * beta1 + one_minus_beta1 * g;
    const float vi = v[i] * beta2 + one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    return {mi, vi};
  }
};

// The prologue of torch's pointwise rules (docs/optimizers.md, "Pointwise
// rules"): g <- -g if maximize; then L2 decay g <- g + wd*p, or decoupled
// decay p <- p*(1 - lr*wd), never both. Made on the host once per step by
// l2_decay (torch's SGD, Adamax, Adadelta, Adagrad, RMSprop, ASGD; Rprop
// with wd 0) or l2_or_decoupled (Adam/AdamW, NAdam, RAdam; Lion, always
// decoupled). Per element, in this order, with l2 a compile-time switch:
//   pi = p[i] * decay;                  (rules with decoupled decay only)
//   gi = grad(l2, to_float(g[i]), pi);  (g*grad_sign) + wd*pi, in float
// or gi = grad(to_float(g[i])) where there is no L2 (rprop, lion).
struct GradPrologue {
  float grad_sign, wd, decay;
  bool l2;
  static GradPrologue l2_or_decoupled(bool maximize, double weight_decay, bool decoupled, double lr) {
    return {maximize ? -1.0f : 1.0f, static_cast<float>(weight_decay),
            decoupled ? decoupled_decay(lr, weight_decay) : 1.0f, !decoupled && weight_decay != 0.0};
  }
  static GradPrologue l2_decay(bool maximize, double weight_decay) {
    return l2_or_decoupled(maximize, weight_decay, false, 0.0);
  }
  DISTOPT_HD float grad(float g) const { return g * grad_sign; }
  template <bool kL2>
  DISTOPT_HD float grad(std::bool_constant<kL2>, float g, float p) const {
    if constexpr (kL2) return grad(g) + wd * p;
    else return grad(g);
  }
};

// torch SGD's momentum on one element (sgd, lars): b <- g on the
// parameter's first step, else b*mu + (1 - dampening)*g; returns the step's
// direction, g + mu*b (Nesterov) or b.
template <bool kNesterov>
DISTOPT_HD float sgd_momentum(float g, float& b, bool first, float momentum, float one_minus_dampening) {
  const float bi = first ? g : b * momentum + one_minus_dampening * g;
  b = bi;
  if constexpr (kNesterov) return g + momentum * bi;
  else return bi;
}

}  // namespace distopt::rules

namespace distopt::rules {

// The tensor_stats rules with a device path (lamb.hpp, lars.hpp,
// adafactor.hpp) keep their per-element math in a Math struct too, run by
// their CPU loops and by src/cuda/stats.cuh:
//   struct Coeffs { ... };                 per-step scalars: made by the
//                                          rule's prepare, completed by its
//                                          finish_pass (always on the host)
//   static constexpr int kPasses;
//   static constexpr Squares kSquares[kPasses];  what pass k sums the
//                                          squares of, in the order of its
//                                          statistics (the CPU's partial
//                                          gathers the same)
//   static constexpr bool kRowColSums;     pass 0 also sums row_col(c, g)
//                                          over each row and each column of
//                                          a factored tensor (Adafactor)
//   static constexpr bool kTransforms[kPasses];  whether pass k transforms
//   static bool gathers(const Coeffs&, int pass);  whether the statistics
//                                          are used (host; LARS without
//                                          adaptation: no pass at all)
//   template <class T> DISTOPT_HD static void transform(
//       const Coeffs&, int pass, const Typed<T>&, const Place&, float* work, std::size_t i);
//   template <class T> DISTOPT_HD static void update(
//       const Coeffs&, const Typed<T>&, const float* work, std::size_t i);
// where transform writes element i of the scratch before pass k's
// statistics (and may update state), and update applies the step.
enum class Source : unsigned char { none, param, grad, work };
struct Squares {
  Source of[2];
  DISTOPT_HD int count() const { return (of[0] != Source::none) + (of[1] != Source::none); }
};
// Where a slice lies in its tensor: the index of its first element, the
// tensor's shape as blocks x rows x cols when it is factored (the last two
// dimensions, per leading index) and its small state, in the memory of the
// device that steps it.
struct Place {
  const float* aux;
  std::size_t offset, blocks, rows, cols;
  bool factored;
};

}  // namespace distopt::rules
