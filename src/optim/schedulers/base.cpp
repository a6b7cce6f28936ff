// The scheduler base classes (include/distopt/optim/scheduler.hpp):
// Scheduler's state_dict through one visitor for saving and loading, and
// LRScheduler's stepping with torch's semantics (the initial step in the
// constructor, get_lr against the closed form of an explicit epoch;
// docs/schedulers.md, "Semantics").
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

namespace {

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

}  // namespace distopt
