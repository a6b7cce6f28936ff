// The cyclical schedules of torch.optim.lr_scheduler, which also cycle the
// momentum (or Adam's beta1): CyclicLR (Smith 2017) and OneCycleLR (Smith &
// Topin 2018); docs/schedulers.md.
#include "scheduler_impl.hpp"

namespace distopt {

using namespace schedulers;

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

namespace schedulers {
namespace {

// cycle_momentum, base_momentum and max_momentum, read in this order by both.
template <class Options>
void read_momentum(OptionReader& r, Options& o) {
  o.cycle_momentum = r.flag("cycle_momentum", o.cycle_momentum);
  o.base_momentum = r.numbers("base_momentum", o.base_momentum);
  o.max_momentum = r.numbers("max_momentum", o.max_momentum);
}

std::unique_ptr<LRScheduler> make_cyclic(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  CyclicLROptions o;
  o.base_lr = r.required_numbers("base_lr");
  o.max_lr = r.required_numbers("max_lr");
  o.step_size_up = r.number("step_size_up", o.step_size_up);
  o.step_size_down = r.number("step_size_down");
  o.mode = r.text("mode", o.mode);
  o.gamma = r.number("gamma", o.gamma);
  o.scale_mode = r.text("scale_mode", o.scale_mode);
  read_momentum(r, o);
  r.finish();
  return std::make_unique<CyclicLR>(opt, std::move(o));
}

std::unique_ptr<LRScheduler> make_one_cycle(Optimizer& opt, const SchedulerSpec&, OptionReader& r) {
  OneCycleLROptions o;
  o.max_lr = r.required_numbers("max_lr");
  o.total_steps = r.integer("total_steps");
  o.epochs = r.integer("epochs");
  o.steps_per_epoch = r.integer("steps_per_epoch");
  o.pct_start = r.number("pct_start", o.pct_start);
  o.anneal_strategy = r.text("anneal_strategy", o.anneal_strategy);
  read_momentum(r, o);
  o.div_factor = r.number("div_factor", o.div_factor);
  o.final_div_factor = r.number("final_div_factor", o.final_div_factor);
  o.three_phase = r.flag("three_phase", o.three_phase);
  r.finish();
  return std::make_unique<OneCycleLR>(opt, std::move(o));
}

}  // namespace

extern const Maker kCyclicLR{"cycliclr", make_cyclic}, kOneCycleLR{"onecyclelr", make_one_cycle};

}  // namespace schedulers

}  // namespace distopt
