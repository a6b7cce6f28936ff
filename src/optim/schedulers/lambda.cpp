// LambdaLR and MultiplicativeLR (torch.optim.lr_scheduler): lr from C++
// callables per group, so they are built directly, not by make_scheduler
// (docs/schedulers.md).
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

}  // namespace distopt
