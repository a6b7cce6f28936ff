// Private helpers for writing update rules (src/optim/rules/*.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <iterator>
#include <type_traits>

#include "distopt/core/error.hpp"
#include "distopt/optim/rule.hpp"
#include "rules/element.hpp"
#include "rules/stats.hpp"

namespace distopt::rules {

// The registry's entries, one per file of src/optim/rules/ (registry.cpp
// lists them). Internal to the library: hidden from libdistopt.so.
#define DISTOPT_INTERNAL __attribute__((visibility("hidden")))
DISTOPT_INTERNAL const RuleInfo& sgd_rule();
DISTOPT_INTERNAL const RuleInfo& adam_rule();
DISTOPT_INTERNAL const RuleInfo& adamw_rule();
DISTOPT_INTERNAL const RuleInfo& adamax_rule();
DISTOPT_INTERNAL const RuleInfo& adadelta_rule();
DISTOPT_INTERNAL const RuleInfo& adagrad_rule();
DISTOPT_INTERNAL const RuleInfo& rmsprop_rule();
DISTOPT_INTERNAL const RuleInfo& nadam_rule();
DISTOPT_INTERNAL const RuleInfo& radam_rule();
DISTOPT_INTERNAL const RuleInfo& rprop_rule();
DISTOPT_INTERNAL const RuleInfo& asgd_rule();
DISTOPT_INTERNAL const RuleInfo& lion_rule();
DISTOPT_INTERNAL const RuleInfo& lars_rule();
DISTOPT_INTERNAL const RuleInfo& lamb_rule();
DISTOPT_INTERNAL const RuleInfo& adafactor_rule();
DISTOPT_INTERNAL const RuleInfo& muon_rule();
DISTOPT_INTERNAL const RuleInfo& shampoo_rule();
DISTOPT_INTERNAL const RuleInfo& adagrad_full_rule();
#undef DISTOPT_INTERNAL

// One row of a rule's kOptions table: the option as the registry shows it
// (name, default, help) and the member(s) of the rule's Options that
// read_options fills from it, by the default's kind: a number one double, a
// pair two, a triple three, a flag one bool. A word has no member: the
// rule's own parse reads it.
template <class O>
struct Field {
  OptionSpec spec;
  std::array<double O::*, 3> nums{};
  bool O::*flag = nullptr;
  constexpr Field(std::string_view name, OptionValue def, std::string_view help, bool O::*f)
      : spec{name, def, help}, flag(f) {}
  template <class... M>
    requires(sizeof...(M) <= 3 && (std::is_same_v<M, double O::*> && ...))
  constexpr Field(std::string_view name, OptionValue def, std::string_view help, M... m)
      : spec{name, def, help}, nums{m...} {}
  // Whether the members match the default's kind (checked at compile time).
  constexpr bool consistent() const {
    const int n = (nums[0] != nullptr) + (nums[1] != nullptr) + (nums[2] != nullptr);
    switch (spec.default_value.kind()) {
      case OptionValue::Kind::number:
        return n == 1 && !flag;
      case OptionValue::Kind::pair:
        return n == 2 && !flag;
      case OptionValue::Kind::triple:
        return n == 3 && !flag;
      case OptionValue::Kind::flag:
        return n == 0 && flag;
      case OptionValue::Kind::word:
        return n == 0 && !flag;
    }
    return false;
  }
};

// The rows torch's optimizers have in common, with their usual help; a rule
// whose Options has the member writes `using U = Usual<Options>;` and
// `U::lr(1e-3)`, and passes its own help where its meaning differs.
template <class O>
struct Usual {
  static constexpr Field<O> lr(double d, std::string_view help = "learning rate") { return {"lr", d, help, &O::lr}; }
  static constexpr Field<O> betas(double b1 = 0.9, double b2 = 0.999,
                                  std::string_view help = "decay rates of the first and second moments") {
    return {"betas", OptionValue(b1, b2), help, &O::beta1, &O::beta2};
  }
  static constexpr Field<O> eps(double d, std::string_view help = "added to the denominator") {
    return {"eps", d, help, &O::eps};
  }
  static constexpr Field<O> weight_decay(double d = 0.0, std::string_view help = "L2 penalty") {
    return {"weight_decay", d, help, &O::weight_decay};
  }
  static constexpr Field<O> decoupled_weight_decay(
      bool d = false, std::string_view help = "AdamW-style decoupled weight decay (torch 2.x)") {
    return {"decoupled_weight_decay", d, help, &O::decoupled};
  }
  static constexpr Field<O> maximize(std::string_view help = "maximize the objective") {
    return {"maximize", false, help, &O::maximize};
  }
  static constexpr Field<O> momentum(double d = 0.0, std::string_view help = "momentum factor") {
    return {"momentum", d, help, &O::momentum};
  }
  static constexpr Field<O> dampening() { return {"dampening", 0.0, "dampening of the momentum", &O::dampening}; }
  static constexpr Field<O> nesterov(bool d = false) { return {"nesterov", d, "Nesterov momentum", &O::nesterov}; }
};

// A rule's Options read from a complete map (resolve_options has checked
// names and kinds) by its kOptions table: the one reader of rule options.
template <class O, std::size_t N>
O read_options(const Field<O> (&fields)[N], const OptionMap& m) {
  O o{};
  for (const Field<O>& f : fields) {
    const OptionValue& v = m.find(f.spec.name)->second;
    switch (v.kind()) {
      case OptionValue::Kind::number:
        o.*f.nums[0] = v.number();
        break;
      case OptionValue::Kind::pair: {
        const auto p = v.pair();
        o.*f.nums[0] = p[0];
        o.*f.nums[1] = p[1];
        break;
      }
      case OptionValue::Kind::triple: {
        const auto t = v.triple();
        for (std::size_t k = 0; k < 3; ++k) o.*f.nums[k] = t[k];
        break;
      }
      case OptionValue::Kind::flag:
        o.*f.flag = v.flag();
        break;
      case OptionValue::Kind::word:
        break;
    }
  }
  return o;
}

// Throws InvalidInput with torch's wording when `ok` is false.
template <class... Args>
void require(bool ok, const Args&... message) {
  if (!ok) throw InvalidInput(str(message...));
}

// The checks torch's constructors make, shared by many rules.
inline void check_lr(double lr) { require(lr >= 0.0, "Invalid learning rate: ", lr); }
inline void check_eps(double eps) { require(eps >= 0.0, "Invalid epsilon value: ", eps); }
inline void check_weight_decay(double wd) { require(wd >= 0.0, "Invalid weight_decay value: ", wd); }
inline void check_betas(std::array<double, 2> b) {
  require(0.0 <= b[0] && b[0] < 1.0, "Invalid beta parameter at index 0: ", b[0]);
  require(0.0 <= b[1] && b[1] < 1.0, "Invalid beta parameter at index 1: ", b[1]);
}

// Adam's family (Adam, Adamax, NAdam, RAdam, LAMB): lr, eps, betas and
// weight_decay, in torch's order.
template <class O>
void check_adam_family(const O& o) {
  check_lr(o.lr);
  check_eps(o.eps);
  check_betas({o.beta1, o.beta2});
  check_weight_decay(o.weight_decay);
}
// SGD's (and LARS's): lr, momentum, weight_decay and Nesterov's condition.
template <class O>
void check_sgd_family(const O& o) {
  check_lr(o.lr);
  require(o.momentum >= 0.0, "Invalid momentum value: ", o.momentum);
  check_weight_decay(o.weight_decay);
  require(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
          "Nesterov momentum requires a momentum and zero dampening");
}
// SGD's state (and LARS's): a momentum buffer when there is momentum.
inline StateLayout momentum_layout(double momentum) {
  StateLayout l;
  if (momentum != 0.0) l.tensors.push_back("momentum_buffer");
  return l;
}

// A slice with its element type resolved (see Typed).
template <class T>
Typed<T> typed(const Slice& s) {
  if constexpr (std::is_same_v<T, float>)
    return {static_cast<float*>(s.param), nullptr, static_cast<const T*>(s.grad), s.state, s.n};
  else
    return {s.master, static_cast<T*>(s.param), static_cast<const T*>(s.grad), s.state, s.n};
}

// Σ f(i) for i in [0, n) in double, in 8 interleaved lanes combined in a
// fixed order: vectorizable, and the same bits for the same elements
// wherever the range comes from (a whole tensor or a shard's piece of it).
template <class F>
double lane_sum(std::size_t n, F&& f) {
  double lane[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += f(i + static_cast<std::size_t>(l));
  for (int l = 0; i < n; ++i, ++l) lane[l] += f(i);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// Σ x[i]^2 over n elements (float, bf16 or f16), as lane_sum adds them: the
// squared norms of tensor_stats rules.
template <class T>
double sum_squares(const T* x, std::size_t n) {
  return lane_sum(n, [&](std::size_t i) {
    const double v = to_float(x[i]);
    return v * v;
  });
}

// What the whole_tensor rules without statistics (muon, shampoo,
// adagrad_full) share: one stat pass with no statistics and a scratch. Such
// a rule derives from it and adds transform (its pointwise part, into the
// scratch), whole(c, shape, work, aux) (the step on the whole tensor, in the
// scratch) and apply_update, and may add check_param and kCompanion.
struct WholeTensorRule {
  static constexpr Locality kLocality = Locality::whole_tensor;
  static constexpr bool kEagerState = false;
  static constexpr int kStatPasses = 1;
  static constexpr bool kWorkspace = true;
  static constexpr bool kGroupStep = false;
  static constexpr std::span<const std::string_view> kOptimizerLevel{};
  static std::size_t num_stats(int, const Shape&) { return 0; }
  static bool global_pass(int) { return false; }
  template <class C>
  static void finish_pass(int, const Shape&, const double*, C&, float*) {}
  template <class T, class C>
  static void partial(const C&, int, const Typed<T>&, const Slice&, double*) {}
};

// The CPU loop of a pointwise rule M (element.hpp): element(c, s, i) for
// every i, one branch-free loop per combination of M's flags. The elements
// are independent (locality), which `ivdep` tells the vectorizer; the
// coefficients and pointers are copied to locals so they stay in registers.
template <class M, class T>
void cpu_loop(const typename M::Coeffs& coeffs, const Typed<T>& slice) {
  dispatch_mask<M::kFlags>(M::flags(coeffs), [&](auto... f) {
    const typename M::Coeffs c = coeffs;
    const Typed<T> s = slice;
#pragma GCC ivdep
    for (std::size_t i = 0; i < s.n; ++i) M::template element<decltype(f)::value...>(c, s, i);
  });
}

// The CPU loops of a tensor_stats rule's Math (element.hpp, "tensor_stats
// rules"): its transform of pass `pass` and its update over a slice.
template <class M, class T>
void cpu_transform(const typename M::Coeffs& coeffs, int pass, const Typed<T>& typed_slice, const Slice& slice) {
  const typename M::Coeffs c = coeffs;
  const Typed<T> s = typed_slice;
  const Place at = place_of(slice, slice.aux);
  float* const work = slice.work;
#pragma GCC ivdep
  for (std::size_t i = 0; i < s.n; ++i) M::template transform<T>(c, pass, s, at, work, i);
}
template <class M, class T>
void cpu_update(const typename M::Coeffs& coeffs, const Typed<T>& typed_slice, const float* work) {
  const typename M::Coeffs c = coeffs;
  const Typed<T> s = typed_slice;
#pragma GCC ivdep
  for (std::size_t i = 0; i < s.n; ++i) M::template update<T>(c, s, work, i);
}

// R's options as the registry lists them: the specs of its kOptions rows,
// whose members must match their defaults' kinds.
template <class R>
constexpr auto specs_of() {
  std::array<OptionSpec, std::size(R::kOptions)> specs{};
  for (std::size_t k = 0; k < specs.size(); ++k) {
    if (!R::kOptions[k].consistent()) throw "an option's members do not match its default's kind";
    specs[k] = R::kOptions[k].spec;
  }
  return specs;
}
template <class R>
inline constexpr auto kSpecsOf = specs_of<R>();

// R's Options from a complete map: R::parse where the rule reads words,
// else its kOptions table.
template <class R>
typename R::Options parse_of(const OptionMap& m) {
  if constexpr (requires { R::parse(m); }) return R::parse(m);
  else return read_options(R::kOptions, m);
}

// Builds the type-erased table from a rule struct R (see adam.cpp for the
// shape every rule has).
template <class R>
RuleInfo make_rule_info() {
  RuleInfo info{};
  info.name = R::kName;
  info.locality = R::kLocality;
  info.options = std::span<const OptionSpec>(kSpecsOf<R>);
  if constexpr (requires { R::kEagerState; }) info.eager_state = R::kEagerState;
  if constexpr (requires { R::kQuantized; })
    std::copy(std::begin(R::kQuantized), std::end(R::kQuantized), info.quantized.begin());
  if constexpr (requires { R::kMomentState; }) {
    // R::local_moment(options, m, g, p, out, n), R::variance_state(options),
    // R::frozen_denominator(options, v, frozen_at, out, n) and
    // R::prepare_frozen(options, scalars, frozen_at) -> Coeffs.
    static constexpr MomentForm kForm{
        R::kMomentState,
        [](const RuleBlob& parsed, const float* m, const float* g, const float* p, float* out, std::size_t n) {
          R::local_moment(parsed.as<typename R::Options>(), m, g, p, out, n);
        },
        [](const RuleBlob& parsed) { return R::variance_state(parsed.as<typename R::Options>()); },
        [](const RuleBlob& parsed, const float* v, std::uint64_t frozen_at, float* out, std::size_t n) {
          R::frozen_denominator(parsed.as<typename R::Options>(), v, frozen_at, out, n);
        },
        [](const RuleBlob& parsed, float* scalars, std::uint64_t frozen_at, RuleBlob& coeffs) {
          coeffs.as<typename R::Coeffs>() = R::prepare_frozen(parsed.as<typename R::Options>(), scalars, frozen_at);
        }};
    info.moment = &kForm;
  }
  info.validate = [](const OptionMap& m) { R::validate(parse_of<R>(m)); };
  info.layout = [](const OptionMap& m) { return R::layout(parse_of<R>(m)); };
  info.init = [](const OptionMap& m, float* fill, float* scalars) {
    if constexpr (requires { &R::init; }) {
      R::init(parse_of<R>(m), fill, scalars);
    } else {  // every state starts at zero
      const StateLayout l = R::layout(parse_of<R>(m));
      std::fill_n(fill, l.tensors.size(), 0.0f);
      std::fill_n(scalars, l.scalars.size(), 0.0f);
    }
  };
  info.parse = [](const OptionMap& m, RuleBlob& out) { out.as<typename R::Options>() = parse_of<R>(m); };
  info.prepare = [](const RuleBlob& parsed, float* scalars, bool fresh, RuleBlob& coeffs) {
    coeffs.as<typename R::Coeffs>() = R::prepare(parsed.as<typename R::Options>(), scalars, fresh);
  };
  info.apply = [](const RuleBlob& coeffs, const Slice& s) {
    const auto& c = coeffs.as<typename R::Coeffs>();
    dispatch_dtype(s.dtype, [&]<class T>() {
      if constexpr (requires { R::kStatPasses; })
        R::template apply_update<T>(c, typed<T>(s), s.work);
      else if constexpr (requires { R::kFlags; })
        cpu_loop<R, T>(c, typed<T>(s));
      else
        R::template kernel<T>(c, typed<T>(s));
    });
  };
  if constexpr (requires { R::kStatPasses; }) {
    // tensor_stats: R::num_stats(pass, shape), R::global_pass(pass),
    // R::transform<T>(c, pass, typed, slice), R::partial<T>(c, pass, typed,
    // slice, out), R::finish_pass(pass, shape, stats, c, aux), and
    // apply_update<T>(c, typed, work) in place of kernel; kGroupStep,
    // kOptimizerLevel; with kAux, aux_size, aux_parts and tensor_needed.
    info.group_step = R::kGroupStep;
    info.optimizer_level = std::span<const std::string_view>(R::kOptimizerLevel);
    info.stat_passes = R::kStatPasses;
    info.workspace = R::kWorkspace;
    info.num_stats = [](int pass, const Shape& shape) { return R::num_stats(pass, shape); };
    info.global_pass = [](int pass) { return R::global_pass(pass); };
    info.transform = [](const RuleBlob& coeffs, int pass, const Slice& s) {
      const auto& c = coeffs.as<typename R::Coeffs>();
      dispatch_dtype(s.dtype, [&]<class T>() { R::template transform<T>(c, pass, typed<T>(s), s); });
    };
    info.partial = [](const RuleBlob& coeffs, int pass, const Slice& s, double* out) {
      const auto& c = coeffs.as<typename R::Coeffs>();
      dispatch_dtype(s.dtype, [&]<class T>() { R::template partial<T>(c, pass, typed<T>(s), s, out); });
    };
    info.finish_pass = [](int pass, const Shape& shape, const double* stats, RuleBlob& coeffs, float* aux) {
      R::finish_pass(pass, shape, stats, coeffs.as<typename R::Coeffs>(), aux);
    };
    if constexpr (requires { &R::whole; }) {
      info.whole = [](RuleBlob& coeffs, int, const Shape& shape, float* work, float* aux) {
        R::whole(coeffs.as<typename R::Coeffs>(), shape, work, aux);
      };
    }
    if constexpr (requires { &R::check_param; }) info.check_param = &R::check_param;
    if constexpr (requires { R::kCompanion; }) info.companion = R::kCompanion;
    if constexpr (requires { R::kAux; }) {
      info.aux_size = [](const OptionMap& m, const Shape& shape) { return R::aux_size(parse_of<R>(m), shape); };
      info.aux_parts = [](const OptionMap& m, const Shape& shape) { return R::aux_parts(parse_of<R>(m), shape); };
      info.tensor_needed = [](const OptionMap& m, std::size_t k, const Shape& shape) {
        return R::tensor_needed(parse_of<R>(m), k, shape);
      };
    }
  }
  static_assert(std::is_trivially_copyable_v<typename R::Options>);
  static_assert(std::is_trivially_copyable_v<typename R::Coeffs>);
  return info;
}

// The one table of rule struct R, built on first use: a rule's file ends
// with `const RuleInfo& NAME_rule() { return rule_info_of<NameRule>(); }`.
template <class R>
const RuleInfo& rule_info_of() {
  static const RuleInfo info = make_rule_info<R>();
  return info;
}

}  // namespace distopt::rules

namespace distopt::rules {

// Calls f(std::bool_constant<b0>{}, std::bool_constant<b1>{}, ...): turns
// run-time flags into compile-time ones so each kernel variant is a plain,
// branch-free, vectorizable loop.
template <class F>
void dispatch_bools(F&& f) {
  f();
}
template <class F, class... B>
void dispatch_bools(F&& f, bool b, B... rest) {
  if (b) dispatch_bools([&](auto... xs) { f(std::true_type{}, xs...); }, rest...);
  else dispatch_bools([&](auto... xs) { f(std::false_type{}, xs...); }, rest...);
}

}  // namespace distopt::rules
