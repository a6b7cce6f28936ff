// The pointwise rules with a per-element element() (element.hpp), by their
// RuleInfo names: the one list the CUDA kernels are built from (src/cuda/).
// A new rule on the device is its Math in rules/<rule>.hpp and one line in
// kPointwise. An internal interface of optim for src/cuda/
// (docs/architecture.md, "Layers").
#pragma once

#include <string>
#include <string_view>
#include <tuple>

#include "adadelta.hpp"
#include "adagrad.hpp"
#include "adam.hpp"
#include "adamax.hpp"
#include "asgd.hpp"
#include "lion.hpp"
#include "nadam.hpp"
#include "radam.hpp"
#include "rmsprop.hpp"
#include "rprop.hpp"
#include "sgd.hpp"

namespace distopt::rules {

template <class M>
struct Pointwise {
  using Math = M;
  std::string_view name;
};

inline constexpr std::tuple kPointwise{
    Pointwise<SgdMath>{"sgd"},         Pointwise<AdamMath>{"adam"},         Pointwise<AdamMath>{"adamw"},
    Pointwise<AdamaxMath>{"adamax"},   Pointwise<AdadeltaMath>{"adadelta"}, Pointwise<AdagradMath>{"adagrad"},
    Pointwise<RmspropMath>{"rmsprop"}, Pointwise<NadamMath>{"nadam"},       Pointwise<RadamMath>{"radam"},
    Pointwise<RpropMath>{"rprop"},     Pointwise<AsgdMath>{"asgd"},         Pointwise<LionMath>{"lion"},
};

// Calls f.template operator()<Math>() for the rule named `rule` in `list`
// (kPointwise, or stats.hpp's kTensorStats); false where it has no such rule.
template <class List, class F>
bool with_math(const List& list, std::string_view rule, F&& f) {
  return std::apply(
      [&](auto... r) {
        return ((r.name == rule ? (f.template operator()<typename decltype(r)::Math>(), true) : false) || ...);
      },
      list);
}

// The names in `list`, comma-separated.
template <class List>
std::string names_of(const List& list) {
  std::string out;
  std::apply([&](auto... r) { ((out += (out.empty() ? "" : ", "), out += r.name), ...); }, list);
  return out;
}

}  // namespace distopt::rules
