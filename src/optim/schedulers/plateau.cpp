// ReduceLROnPlateau (torch.optim.lr_scheduler): the lr falls by `factor`
// when the metric has not improved for `patience` epochs (docs/schedulers.md).
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

namespace schedulers {
namespace {

std::unique_ptr<Scheduler> make_plateau(Optimizer& opt, const SchedulerSpec& spec, OptionReader& r) {
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

}  // namespace

extern const Maker kReduceLROnPlateau{"reducelronplateau", nullptr, make_plateau};

}  // namespace schedulers

}  // namespace distopt
