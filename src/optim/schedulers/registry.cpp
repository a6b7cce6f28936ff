// make_scheduler: schedulers by lower-cased torch class name and
// torch-named options (docs/schedulers.md; replay cases, `distopt train
// --scheduler`). The table of every scheduler it knows; each one's class
// and Maker live in its family's file (scheduler_impl.hpp).
#include "scheduler_impl.hpp"

namespace distopt {

namespace schedulers {

namespace {

// Every scheduler make_scheduler knows, in scheduler_names()'s order.
constexpr const Maker* kMakers[] = {
    &kStepLR, &kMultiStepLR, &kConstantLR, &kLinearLR, &kExponentialLR, &kPolynomialLR,  // step.cpp
    &kCosineAnnealingLR, &kCosineAnnealingWarmRestarts,                                  // cosine.cpp
    &kCyclicLR, &kOneCycleLR,                                                            // cyclic.cpp
    &kReduceLROnPlateau,                                                                 // plateau.cpp
    &kSequentialLR, &kChainedScheduler,                                                  // composite.cpp
    &kSWALR,                                                                             // swa.cpp
};

const Maker* find(std::string_view name) {
  for (const Maker* m : kMakers)
    if (m->name == name) return m;
  return nullptr;
}

}  // namespace

std::unique_ptr<LRScheduler> make_lr_scheduler(Optimizer& opt, const SchedulerSpec& spec) {
  const Maker* m = find(spec.name);
  if (m == nullptr) throw InvalidInput(str("unknown scheduler '", spec.name, "'"));
  if (m->lr == nullptr) throw InvalidInput(str("sequentiallr cannot hold ", spec.name));
  if (!m->holds_schedulers && !spec.schedulers.empty()) throw InvalidInput(str(spec.name, " takes no schedulers"));
  OptionReader r(spec);
  return m->lr(opt, spec, r);
}

}  // namespace schedulers

std::span<const std::string_view> scheduler_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> out;
    for (const schedulers::Maker* m : schedulers::kMakers) out.push_back(m->name);
    return out;
  }();
  return names;
}

std::unique_ptr<Scheduler> make_scheduler(Optimizer& opt, const SchedulerSpec& spec) {
  if (const schedulers::Maker* m = schedulers::find(spec.name); m != nullptr && m->other != nullptr) {
    schedulers::OptionReader r(spec);
    return m->other(opt, spec, r);
  }
  return schedulers::make_lr_scheduler(opt, spec);
}

}  // namespace distopt
