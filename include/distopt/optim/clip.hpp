// Gradient clipping: torch.nn.utils.clip_grad_norm_ and clip_grad_value_
// (torch 1.13; docs/optimizers.md, "Gradient clipping").
//
// clip_grad_norm is built as a tensor statistic in three parts, so that a
// sharded engine can use it unchanged on the shard each rank holds:
//   1. grad_norm_partial: the statistic of the local elements (Σ|g|^p, or
//      max|g| for p = inf);
//   2. a reduction hook: sum (max for inf) of the partials over ranks --
//      an all_reduce; without one, the local value is the total;
//   3. finish_grad_norm, then the pointwise scale by
//      min(max_norm / (total + 1e-6), 1), always applied, as torch does.
#pragma once
#include <functional>
#include <span>

#include "distopt/core/tensor.hpp"

namespace distopt {

class Optimizer;

// Reduces `value` over ranks in place: a sum, or a max when `max` is set.
using StatReduce = std::function<void(double& value, bool max)>;

// Σ|g|^p over the elements of `grads` (p finite), or max|g| (p = inf; NaN
// if any element is NaN). f32, bf16 or f16 gradients.
double grad_norm_partial(std::span<const TensorView> grads, double norm_type);
// The total norm from the reduced partial statistic.
double finish_grad_norm(double partial, double norm_type);

// Scales `grads` so that their total norm is at most max_norm and returns
// the norm before clipping. error_if_nonfinite: throws InvalidInput when
// the norm is NaN or infinite (then nothing is scaled). No gradients: 0.
double clip_grad_norm(std::span<const TensorView> grads, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false, const StatReduce& reduce = {});
// Sharded form: the norm is that of the gradient elements spread over the
// ranks as `owned` (this rank's, distinct from every other rank's), reduced
// with `reduce`; the coefficient scales `apply` (the elements this rank
// steps, which may be more than it owns: a replicated gradient).
double clip_grad_norm(std::span<const TensorView> owned, std::span<const TensorView> apply, double max_norm,
                      double norm_type, bool error_if_nonfinite, const StatReduce& reduce);
// The gradients of an optimizer's parameters that have one.
double clip_grad_norm(Optimizer& opt, double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false,
                      const StatReduce& reduce = {});
// Sharded, on an optimizer: the norm of `owned`, the coefficient applied to
// the gradients of opt's parameters that have one.
double clip_grad_norm(Optimizer& opt, std::span<const TensorView> owned, double max_norm, double norm_type,
                      bool error_if_nonfinite, const StatReduce& reduce);

// Clamps every gradient element into [-clip_value, clip_value]; NaN stays NaN.
void clip_grad_value(std::span<const TensorView> grads, double clip_value);
void clip_grad_value(Optimizer& opt, double clip_value);

}  // namespace distopt
