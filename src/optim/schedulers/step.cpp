// The piecewise and closed-form decays of torch.optim.lr_scheduler: StepLR,
// MultiStepLR, ConstantLR, LinearLR, ExponentialLR, PolynomialLR
// (docs/schedulers.md).
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

namespace schedulers {
namespace {

std::unique_ptr<LRScheduler> make_step(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const long step_size = r.required_integer("step_size");
  const double gamma = r.number("gamma", 0.1);
  r.finish();
  return std::make_unique<StepLR>(opt, step_size, gamma);
}

std::unique_ptr<LRScheduler> make_multi_step(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  auto milestones = r.integers("milestones");
  const double gamma = r.number("gamma", 0.1);
  r.finish();
  return std::make_unique<MultiStepLR>(opt, std::move(milestones), gamma);
}

std::unique_ptr<LRScheduler> make_constant(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const double factor = r.number("factor", 1.0 / 3);
  const long total = r.integer("total_iters", 5);
  r.finish();
  return std::make_unique<ConstantLR>(opt, factor, total);
}

std::unique_ptr<LRScheduler> make_linear(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const double start = r.number("start_factor", 1.0 / 3), end = r.number("end_factor", 1.0);
  const long total = r.integer("total_iters", 5);
  r.finish();
  return std::make_unique<LinearLR>(opt, start, end, total);
}

std::unique_ptr<LRScheduler> make_exponential(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const double gamma = r.required("gamma");
  r.finish();
  return std::make_unique<ExponentialLR>(opt, gamma);
}

std::unique_ptr<LRScheduler> make_polynomial(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const long total = r.integer("total_iters", 5);
  const double power = r.number("power", 1.0);
  r.finish();
  return std::make_unique<PolynomialLR>(opt, total, power);
}

}  // namespace

extern const Maker kStepLR{"steplr", make_step}, kMultiStepLR{"multisteplr", make_multi_step},
    kConstantLR{"constantlr", make_constant}, kLinearLR{"linearlr", make_linear},
    kExponentialLR{"exponentiallr", make_exponential}, kPolynomialLR{"polynomiallr", make_polynomial};

}  // namespace schedulers

}  // namespace distopt
