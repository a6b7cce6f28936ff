// make_scheduler: schedulers by lower-cased torch class name and
// torch-named options (replay cases, `distopt train --scheduler`).
#include <algorithm>
#include <cmath>
#include <set>

#include "distopt/core/error.hpp"
#include "distopt/optim/scheduler.hpp"

namespace distopt {
namespace {

constexpr std::string_view kNames[] = {
    "steplr",     "multisteplr", "constantlr",         "linearlr",         "exponentiallr",
    "polynomiallr", "cosineannealinglr", "cosineannealingwarmrestarts", "cycliclr", "onecyclelr",
    "reducelronplateau", "sequentiallr", "chainedscheduler", "swalr"};

// Reads a spec's options by name and type; every option must be read once
// (finish() rejects the rest).
class Reader {
 public:
  explicit Reader(const SchedulerSpec& spec) : spec_(spec) {}

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

std::unique_ptr<LRScheduler> make_lr_scheduler(Optimizer& opt, const SchedulerSpec& spec);

std::unique_ptr<Scheduler> build(Optimizer& opt, const SchedulerSpec& spec) {
  if (spec.name == "reducelronplateau") {
    Reader r(spec);
    ReduceLROnPlateauOptions o;
    o.mode = r.text("mode", o.mode);
    o.factor = r.number("factor", o.factor);
    o.patience = r.integer("patience", o.patience);
    o.threshold = r.number("threshold", o.threshold);
    o.threshold_mode = r.text("threshold_mode", o.threshold_mode);
    o.cooldown = r.integer("cooldown", o.cooldown);
    o.min_lr = r.numbers("min_lr", o.min_lr);
    o.eps = r.number("eps", o.eps);
    r.finish();
    if (!spec.schedulers.empty()) throw InvalidInput("reducelronplateau takes no schedulers");
    return std::make_unique<ReduceLROnPlateau>(opt, std::move(o));
  }
  if (spec.name == "chainedscheduler") {
    Reader r(spec);
    r.finish();
    if (spec.schedulers.empty()) throw InvalidInput("chainedscheduler: schedulers is required (a non-empty list)");
    std::vector<std::unique_ptr<Scheduler>> children;
    for (const auto& c : spec.schedulers) children.push_back(build(opt, c));
    return std::make_unique<ChainedScheduler>(opt, std::move(children));
  }
  return make_lr_scheduler(opt, spec);
}

std::unique_ptr<LRScheduler> make_lr_scheduler(Optimizer& opt, const SchedulerSpec& spec) {
  const std::string& n = spec.name;
  if (std::find(std::begin(kNames), std::end(kNames), n) == std::end(kNames))
    throw InvalidInput(str("unknown scheduler '", n, "'"));
  if (n == "reducelronplateau" || n == "chainedscheduler")
    throw InvalidInput(str("sequentiallr cannot hold ", n));
  if (n != "sequentiallr" && !spec.schedulers.empty()) throw InvalidInput(str(n, " takes no schedulers"));
  Reader r(spec);
  std::unique_ptr<LRScheduler> s;
  if (n == "steplr") {
    const long step_size = r.required_integer("step_size");
    const double gamma = r.number("gamma", 0.1);
    r.finish();
    s = std::make_unique<StepLR>(opt, step_size, gamma);
  } else if (n == "multisteplr") {
    auto milestones = r.integers("milestones");
    const double gamma = r.number("gamma", 0.1);
    r.finish();
    s = std::make_unique<MultiStepLR>(opt, std::move(milestones), gamma);
  } else if (n == "constantlr") {
    const double factor = r.number("factor", 1.0 / 3);
    const long total = r.integer("total_iters", 5);
    r.finish();
    s = std::make_unique<ConstantLR>(opt, factor, total);
  } else if (n == "linearlr") {
    const double start = r.number("start_factor", 1.0 / 3), end = r.number("end_factor", 1.0);
    const long total = r.integer("total_iters", 5);
    r.finish();
    s = std::make_unique<LinearLR>(opt, start, end, total);
  } else if (n == "exponentiallr") {
    const double gamma = r.required("gamma");
    r.finish();
    s = std::make_unique<ExponentialLR>(opt, gamma);
  } else if (n == "polynomiallr") {
    const long total = r.integer("total_iters", 5);
    const double power = r.number("power", 1.0);
    r.finish();
    s = std::make_unique<PolynomialLR>(opt, total, power);
  } else if (n == "cosineannealinglr") {
    const double t_max = r.required("T_max");
    const double eta_min = r.number("eta_min", 0.0);
    r.finish();
    s = std::make_unique<CosineAnnealingLR>(opt, t_max, eta_min);
  } else if (n == "cosineannealingwarmrestarts") {
    const long t0 = r.required_integer("T_0");
    const long mult = r.integer("T_mult", 1);
    const double eta_min = r.number("eta_min", 0.0);
    r.finish();
    s = std::make_unique<CosineAnnealingWarmRestarts>(opt, t0, mult, eta_min);
  } else if (n == "cycliclr") {
    CyclicLROptions o;
    o.base_lr = r.required_numbers("base_lr");
    o.max_lr = r.required_numbers("max_lr");
    o.step_size_up = r.number("step_size_up", o.step_size_up);
    o.step_size_down = r.number("step_size_down");
    o.mode = r.text("mode", o.mode);
    o.gamma = r.number("gamma", o.gamma);
    o.scale_mode = r.text("scale_mode", o.scale_mode);
    o.cycle_momentum = r.flag("cycle_momentum", o.cycle_momentum);
    o.base_momentum = r.numbers("base_momentum", o.base_momentum);
    o.max_momentum = r.numbers("max_momentum", o.max_momentum);
    r.finish();
    s = std::make_unique<CyclicLR>(opt, std::move(o));
  } else if (n == "onecyclelr") {
    OneCycleLROptions o;
    o.max_lr = r.required_numbers("max_lr");
    o.total_steps = r.integer("total_steps");
    o.epochs = r.integer("epochs");
    o.steps_per_epoch = r.integer("steps_per_epoch");
    o.pct_start = r.number("pct_start", o.pct_start);
    o.anneal_strategy = r.text("anneal_strategy", o.anneal_strategy);
    o.cycle_momentum = r.flag("cycle_momentum", o.cycle_momentum);
    o.base_momentum = r.numbers("base_momentum", o.base_momentum);
    o.max_momentum = r.numbers("max_momentum", o.max_momentum);
    o.div_factor = r.number("div_factor", o.div_factor);
    o.final_div_factor = r.number("final_div_factor", o.final_div_factor);
    o.three_phase = r.flag("three_phase", o.three_phase);
    r.finish();
    s = std::make_unique<OneCycleLR>(opt, std::move(o));
  } else if (n == "swalr") {
    auto swa_lr = r.required_numbers("swa_lr");
    const long anneal_epochs = r.integer("anneal_epochs", 10);
    const std::string strategy = r.text("anneal_strategy", "cos");
    r.finish();
    s = std::make_unique<SWALR>(opt, std::move(swa_lr), anneal_epochs, strategy);
  } else {  // sequentiallr
    auto milestones = r.integers("milestones");
    r.finish();
    if (spec.schedulers.empty()) throw InvalidInput("sequentiallr: schedulers is required (a non-empty list)");
    std::vector<std::unique_ptr<LRScheduler>> children;
    for (const auto& c : spec.schedulers) {
      if (c.name == "sequentiallr") throw InvalidInput("sequentiallr cannot hold a sequentiallr");
      children.push_back(make_lr_scheduler(opt, c));
    }
    s = std::make_unique<SequentialLR>(opt, std::move(children), std::move(milestones));
  }
  return s;
}

}  // namespace

std::span<const std::string_view> scheduler_names() { return kNames; }

std::unique_ptr<Scheduler> make_scheduler(Optimizer& opt, const SchedulerSpec& spec) { return build(opt, spec); }

}  // namespace distopt
