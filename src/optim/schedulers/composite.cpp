// Schedulers of schedulers (torch.optim.lr_scheduler): SequentialLR, one
// child after another at the milestones, and ChainedScheduler, every child
// at every step (docs/schedulers.md).
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

namespace schedulers {
namespace {

std::unique_ptr<LRScheduler> make_sequential(Optimizer& opt, const SchedulerSpec& spec, OptionReader& r) {
  auto milestones = r.integers("milestones");
  r.finish();
  if (spec.schedulers.empty()) throw InvalidInput("sequentiallr: schedulers is required (a non-empty list)");
  std::vector<std::unique_ptr<LRScheduler>> children;
  for (const auto& c : spec.schedulers) {
    if (c.name == "sequentiallr") throw InvalidInput("sequentiallr cannot hold a sequentiallr");
    children.push_back(make_lr_scheduler(opt, c));
  }
  return std::make_unique<SequentialLR>(opt, std::move(children), std::move(milestones));
}

std::unique_ptr<Scheduler> make_chained(Optimizer& opt, const SchedulerSpec& spec, OptionReader& r) {
  r.finish();
  if (spec.schedulers.empty()) throw InvalidInput("chainedscheduler: schedulers is required (a non-empty list)");
  std::vector<std::unique_ptr<Scheduler>> children;
  for (const auto& c : spec.schedulers) children.push_back(make_scheduler(opt, c));
  return std::make_unique<ChainedScheduler>(opt, std::move(children));
}

}  // namespace

extern const Maker kSequentialLR{"sequentiallr", make_sequential, nullptr, /*holds_schedulers=*/true},
    kChainedScheduler{"chainedscheduler", nullptr, make_chained, /*holds_schedulers=*/true};

}  // namespace schedulers

}  // namespace distopt
