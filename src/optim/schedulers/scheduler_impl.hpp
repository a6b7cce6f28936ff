// Internals shared by the scheduler families of this folder (not
// installed): the state visitor, torch's small helpers, the option reader
// of make_scheduler, and the registry's entry type. A family's file holds
// its classes and their Maker entries; registry.cpp lists every entry once
// (docs/architecture.md, "Where to add: a scheduler"; docs/schedulers.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/core/error.hpp"
#include "distopt/optim/scheduler.hpp"

namespace distopt {

// Reads or writes a scheduler's state fields by name (one code path for
// state_dict and load_state_dict).
class StateVisitor {
 public:
  virtual ~StateVisitor() = default;
  virtual void field(std::string_view name, std::vector<double>& v, bool per_group) = 0;
  void field(std::string_view name, double& x) {
    std::vector<double> v{x};
    field(name, v, false);
    x = v[0];
  }
  void field(std::string_view name, long& x) {
    double d = static_cast<double>(x);
    field(name, d);
    x = static_cast<long>(d);
  }
  void groups(std::string_view name, std::vector<double>& v) { field(name, v, true); }
};

namespace schedulers {

inline constexpr double kPi = std::numbers::pi;

// Python's float %: the result takes the sign of the divisor.
inline double py_mod(double a, double b) {
  double r = std::fmod(a, b);
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

inline std::vector<double> broadcast(std::string_view name, const std::vector<double>& v, std::size_t groups) {
  if (v.size() == 1) return std::vector<double>(groups, v[0]);
  if (v.size() != groups)
    throw InvalidInput(str("expected ", groups, " values for ", name, ", got ", v.size()));
  return v;
}

inline bool has_option(const Optimizer& opt, std::string_view name) { return opt.defaults().count(name) != 0; }

inline double momentum_of(const Optimizer& opt, std::size_t g, bool beta1) {
  const OptionMap& o = opt.group(g).options;
  return beta1 ? o.at("betas").pair()[0] : o.at("momentum").number();
}

inline void set_momentum(Optimizer& opt, std::size_t g, bool beta1, double m) {
  if (beta1)
    opt.set_option(g, "betas", OptionValue(m, opt.group(g).options.at("betas").pair()[1]));
  else
    opt.set_option(g, "momentum", m);
}

inline double required_extra(const Optimizer& opt, std::size_t g, std::string_view key) {
  auto v = opt.extra(g, key);
  if (!v) throw InvalidInput(str("param '", key, "' is not specified in param_groups[", g, "]"));
  return *v;
}

// Reads a spec's options by name and type; every option must be read once
// (finish() rejects the rest).
class OptionReader {
 public:
  explicit OptionReader(const SchedulerSpec& spec) : spec_(spec) {}

  const SchedulerOption* find(std::string_view key) {
    used_.insert(std::string(key));
    auto it = spec_.options.find(key);
    return it == spec_.options.end() ? nullptr : &it->second;
  }
  [[noreturn]] void bad(std::string_view key, std::string_view want) const {
    throw InvalidInput(str(spec_.name, ": option ", key, " must be ", want));
  }
  std::optional<double> number(std::string_view key) {
    const SchedulerOption* v = find(key);
    if (!v) return std::nullopt;
    if (!std::holds_alternative<double>(*v)) bad(key, "a number");
    const double x = std::get<double>(*v);
    if (!std::isfinite(x)) bad(key, "finite");
    return x;
  }
  double number(std::string_view key, double def) { return number(key).value_or(def); }
  double required(std::string_view key) {
    auto x = number(key);
    if (!x) throw InvalidInput(str(spec_.name, ": option ", key, " is required"));
    return *x;
  }
  std::optional<long> integer(std::string_view key) {
    auto x = number(key);
    if (!x) return std::nullopt;
    if (*x != std::floor(*x) || std::abs(*x) > 1e15) bad(key, "an integer");
    return static_cast<long>(*x);
  }
  long integer(std::string_view key, long def) { return integer(key).value_or(def); }
  long required_integer(std::string_view key) {
    auto x = integer(key);
    if (!x) throw InvalidInput(str(spec_.name, ": option ", key, " is required"));
    return *x;
  }
  bool flag(std::string_view key, bool def) {
    const SchedulerOption* v = find(key);
    if (!v) return def;
    if (!std::holds_alternative<bool>(*v)) bad(key, "true or false");
    return std::get<bool>(*v);
  }
  std::string text(std::string_view key, std::string def) {
    const SchedulerOption* v = find(key);
    if (!v) return def;
    if (!std::holds_alternative<std::string>(*v)) bad(key, "a string");
    return std::get<std::string>(*v);
  }
  // A number, or a list of numbers (one per group).
  std::vector<double> numbers(std::string_view key, std::vector<double> def) {
    const SchedulerOption* v = find(key);
    if (!v) return def;
    if (std::holds_alternative<double>(*v)) return {std::get<double>(*v)};
    if (!std::holds_alternative<std::vector<double>>(*v)) bad(key, "a number or a list of numbers");
    const auto& list = std::get<std::vector<double>>(*v);
    if (list.empty()) bad(key, "a non-empty list");
    for (double x : list)
      if (!std::isfinite(x)) bad(key, "finite");
    return list;
  }
  std::vector<double> required_numbers(std::string_view key) {
    auto list = numbers(key, {});
    if (list.empty()) throw InvalidInput(str(spec_.name, ": option ", key, " is required"));
    return list;
  }
  std::vector<long> integers(std::string_view key) {
    const SchedulerOption* v = find(key);
    if (!v) throw InvalidInput(str(spec_.name, ": option ", key, " is required"));
    if (!std::holds_alternative<std::vector<double>>(*v)) bad(key, "a list of integers");
    std::vector<long> out;
    for (double x : std::get<std::vector<double>>(*v)) {
      if (x != std::floor(x) || std::abs(x) > 1e15) bad(key, "a list of integers");
      out.push_back(static_cast<long>(x));
    }
    return out;
  }
  void finish() const {
    for (const auto& [key, value] : spec_.options)
      if (!used_.count(key)) throw InvalidInput(str("unknown option '", key, "' for scheduler ", spec_.name));
  }

 private:
  const SchedulerSpec& spec_;
  std::set<std::string, std::less<>> used_;
};

// A registry entry: an LR scheduler (one SequentialLR may hold), or
// another kind (ReduceLROnPlateau, ChainedScheduler). A maker reads every
// option it takes from `r`, which has the spec's options, then calls
// r.finish().
using LRMaker = std::unique_ptr<LRScheduler> (*)(Optimizer& opt, const SchedulerSpec& spec, OptionReader& r);
using OtherMaker = std::unique_ptr<Scheduler> (*)(Optimizer& opt, const SchedulerSpec& spec, OptionReader& r);
struct Maker {
  std::string_view name;
  LRMaker lr = nullptr;
  OtherMaker other = nullptr;
  bool holds_schedulers = false;  // its spec's "schedulers" are its children
};

// The entries, by family (step.cpp, cosine.cpp, cyclic.cpp, plateau.cpp,
// composite.cpp, swa.cpp).
extern const Maker kStepLR, kMultiStepLR, kConstantLR, kLinearLR, kExponentialLR, kPolynomialLR;
extern const Maker kCosineAnnealingLR, kCosineAnnealingWarmRestarts;
extern const Maker kCyclicLR, kOneCycleLR;
extern const Maker kReduceLROnPlateau;
extern const Maker kSequentialLR, kChainedScheduler;
extern const Maker kSWALR;

// An LR scheduler from its spec (registry.cpp): SequentialLR's children.
std::unique_ptr<LRScheduler> make_lr_scheduler(Optimizer& opt, const SchedulerSpec& spec);

}  // namespace schedulers
}  // namespace distopt
