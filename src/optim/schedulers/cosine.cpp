// Cosine annealing (torch.optim.lr_scheduler): CosineAnnealingLR (SGDR
// without restarts, torch's recursive form) and CosineAnnealingWarmRestarts
// (docs/schedulers.md).
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

namespace schedulers {
namespace {

std::unique_ptr<LRScheduler> make_cosine(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const double t_max = r.required("T_max");
  const double eta_min = r.number("eta_min", 0.0);
  r.finish();
  return std::make_unique<CosineAnnealingLR>(opt, t_max, eta_min);
}

std::unique_ptr<LRScheduler> make_warm_restarts(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  const long t0 = r.required_integer("T_0");
  const long mult = r.integer("T_mult", 1);
  const double eta_min = r.number("eta_min", 0.0);
  r.finish();
  return std::make_unique<CosineAnnealingWarmRestarts>(opt, t0, mult, eta_min);
}

}  // namespace

extern const Maker kCosineAnnealingLR{"cosineannealinglr", make_cosine},
    kCosineAnnealingWarmRestarts{"cosineannealingwarmrestarts", make_warm_restarts};

}  // namespace schedulers

}  // namespace distopt
