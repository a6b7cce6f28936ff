// The tensor_stats rules with a per-element Math (element.hpp,
// "tensor_stats rules"), by their RuleInfo names: the list the CUDA stats
// kernels are built from (src/cuda/stats.cuh), and where a slice lies in
// its tensor (Place) as the CPU loops and the kernels read it. An internal
// interface of optim for src/cuda/ (docs/architecture.md, "Layers").
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <tuple>

#include "adafactor.hpp"
#include "distopt/optim/rule.hpp"
#include "lamb.hpp"
#include "lars.hpp"
#include "pointwise.hpp"

namespace distopt::rules {

inline constexpr std::tuple kTensorStats{
    Pointwise<LambMath>{"lamb"},
    Pointwise<LarsMath>{"lars"},
    Pointwise<AdafactorMath>{"adafactor"},
};

// Where `slice` lies in its tensor, with its small state at `aux` (the
// slice's own, or a device copy of it).
inline Place place_of(const Slice& slice, const float* aux) {
  const Shape& shape = *slice.shape;
  if (shape.size() < 2) return {aux, slice.offset, 1, 1, static_cast<std::size_t>(numel(shape)), false};
  const auto rows = static_cast<std::size_t>(shape[shape.size() - 2]), cols = static_cast<std::size_t>(shape.back());
  const std::size_t blocks = static_cast<std::size_t>(numel(shape)) / std::max<std::size_t>(rows * cols, 1);
  return {aux, slice.offset, blocks, rows, cols, true};
}

}  // namespace distopt::rules
