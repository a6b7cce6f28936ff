// SWALR (torch.optim.swa_utils): anneals each group's lr to swa_lr over
// anneal_epochs, by cosine or linearly, then holds it (docs/schedulers.md).
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

namespace schedulers {
namespace {

std::unique_ptr<LRScheduler> make_swa(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  auto swa_lr = r.required_numbers("swa_lr");
  const long anneal_epochs = r.integer("anneal_epochs", 10);
  const std::string strategy = r.text("anneal_strategy", "cos");
  r.finish();
  return std::make_unique<SWALR>(opt, std::move(swa_lr), anneal_epochs, strategy);
}

}  // namespace

extern const Maker kSWALR{"swalr", make_swa};

}  // namespace schedulers

}  // namespace distopt
