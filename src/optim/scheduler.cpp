#include "distopt/optim/scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "distopt/core/error.hpp"

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

namespace {

constexpr double kPi = std::numbers::pi;

// Python's float %: the result takes the sign of the divisor.
double py_mod(double a, double b) {
  double r = std::fmod(a, b);
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

class SaveVisitor final : public StateVisitor {
 public:
  explicit SaveVisitor(SchedulerState& s) : s_(s) {}
  void field(std::string_view name, std::vector<double>& v, bool) override { s_.values[std::string(name)] = v; }

 private:
  SchedulerState& s_;
};

class LoadVisitor final : public StateVisitor {
 public:
  LoadVisitor(const SchedulerState& s, bool apply, std::size_t groups) : s_(s), apply_(apply), groups_(groups) {}
  void field(std::string_view name, std::vector<double>& v, bool per_group) override {
    auto it = s_.values.find(name);
    if (it == s_.values.end())
      throw InvalidInput(str("scheduler state of ", s_.kind, " lacks '", name, "'"));
    const std::size_t want = per_group ? groups_ : v.size();
    if (it->second.size() != want)
      throw InvalidInput(str("scheduler state '", name, "' of ", s_.kind, " has ", it->second.size(),
                             " values, expected ", want));
    if (apply_) v = it->second;
  }

 private:
  const SchedulerState& s_;
  bool apply_;
  std::size_t groups_;
};

std::vector<double> broadcast(std::string_view name, const std::vector<double>& v, std::size_t groups) {
  if (v.size() == 1) return std::vector<double>(groups, v[0]);
  if (v.size() != groups)
    throw InvalidInput(str("expected ", groups, " values for ", name, ", got ", v.size()));
  return v;
}

bool has_option(const Optimizer& opt, std::string_view name) { return opt.defaults().count(name) != 0; }

double momentum_of(const Optimizer& opt, std::size_t g, bool beta1) {
  const OptionMap& o = opt.group(g).options;
  return beta1 ? o.at("betas").pair()[0] : o.at("momentum").number();
}

void set_momentum(Optimizer& opt, std::size_t g, bool beta1, double m) {
  if (beta1)
    opt.set_option(g, "betas", OptionValue(m, opt.group(g).options.at("betas").pair()[1]));
  else
    opt.set_option(g, "momentum", m);
}

double required_extra(const Optimizer& opt, std::size_t g, std::string_view key) {
  auto v = opt.extra(g, key);
  if (!v) throw InvalidInput(str("param '", key, "' is not specified in param_groups[", g, "]"));
  return *v;
}

}  // namespace

// ---------------------------------------------------------------- Scheduler

void Scheduler::step() { throw InvalidInput(str(name(), " is stepped with a metric: step(metric)")); }
void Scheduler::step(double) { throw InvalidInput(str(name(), " takes no metric: step()")); }

std::vector<double> Scheduler::group_lrs() const {
  std::vector<double> lrs(opt_.num_groups());
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = opt_.lr(g);
  return lrs;
}

void Scheduler::visit(StateVisitor& v) { v.groups("_last_lr", last_lr_); }

SchedulerState Scheduler::state_dict() const {
  SchedulerState s;
  s.kind = std::string(name());
  SaveVisitor v(s);
  const_cast<Scheduler*>(this)->visit(v);  // SaveVisitor only reads
  return s;
}

void Scheduler::load_pass(const SchedulerState& state, bool apply) {
  if (state.kind != name())
    throw InvalidInput(str("scheduler state is of ", state.kind.empty() ? "(none)" : state.kind, ", not ", name()));
  LoadVisitor v(state, apply, opt_.num_groups());
  visit(v);
}

void Scheduler::load_state_dict(const SchedulerState& state) {
  load_pass(state, false);
  load_pass(state, true);
}

// -------------------------------------------------------------- LRScheduler

LRScheduler::LRScheduler(Optimizer& opt, long last_epoch) : Scheduler(opt), last_epoch_(last_epoch) {
  if (last_epoch < -1) throw InvalidInput(str("last_epoch must be -1 or a step count, got ", last_epoch));
  base_lrs_.resize(opt.num_groups());
  for (std::size_t g = 0; g < opt.num_groups(); ++g) {
    if (last_epoch == -1) {
      if (!opt.extra(g, "initial_lr")) opt.set_extra(g, "initial_lr", opt.lr(g));
    } else if (!opt.extra(g, "initial_lr")) {
      throw InvalidInput(
          str("param 'initial_lr' is not specified in param_groups[", g, "] when resuming an optimizer"));
    }
    base_lrs_[g] = *opt.extra(g, "initial_lr");
  }
}

void LRScheduler::initial_step() {
  step_count_ = 0;
  step();
}

void LRScheduler::apply_lrs(const std::vector<double>& lrs) {
  for (std::size_t g = 0; g < lrs.size(); ++g) opt_.set_lr(g, lrs[g]);
  last_lr_ = group_lrs();
}

void LRScheduler::step() {
  ++step_count_;
  ++last_epoch_;
  apply_lrs(get_lr());
}

void LRScheduler::step_at(long epoch) {
  ++step_count_;
  last_epoch_ = epoch;
  auto closed = closed_form_lr();
  apply_lrs(closed ? *closed : get_lr());
}

void LRScheduler::visit(StateVisitor& v) {
  Scheduler::visit(v);
  v.groups("base_lrs", base_lrs_);
  v.field("last_epoch", last_epoch_);
  v.field("_step_count", step_count_);
}

// ------------------------------------------------------- Lambda schedulers

namespace {
template <class Fn>
std::vector<Fn> per_group_fns(std::vector<Fn> fns, std::size_t groups) {
  if (fns.size() == 1) return std::vector<Fn>(groups, fns[0]);
  if (fns.size() != groups) throw InvalidInput(str("Expected ", groups, " lr_lambdas, but got ", fns.size()));
  for (const auto& f : fns)
    if (!f) throw InvalidInput("lr_lambda must be callable");
  return fns;
}
}  // namespace

LambdaLR::LambdaLR(Optimizer& opt, std::vector<Fn> lr_lambdas, long last_epoch)
    : LRScheduler(opt, last_epoch), fns_(per_group_fns(std::move(lr_lambdas), opt.num_groups())) {
  initial_step();
}

std::vector<double> LambdaLR::get_lr() {
  std::vector<double> lrs(base_lrs_.size());
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] * fns_[g](last_epoch_);
  return lrs;
}

MultiplicativeLR::MultiplicativeLR(Optimizer& opt, std::vector<Fn> lr_lambdas, long last_epoch)
    : LRScheduler(opt, last_epoch), fns_(per_group_fns(std::move(lr_lambdas), opt.num_groups())) {
  initial_step();
}

std::vector<double> MultiplicativeLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ > 0)
    for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] *= fns_[g](last_epoch_);
  return lrs;
}

// ----------------------------------------------------------- Step, MultiStep

StepLR::StepLR(Optimizer& opt, long step_size, double gamma, long last_epoch)
    : LRScheduler(opt, last_epoch), step_size_(static_cast<double>(step_size)), gamma_(gamma) {
  if (step_size < 1) throw InvalidInput(str("step_size must be a positive integer, got ", step_size));
  initial_step();
}

std::vector<double> StepLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0 || last_epoch_ % static_cast<long>(step_size_) != 0) return lrs;
  for (double& lr : lrs) lr *= gamma_;
  return lrs;
}

std::optional<std::vector<double>> StepLR::closed_form_lr() {
  std::vector<double> lrs = base_lrs_;
  const double k = std::floor(static_cast<double>(last_epoch_) / step_size_);
  for (double& lr : lrs) lr *= std::pow(gamma_, k);
  return lrs;
}

void StepLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("step_size", step_size_);
  v.field("gamma", gamma_);
}

MultiStepLR::MultiStepLR(Optimizer& opt, std::vector<long> milestones, double gamma, long last_epoch)
    : LRScheduler(opt, last_epoch), milestones_(milestones.begin(), milestones.end()), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  initial_step();
}

std::vector<double> MultiStepLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  const auto e = static_cast<double>(last_epoch_);
  const auto count = std::count(milestones_.begin(), milestones_.end(), e);
  if (count == 0) return lrs;
  for (double& lr : lrs) lr *= std::pow(gamma_, static_cast<double>(count));
  return lrs;
}

std::optional<std::vector<double>> MultiStepLR::closed_form_lr() {
  const auto k = std::upper_bound(milestones_.begin(), milestones_.end(), static_cast<double>(last_epoch_)) -
                 milestones_.begin();
  std::vector<double> lrs = base_lrs_;
  for (double& lr : lrs) lr *= std::pow(gamma_, static_cast<double>(k));
  return lrs;
}

void MultiStepLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("milestones", milestones_, false);
  v.field("gamma", gamma_);
}

// ------------------------------------------------------------ Constant, Linear

ConstantLR::ConstantLR(Optimizer& opt, double factor, long total_iters, long last_epoch)
    : LRScheduler(opt, last_epoch), factor_(factor), total_iters_(static_cast<double>(total_iters)) {
  if (factor > 1.0 || factor < 0) throw InvalidInput("Constant multiplicative factor expected to be between 0 and 1.");
  if (factor == 0) throw InvalidInput("ConstantLR factor 0 would divide by zero when the constant phase ends");
  if (total_iters < 0) throw InvalidInput(str("total_iters must be >= 0, got ", total_iters));
  initial_step();
}

std::vector<double> ConstantLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  const auto e = static_cast<double>(last_epoch_);
  if (e == 0) {
    for (double& lr : lrs) lr *= factor_;
  } else if (e == total_iters_) {
    for (double& lr : lrs) lr *= 1.0 / factor_;
  }
  return lrs;
}

std::optional<std::vector<double>> ConstantLR::closed_form_lr() {
  std::vector<double> lrs = base_lrs_;
  const double on = static_cast<double>(last_epoch_) >= total_iters_ ? 1.0 : 0.0;
  for (double& lr : lrs) lr *= factor_ + on * (1 - factor_);
  return lrs;
}

void ConstantLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("factor", factor_);
  v.field("total_iters", total_iters_);
}

LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, long total_iters, long last_epoch)
    : LRScheduler(opt, last_epoch), start_(start_factor), end_(end_factor), total_iters_(static_cast<double>(total_iters)) {
  if (start_factor > 1.0 || start_factor <= 0)
    throw InvalidInput("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.");
  if (end_factor > 1.0 || end_factor < 0)
    throw InvalidInput("Ending multiplicative factor expected to be between 0 and 1.");
  if (total_iters < 1) throw InvalidInput(str("total_iters must be a positive integer, got ", total_iters));
  initial_step();
}

std::vector<double> LinearLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  const auto e = static_cast<double>(last_epoch_);
  if (e == 0) {
    for (double& lr : lrs) lr *= start_;
  } else if (e <= total_iters_) {
    const double f = 1.0 + (end_ - start_) / (total_iters_ * start_ + (e - 1) * (end_ - start_));
    for (double& lr : lrs) lr *= f;
  }
  return lrs;
}

std::optional<std::vector<double>> LinearLR::closed_form_lr() {
  std::vector<double> lrs = base_lrs_;
  const double e = std::min(total_iters_, static_cast<double>(last_epoch_));
  for (double& lr : lrs) lr *= start_ + (end_ - start_) * e / total_iters_;
  return lrs;
}

void LinearLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("start_factor", start_);
  v.field("end_factor", end_);
  v.field("total_iters", total_iters_);
}

// ------------------------------------------------------ Exponential, Polynomial

ExponentialLR::ExponentialLR(Optimizer& opt, double gamma, long last_epoch) : LRScheduler(opt, last_epoch), gamma_(gamma) {
  initial_step();
}

std::vector<double> ExponentialLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ != 0)
    for (double& lr : lrs) lr *= gamma_;
  return lrs;
}

std::optional<std::vector<double>> ExponentialLR::closed_form_lr() {
  std::vector<double> lrs = base_lrs_;
  for (double& lr : lrs) lr *= std::pow(gamma_, static_cast<double>(last_epoch_));
  return lrs;
}

void ExponentialLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("gamma", gamma_);
}

PolynomialLR::PolynomialLR(Optimizer& opt, long total_iters, double power, long last_epoch)
    : LRScheduler(opt, last_epoch), total_iters_(static_cast<double>(total_iters)), power_(power) {
  if (total_iters < 1) throw InvalidInput(str("total_iters must be a positive integer, got ", total_iters));
  initial_step();
}

std::vector<double> PolynomialLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  const auto e = static_cast<double>(last_epoch_);
  if (e == 0 || e > total_iters_) return lrs;
  const double f = std::pow((1.0 - e / total_iters_) / (1.0 - (e - 1) / total_iters_), power_);
  for (double& lr : lrs) lr *= f;
  return lrs;
}

std::optional<std::vector<double>> PolynomialLR::closed_form_lr() {
  std::vector<double> lrs = base_lrs_;
  const double e = std::min(total_iters_, static_cast<double>(last_epoch_));
  for (double& lr : lrs) lr *= std::pow(1.0 - e / total_iters_, power_);
  return lrs;
}

void PolynomialLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("total_iters", total_iters_);
  v.field("power", power_);
}

// ------------------------------------------------------------------- Cosine

CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, double T_max, double eta_min, long last_epoch)
    : LRScheduler(opt, last_epoch), t_max_(T_max), eta_min_(eta_min) {
  if (!(T_max > 0)) throw InvalidInput(str("T_max must be positive, got ", T_max));
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  const auto e = static_cast<double>(last_epoch_);
  if (e == 0) return lrs;
  if (step_count_ == 1 && e > 0) return *closed_form_lr();
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    if (py_mod(e - 1 - t_max_, 2 * t_max_) == 0)
      lrs[g] = lrs[g] + (base_lrs_[g] - eta_min_) * (1 - std::cos(kPi / t_max_)) / 2;
    else
      lrs[g] = (1 + std::cos(kPi * e / t_max_)) / (1 + std::cos(kPi * (e - 1) / t_max_)) * (lrs[g] - eta_min_) +
               eta_min_;
  }
  return lrs;
}

std::optional<std::vector<double>> CosineAnnealingLR::closed_form_lr() {
  std::vector<double> lrs = base_lrs_;
  const auto e = static_cast<double>(last_epoch_);
  for (double& lr : lrs) lr = eta_min_ + (lr - eta_min_) * (1 + std::cos(kPi * e / t_max_)) / 2;
  return lrs;
}

void CosineAnnealingLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("T_max", t_max_);
  v.field("eta_min", eta_min_);
}

CosineAnnealingWarmRestarts::CosineAnnealingWarmRestarts(Optimizer& opt, long T_0, long T_mult, double eta_min,
                                                         long last_epoch)
    : LRScheduler(opt, last_epoch),
      t_0_(static_cast<double>(T_0)),
      t_i_(static_cast<double>(T_0)),
      t_mult_(static_cast<double>(T_mult)),
      eta_min_(eta_min),
      t_cur_(static_cast<double>(last_epoch)) {
  if (T_0 <= 0) throw InvalidInput(str("Expected positive integer T_0, but got ", T_0));
  if (T_mult < 1) throw InvalidInput(str("Expected integer T_mult >= 1, but got ", T_mult));
  initial_step();
}

std::vector<double> CosineAnnealingWarmRestarts::get_lr() {
  std::vector<double> lrs = base_lrs_;
  for (double& lr : lrs) lr = eta_min_ + (lr - eta_min_) * (1 + std::cos(kPi * t_cur_ / t_i_)) / 2;
  return lrs;
}

void CosineAnnealingWarmRestarts::step() {
  if (last_epoch_ < 0) {
    step_epoch(0);
    return;
  }
  t_cur_ += 1;
  if (t_cur_ >= t_i_) {
    t_cur_ -= t_i_;
    t_i_ *= t_mult_;
  }
  last_epoch_ += 1;
  apply_lrs(get_lr());
}

void CosineAnnealingWarmRestarts::step_epoch(double epoch) {
  if (!(epoch >= 0)) throw InvalidInput(str("Expected non-negative epoch, but got ", epoch));
  if (epoch >= t_0_) {
    if (t_mult_ == 1) {
      t_cur_ = py_mod(epoch, t_0_);
    } else {
      const double n = std::floor(std::log(epoch / t_0_ * (t_mult_ - 1) + 1) / std::log(t_mult_));
      t_cur_ = epoch - t_0_ * (std::pow(t_mult_, n) - 1) / (t_mult_ - 1);
      t_i_ = t_0_ * std::pow(t_mult_, n);
    }
  } else {
    t_i_ = t_0_;
    t_cur_ = epoch;
  }
  last_epoch_ = static_cast<long>(std::floor(epoch));
  apply_lrs(get_lr());
}

void CosineAnnealingWarmRestarts::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("T_0", t_0_);
  v.field("T_i", t_i_);
  v.field("T_mult", t_mult_);
  v.field("eta_min", eta_min_);
  v.field("T_cur", t_cur_);
}

// ------------------------------------------------------------------- Cyclic

namespace {
Optimizer& cyclic_prepare(Optimizer& opt, const CyclicLROptions& o, long last_epoch) {
  if (o.base_lr.empty()) throw InvalidInput("cycliclr: base_lr is required");
  if (o.max_lr.empty()) throw InvalidInput("cycliclr: max_lr is required");
  // Torch writes base_lr into the groups before the base class reads initial_lr.
  if (last_epoch == -1) {
    const auto base = broadcast("base_lr", o.base_lr, opt.num_groups());
    for (std::size_t g = 0; g < base.size(); ++g) opt.set_lr(g, base[g]);
  }
  return opt;
}
}  // namespace

CyclicLR::CyclicLR(Optimizer& opt, CyclicLROptions options, long last_epoch)
    : LRScheduler(cyclic_prepare(opt, options, last_epoch), last_epoch), o_(std::move(options)) {
  const std::size_t groups = opt.num_groups();
  const auto base_lrs = broadcast("base_lr", o_.base_lr, groups);
  max_lrs_ = broadcast("max_lr", o_.max_lr, groups);
  if (!(o_.step_size_up > 0)) throw InvalidInput(str("step_size_up must be positive, got ", o_.step_size_up));
  const double down = o_.step_size_down.value_or(o_.step_size_up);
  if (!(down >= 0)) throw InvalidInput(str("step_size_down must be >= 0, got ", down));
  total_size_ = o_.step_size_up + down;
  step_ratio_ = o_.step_size_up / total_size_;
  if (!o_.scale_fn) {
    if (o_.mode != "triangular" && o_.mode != "triangular2" && o_.mode != "exp_range")
      throw InvalidInput(str("mode is invalid and scale_fn is None (mode '", o_.mode, "')"));
    o_.scale_mode = o_.mode == "exp_range" ? "iterations" : "cycle";
  } else if (o_.scale_mode != "cycle" && o_.scale_mode != "iterations") {
    throw InvalidInput(str("scale_mode must be 'cycle' or 'iterations', got '", o_.scale_mode, "'"));
  }
  if (o_.cycle_momentum) {
    if (!has_option(opt, "momentum") && !has_option(opt, "betas"))
      throw InvalidInput("optimizer must support momentum or beta1 with `cycle_momentum` option enabled");
    use_beta1_ = has_option(opt, "betas");
    const auto base_m = broadcast("base_momentum", o_.base_momentum, groups);
    if (last_epoch == -1)
      for (std::size_t g = 0; g < groups; ++g) set_momentum(opt, g, use_beta1_, base_m[g]);
    base_momentums_.resize(groups);
    for (std::size_t g = 0; g < groups; ++g) base_momentums_[g] = momentum_of(opt, g, use_beta1_);
    max_momentums_ = broadcast("max_momentum", o_.max_momentum, groups);
  }
  // Torch's initial step runs with base_lrs = initial_lr, then sets base_lrs.
  initial_step();
  base_lrs_ = base_lrs;
}

double CyclicLR::scale(double x) const {
  if (o_.scale_fn) return o_.scale_fn(x);
  if (o_.mode == "triangular") return 1.0;
  if (o_.mode == "triangular2") return 1 / std::pow(2.0, x - 1);
  return std::pow(o_.gamma, x);
}

std::vector<double> CyclicLR::get_lr() {
  const auto e = static_cast<double>(last_epoch_);
  const double cycle = std::floor(1 + e / total_size_);
  const double x = 1.0 + e / total_size_ - cycle;
  const double s = x <= step_ratio_ ? x / step_ratio_ : (x - 1) / (step_ratio_ - 1);
  const double arg = o_.scale_mode == "cycle" ? cycle : e;
  std::vector<double> lrs(base_lrs_.size());
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] + (max_lrs_[g] - base_lrs_[g]) * s * scale(arg);
  if (o_.cycle_momentum)
    for (std::size_t g = 0; g < lrs.size(); ++g)
      set_momentum(opt_, g, use_beta1_,
                   max_momentums_[g] - (max_momentums_[g] - base_momentums_[g]) * s * scale(arg));
  return lrs;
}

void CyclicLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.groups("max_lrs", max_lrs_);
  v.field("total_size", total_size_);
  v.field("step_ratio", step_ratio_);
  v.field("gamma", o_.gamma);
  if (o_.cycle_momentum) {
    v.groups("base_momentums", base_momentums_);
    v.groups("max_momentums", max_momentums_);
  }
}

// ----------------------------------------------------------------- OneCycle

namespace {
double one_cycle_total(const OneCycleLROptions& o) {
  if (o.total_steps) {
    if (*o.total_steps <= 0)
      throw InvalidInput(str("Expected positive integer total_steps, but got ", *o.total_steps));
    return static_cast<double>(*o.total_steps);
  }
  if (!o.epochs || !o.steps_per_epoch)
    throw InvalidInput("You must define either total_steps OR (epochs AND steps_per_epoch)");
  if (*o.epochs <= 0) throw InvalidInput(str("Expected positive integer epochs, but got ", *o.epochs));
  if (*o.steps_per_epoch <= 0)
    throw InvalidInput(str("Expected positive integer steps_per_epoch, but got ", *o.steps_per_epoch));
  return static_cast<double>(*o.epochs * *o.steps_per_epoch);
}

Optimizer& one_cycle_prepare(Optimizer& opt, const OneCycleLROptions& o, long last_epoch) {
  (void)one_cycle_total(o);
  if (o.pct_start < 0 || o.pct_start > 1)
    throw InvalidInput(str("Expected float between 0 and 1 pct_start, but got ", o.pct_start));
  if (o.anneal_strategy != "cos" && o.anneal_strategy != "linear")
    throw InvalidInput(str("anneal_strategy must by one of 'cos' or 'linear', instead got ", o.anneal_strategy));
  if (o.max_lr.empty()) throw InvalidInput("onecyclelr: max_lr is required");
  const std::size_t groups = opt.num_groups();
  const auto max_lrs = broadcast("max_lr", o.max_lr, groups);
  if (last_epoch == -1)
    for (std::size_t g = 0; g < groups; ++g) {
      opt.set_extra(g, "initial_lr", max_lrs[g] / o.div_factor);
      opt.set_extra(g, "max_lr", max_lrs[g]);
      opt.set_extra(g, "min_lr", max_lrs[g] / o.div_factor / o.final_div_factor);
    }
  if (o.cycle_momentum) {
    if (!has_option(opt, "momentum") && !has_option(opt, "betas"))
      throw InvalidInput("optimizer must support momentum with `cycle_momentum` option enabled");
    const bool beta1 = has_option(opt, "betas");
    const auto max_m = broadcast("max_momentum", o.max_momentum, groups);
    const auto base_m = broadcast("base_momentum", o.base_momentum, groups);
    if (last_epoch == -1)
      for (std::size_t g = 0; g < groups; ++g) {
        set_momentum(opt, g, beta1, max_m[g]);
        opt.set_extra(g, "max_momentum", max_m[g]);
        opt.set_extra(g, "base_momentum", base_m[g]);
      }
  }
  return opt;
}
}  // namespace

OneCycleLR::OneCycleLR(Optimizer& opt, OneCycleLROptions options, long last_epoch)
    : LRScheduler(one_cycle_prepare(opt, options, last_epoch), last_epoch),
      o_(std::move(options)),
      total_steps_(one_cycle_total(o_)),
      use_beta1_(o_.cycle_momentum && has_option(opt, "betas")) {
  const double pct_steps = o_.pct_start * total_steps_;
  if (o_.three_phase)
    phases_ = {{pct_steps - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
               {2 * o_.pct_start * total_steps_ - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"},
               {total_steps_ - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"}};
  else
    phases_ = {{pct_steps - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
               {total_steps_ - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"}};
  initial_step();
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (o_.anneal_strategy == "cos") return end + (start - end) / 2.0 * (std::cos(kPi * pct) + 1);
  return (end - start) * pct + start;
}

std::vector<double> OneCycleLR::get_lr() {
  const auto step = static_cast<double>(last_epoch_);
  if (step > total_steps_)
    throw InvalidInput(str("Tried to step ", last_epoch_ + 1, " times. The specified number of total steps is ",
                           static_cast<long>(total_steps_)));
  std::vector<double> lrs(opt_.num_groups());
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    double start_step = 0, lr = 0, momentum = 0;
    for (std::size_t i = 0; i < phases_.size(); ++i) {
      const Phase& p = phases_[i];
      if (step <= p.end_step || i + 1 == phases_.size()) {
        const double pct = (step - start_step) / (p.end_step - start_step);
        lr = anneal(required_extra(opt_, g, p.start_lr), required_extra(opt_, g, p.end_lr), pct);
        if (o_.cycle_momentum)
          momentum = anneal(required_extra(opt_, g, p.start_momentum), required_extra(opt_, g, p.end_momentum), pct);
        break;
      }
      start_step = p.end_step;
    }
    lrs[g] = lr;
    if (o_.cycle_momentum) set_momentum(opt_, g, use_beta1_, momentum);
  }
  return lrs;
}

void OneCycleLR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("total_steps", total_steps_);
}

// ------------------------------------------------------ Sequential, Chained

SequentialLR::SequentialLR(Optimizer& opt, std::vector<std::unique_ptr<LRScheduler>> schedulers,
                           std::vector<long> milestones, long last_epoch)
    : LRScheduler(opt, last_epoch), children_(std::move(schedulers)), milestones_(milestones.begin(), milestones.end()) {
  if (children_.empty()) throw InvalidInput("sequentiallr needs at least one scheduler");
  for (std::size_t i = 0; i < children_.size(); ++i) {
    if (!children_[i]) throw InvalidInput(str("sequentiallr: scheduler ", i, " is null"));
    if (&children_[i]->optimizer() != &opt)
      throw InvalidInput(str("Sequential Schedulers expects all schedulers to belong to the same optimizer, but got "
                             "schedulers at index ", i, " to be different than the optimizer passed in."));
    if (children_[i]->name() == "sequentiallr")
      throw InvalidInput("sequentiallr cannot hold a sequentiallr (torch 1.13 cannot step it at a milestone)");
  }
  if (milestones_.size() != children_.size() - 1)
    throw InvalidInput(str("Sequential Schedulers expects number of schedulers provided to be one more than the "
                           "number of milestone points, but got number of schedulers ", children_.size(),
                           " and the number of milestones to be equal to ", milestones_.size()));
  last_epoch_ = last_epoch + 1;
  for (std::size_t g = 0; g < opt.num_groups(); ++g) opt.set_lr(g, base_lrs_[g]);
  for (auto& c : children_) c->last_epoch_ -= 1;
  children_[0]->initial_step();
  last_lr_ = children_[0]->last_lr();
}

std::vector<double> SequentialLR::get_lr() { return group_lrs(); }  // not used: step() is its own

void SequentialLR::step() {
  ++last_epoch_;
  const auto e = static_cast<double>(last_epoch_);
  const auto idx = static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), e) -
                                            milestones_.begin());
  LRScheduler& s = *children_[idx];
  if (idx > 0 && milestones_[idx - 1] == e)
    s.step_at(0);
  else
    s.step();
  last_lr_ = s.last_lr();
}

void SequentialLR::visit(StateVisitor& v) {
  Scheduler::visit(v);
  v.field("last_epoch", last_epoch_);
  v.field("_milestones", milestones_, false);
}

SchedulerState SequentialLR::state_dict() const {
  SchedulerState s = LRScheduler::state_dict();
  for (const auto& c : children_) s.children.push_back(c->state_dict());
  return s;
}

void SequentialLR::load_pass(const SchedulerState& state, bool apply) {
  Scheduler::load_pass(state, apply);
  if (state.children.size() != children_.size())
    throw InvalidInput(str("scheduler state of sequentiallr has ", state.children.size(), " schedulers, expected ",
                           children_.size()));
  for (std::size_t i = 0; i < children_.size(); ++i) children_[i]->load_pass(state.children[i], apply);
}

ChainedScheduler::ChainedScheduler(Optimizer& opt, std::vector<std::unique_ptr<Scheduler>> schedulers)
    : Scheduler(opt), children_(std::move(schedulers)) {
  if (children_.empty()) throw InvalidInput("chainedscheduler needs at least one scheduler");
  for (std::size_t i = 0; i < children_.size(); ++i) {
    if (!children_[i]) throw InvalidInput(str("chainedscheduler: scheduler ", i, " is null"));
    if (&children_[i]->optimizer() != &opt)
      throw InvalidInput(str("ChainedScheduler expects all schedulers to belong to the same optimizer, but got "
                             "schedulers at index 0 and ", i, " to be different"));
    if (children_[i]->needs_metric())
      throw InvalidInput(str("chainedscheduler cannot hold ", children_[i]->name(), " (it is stepped with a metric)"));
  }
  last_lr_ = group_lrs();
}

void ChainedScheduler::step() {
  for (auto& c : children_) c->step();
  last_lr_ = group_lrs();
}

SchedulerState ChainedScheduler::state_dict() const {
  SchedulerState s = Scheduler::state_dict();
  for (const auto& c : children_) s.children.push_back(c->state_dict());
  return s;
}

void ChainedScheduler::load_pass(const SchedulerState& state, bool apply) {
  Scheduler::load_pass(state, apply);
  if (state.children.size() != children_.size())
    throw InvalidInput(str("scheduler state of chainedscheduler has ", state.children.size(),
                           " schedulers, expected ", children_.size()));
  for (std::size_t i = 0; i < children_.size(); ++i) children_[i]->load_pass(state.children[i], apply);
}

// ---------------------------------------------------------- ReduceLROnPlateau

ReduceLROnPlateau::ReduceLROnPlateau(Optimizer& opt, ReduceLROnPlateauOptions options)
    : Scheduler(opt), o_(std::move(options)) {
  if (o_.factor >= 1.0) throw InvalidInput("Factor should be < 1.0.");
  if (o_.mode != "min" && o_.mode != "max") throw InvalidInput(str("mode ", o_.mode, " is unknown!"));
  if (o_.threshold_mode != "rel" && o_.threshold_mode != "abs")
    throw InvalidInput(str("threshold mode ", o_.threshold_mode, " is unknown!"));
  if (o_.patience < 0) throw InvalidInput(str("patience must be >= 0, got ", o_.patience));
  if (o_.cooldown < 0) throw InvalidInput(str("cooldown must be >= 0, got ", o_.cooldown));
  if (o_.min_lr.size() != 1 && o_.min_lr.size() != opt.num_groups())
    throw InvalidInput(str("expected ", opt.num_groups(), " min_lrs, got ", o_.min_lr.size()));
  min_lrs_ = broadcast("min_lr", o_.min_lr, opt.num_groups());
  best_ = o_.mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  last_lr_ = group_lrs();
}

bool ReduceLROnPlateau::is_better(double a) const {
  if (o_.mode == "min" && o_.threshold_mode == "rel") return a < best_ * (1.0 - o_.threshold);
  if (o_.mode == "min") return a < best_ - o_.threshold;
  if (o_.threshold_mode == "rel") return a > best_ * (o_.threshold + 1.0);
  return a > best_ + o_.threshold;
}

void ReduceLROnPlateau::step(double metric) {
  last_epoch_ += 1;
  if (is_better(metric)) {
    best_ = metric;
    num_bad_epochs_ = 0;
  } else {
    num_bad_epochs_ += 1;
  }
  if (cooldown_counter_ > 0) {
    cooldown_counter_ -= 1;
    num_bad_epochs_ = 0;
  }
  if (num_bad_epochs_ > static_cast<double>(o_.patience)) {
    for (std::size_t g = 0; g < opt_.num_groups(); ++g) {
      const double old_lr = opt_.lr(g);
      const double new_lr = std::max(old_lr * o_.factor, min_lrs_[g]);
      if (old_lr - new_lr > o_.eps) opt_.set_lr(g, new_lr);
    }
    cooldown_counter_ = static_cast<double>(o_.cooldown);
    num_bad_epochs_ = 0;
  }
  last_lr_ = group_lrs();
}

void ReduceLROnPlateau::visit(StateVisitor& v) {
  Scheduler::visit(v);
  v.field("best", best_);
  v.field("num_bad_epochs", num_bad_epochs_);
  v.field("cooldown_counter", cooldown_counter_);
  v.field("last_epoch", last_epoch_);
  v.field("factor", o_.factor);
  v.field("threshold", o_.threshold);
  v.field("eps", o_.eps);
  v.groups("min_lrs", min_lrs_);
}

// -------------------------------------------------------------------- SWALR

SWALR::SWALR(Optimizer& opt, std::vector<double> swa_lr, long anneal_epochs, std::string anneal_strategy,
             long last_epoch)
    : LRScheduler(opt, last_epoch), anneal_epochs_(static_cast<double>(anneal_epochs)) {
  const auto swa = broadcast("swa_lr", swa_lr, opt.num_groups());
  for (std::size_t g = 0; g < swa.size(); ++g) opt.set_extra(g, "swa_lr", swa[g]);
  if (anneal_strategy != "cos" && anneal_strategy != "linear")
    throw InvalidInput(str("anneal_strategy must by one of 'cos' or 'linear', instead got ", anneal_strategy));
  cosine_ = anneal_strategy == "cos";
  if (anneal_epochs < 0) throw InvalidInput(str("anneal_epochs must be equal or greater than 0, got ", anneal_epochs));
  initial_step();
}

double SWALR::anneal(double t) const { return cosine_ ? (1 - std::cos(kPi * t)) / 2 : t; }

std::vector<double> SWALR::get_lr() {
  double step = static_cast<double>(step_count_ - 1);
  if (anneal_epochs_ == 0) step = std::max(1.0, step);
  const double prev_t = std::max(0.0, std::min(1.0, (step - 1) / std::max(1.0, anneal_epochs_)));
  const double prev_alpha = anneal(prev_t);
  const double t = std::max(0.0, std::min(1.0, step / std::max(1.0, anneal_epochs_)));
  const double alpha = anneal(t);
  std::vector<double> lrs = group_lrs();
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    const double swa_lr = required_extra(opt_, g, "swa_lr");
    const double lr0 = prev_alpha == 1 ? swa_lr : (lrs[g] - prev_alpha * swa_lr) / (1 - prev_alpha);
    lrs[g] = swa_lr * alpha + lr0 * (1 - alpha);
  }
  return lrs;
}

void SWALR::visit(StateVisitor& v) {
  LRScheduler::visit(v);
  v.field("anneal_epochs", anneal_epochs_);
}

}  // namespace distopt
