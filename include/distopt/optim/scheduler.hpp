// Learning-rate schedulers: torch.optim.lr_scheduler (torch 1.13), same
// names, options, defaults and numbers (docs/schedulers.md).
//
// Torch's stepping semantics hold exactly: constructing a scheduler already
// takes its initial step (last_epoch -1 -> 0, which may write an lr);
// step() uses the chainable form, which reads each group's current lr, so
// schedulers on one optimizer compose; the first scheduler built on an
// optimizer records each group's "initial_lr" (an extra of the group, as
// in torch's param_groups) and later ones take their base lrs from it.
// Schedulers hold a reference to the optimizer, which must outlive them.
//
// ReduceLROnPlateau is stepped with a metric instead (torch: not an
// _LRScheduler). make_scheduler() builds any of them from a name and
// torch-named options, as the replay format and `distopt train` give them.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "distopt/optim/optimizer.hpp"

namespace distopt {

// A scheduler's state_dict: its numbers by torch attribute name (scalars
// are vectors of one), and the children of SequentialLR/ChainedScheduler.
struct SchedulerState {
  std::string kind;
  std::map<std::string, std::vector<double>, std::less<>> values;
  std::vector<SchedulerState> children;
};

class StateVisitor;

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual std::string_view name() const = 0;
  // ReduceLROnPlateau takes step(metric); the others step().
  virtual bool needs_metric() const { return false; }
  virtual void step();
  virtual void step(double metric);
  // get_last_lr(): each group's lr after the last step.
  const std::vector<double>& last_lr() const { return last_lr_; }
  const Optimizer& optimizer() const { return opt_; }
  virtual SchedulerState state_dict() const;
  // Validates the whole state (kind, names, group counts, children) before
  // changing anything; throws InvalidInput.
  void load_state_dict(const SchedulerState& state);

 protected:
  explicit Scheduler(Optimizer& opt) : opt_(opt) {}
  virtual void visit(StateVisitor& v);
  virtual void load_pass(const SchedulerState& state, bool apply);
  std::vector<double> group_lrs() const;

  Optimizer& opt_;
  std::vector<double> last_lr_;

  friend class SequentialLR;
  friend class ChainedScheduler;
};

// torch's _LRScheduler.
class LRScheduler : public Scheduler {
 public:
  void step() override;
  using Scheduler::step;
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  long last_epoch() const { return last_epoch_; }

 protected:
  LRScheduler(Optimizer& opt, long last_epoch);
  // Torch's _initial_step: a final class calls it last in its constructor.
  void initial_step();
  // The chainable form at last_epoch_ (torch's get_lr); may write momentum.
  virtual std::vector<double> get_lr() = 0;
  // The closed form at last_epoch_, where torch defines one.
  virtual std::optional<std::vector<double>> closed_form_lr() { return std::nullopt; }
  // Torch's deprecated step(epoch): the closed form where there is one.
  virtual void step_at(long epoch);
  void apply_lrs(const std::vector<double>& lrs);
  void visit(StateVisitor& v) override;

  std::vector<double> base_lrs_;
  long last_epoch_;
  long step_count_ = 0;

  friend class SequentialLR;
};

class LambdaLR final : public LRScheduler {
 public:
  using Fn = std::function<double(long)>;
  // One function for every group, or one per group.
  LambdaLR(Optimizer& opt, std::vector<Fn> lr_lambdas, long last_epoch = -1);
  std::string_view name() const override { return "lambdalr"; }

 private:
  std::vector<double> get_lr() override;
  std::vector<Fn> fns_;
};

class MultiplicativeLR final : public LRScheduler {
 public:
  using Fn = std::function<double(long)>;
  MultiplicativeLR(Optimizer& opt, std::vector<Fn> lr_lambdas, long last_epoch = -1);
  std::string_view name() const override { return "multiplicativelr"; }

 private:
  std::vector<double> get_lr() override;
  std::vector<Fn> fns_;
};

class StepLR final : public LRScheduler {
 public:
  StepLR(Optimizer& opt, long step_size, double gamma = 0.1, long last_epoch = -1);
  std::string_view name() const override { return "steplr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  double step_size_, gamma_;
};

class MultiStepLR final : public LRScheduler {
 public:
  MultiStepLR(Optimizer& opt, std::vector<long> milestones, double gamma = 0.1, long last_epoch = -1);
  std::string_view name() const override { return "multisteplr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  std::vector<double> milestones_;  // sorted, repeats kept (torch's Counter)
  double gamma_;
};

class ConstantLR final : public LRScheduler {
 public:
  ConstantLR(Optimizer& opt, double factor = 1.0 / 3, long total_iters = 5, long last_epoch = -1);
  std::string_view name() const override { return "constantlr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  double factor_, total_iters_;
};

class LinearLR final : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3, double end_factor = 1.0, long total_iters = 5,
           long last_epoch = -1);
  std::string_view name() const override { return "linearlr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  double start_, end_, total_iters_;
};

class ExponentialLR final : public LRScheduler {
 public:
  ExponentialLR(Optimizer& opt, double gamma, long last_epoch = -1);
  std::string_view name() const override { return "exponentiallr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  double gamma_;
};

class PolynomialLR final : public LRScheduler {
 public:
  PolynomialLR(Optimizer& opt, long total_iters = 5, double power = 1.0, long last_epoch = -1);
  std::string_view name() const override { return "polynomiallr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  double total_iters_, power_;
};

class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, double T_max, double eta_min = 0, long last_epoch = -1);
  std::string_view name() const override { return "cosineannealinglr"; }

 private:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() override;
  void visit(StateVisitor& v) override;
  double t_max_, eta_min_;
};

class CosineAnnealingWarmRestarts final : public LRScheduler {
 public:
  CosineAnnealingWarmRestarts(Optimizer& opt, long T_0, long T_mult = 1, double eta_min = 0, long last_epoch = -1);
  std::string_view name() const override { return "cosineannealingwarmrestarts"; }
  void step() override;
  // torch's step(epoch) with a fractional epoch (e.g. epoch + batch/batches).
  void step_epoch(double epoch);

 private:
  std::vector<double> get_lr() override;
  void step_at(long epoch) override { step_epoch(static_cast<double>(epoch)); }
  void visit(StateVisitor& v) override;
  double t_0_, t_i_, t_mult_, eta_min_, t_cur_;
};

struct CyclicLROptions {
  std::vector<double> base_lr;  // one value, or one per group (required)
  std::vector<double> max_lr;   // likewise (required)
  double step_size_up = 2000;
  std::optional<double> step_size_down;  // default: step_size_up
  std::string mode = "triangular";       // triangular | triangular2 | exp_range
  double gamma = 1.0;
  std::function<double(double)> scale_fn;  // overrides mode when set
  std::string scale_mode = "cycle";        // cycle | iterations (with scale_fn)
  bool cycle_momentum = true;              // momentum, or beta1 where the optimizer has betas
  std::vector<double> base_momentum = {0.8};
  std::vector<double> max_momentum = {0.9};
};

class CyclicLR final : public LRScheduler {
 public:
  CyclicLR(Optimizer& opt, CyclicLROptions options, long last_epoch = -1);
  std::string_view name() const override { return "cycliclr"; }

 private:
  std::vector<double> get_lr() override;
  void visit(StateVisitor& v) override;
  double scale(double x) const;
  CyclicLROptions o_;
  std::vector<double> max_lrs_, base_momentums_, max_momentums_;
  double total_size_, step_ratio_;
  bool use_beta1_ = false;
};

struct OneCycleLROptions {
  std::vector<double> max_lr;  // one value, or one per group (required)
  std::optional<long> total_steps;
  std::optional<long> epochs, steps_per_epoch;  // instead of total_steps
  double pct_start = 0.3;
  std::string anneal_strategy = "cos";  // cos | linear
  bool cycle_momentum = true;
  std::vector<double> base_momentum = {0.85};
  std::vector<double> max_momentum = {0.95};
  double div_factor = 25.0;
  double final_div_factor = 1e4;
  bool three_phase = false;
};

class OneCycleLR final : public LRScheduler {
 public:
  OneCycleLR(Optimizer& opt, OneCycleLROptions options, long last_epoch = -1);
  std::string_view name() const override { return "onecyclelr"; }

 private:
  struct Phase {
    double end_step;
    const char *start_lr, *end_lr, *start_momentum, *end_momentum;
  };
  std::vector<double> get_lr() override;
  void visit(StateVisitor& v) override;
  double anneal(double start, double end, double pct) const;
  OneCycleLROptions o_;
  double total_steps_;
  std::vector<Phase> phases_;
  bool use_beta1_ = false;
};

// Children are built on the same optimizer before the SequentialLR and are
// owned by it. milestones.size() == schedulers.size() - 1.
class SequentialLR final : public LRScheduler {
 public:
  SequentialLR(Optimizer& opt, std::vector<std::unique_ptr<LRScheduler>> schedulers, std::vector<long> milestones,
               long last_epoch = -1);
  std::string_view name() const override { return "sequentiallr"; }
  void step() override;
  SchedulerState state_dict() const override;

 private:
  std::vector<double> get_lr() override;
  void load_pass(const SchedulerState& state, bool apply) override;
  void visit(StateVisitor& v) override;
  std::vector<std::unique_ptr<LRScheduler>> children_;
  std::vector<double> milestones_;
};

// Steps every child in order; they compose through the groups' lrs.
class ChainedScheduler final : public Scheduler {
 public:
  ChainedScheduler(Optimizer& opt, std::vector<std::unique_ptr<Scheduler>> schedulers);
  std::string_view name() const override { return "chainedscheduler"; }
  void step() override;
  using Scheduler::step;
  SchedulerState state_dict() const override;

 private:
  void load_pass(const SchedulerState& state, bool apply) override;
  std::vector<std::unique_ptr<Scheduler>> children_;
};

struct ReduceLROnPlateauOptions {
  std::string mode = "min";  // min | max
  double factor = 0.1;
  long patience = 10;
  double threshold = 1e-4;
  std::string threshold_mode = "rel";  // rel | abs
  long cooldown = 0;
  std::vector<double> min_lr = {0.0};  // one value, or one per group
  double eps = 1e-8;
};

class ReduceLROnPlateau final : public Scheduler {
 public:
  ReduceLROnPlateau(Optimizer& opt, ReduceLROnPlateauOptions options = {});
  std::string_view name() const override { return "reducelronplateau"; }
  bool needs_metric() const override { return true; }
  void step(double metric) override;
  using Scheduler::step;

 private:
  void visit(StateVisitor& v) override;
  bool is_better(double a) const;
  ReduceLROnPlateauOptions o_;
  std::vector<double> min_lrs_;
  double best_;
  double num_bad_epochs_ = 0, cooldown_counter_ = 0, last_epoch_ = 0;
};

// Torch's SWALR (torch/optim/swa_utils.py): anneals each group's lr to
// swa_lr over anneal_epochs steps.
class SWALR final : public LRScheduler {
 public:
  SWALR(Optimizer& opt, std::vector<double> swa_lr, long anneal_epochs = 10, std::string anneal_strategy = "cos",
        long last_epoch = -1);
  std::string_view name() const override { return "swalr"; }

 private:
  std::vector<double> get_lr() override;
  void visit(StateVisitor& v) override;
  double anneal(double t) const;
  double anneal_epochs_;
  bool cosine_;
};

// Options as the replay format and the command line give them.
using SchedulerOption = std::variant<double, bool, std::string, std::vector<double>>;
struct SchedulerSpec {
  std::string name;  // lower-cased torch class name
  std::map<std::string, SchedulerOption, std::less<>> options;
  std::vector<SchedulerSpec> schedulers;  // sequentiallr, chainedscheduler
};

// Names make_scheduler() knows (lambdalr and multiplicativelr take C++
// callables and are built directly).
std::span<const std::string_view> scheduler_names();

// Builds a scheduler with torch's checks; unknown names or options, missing
// required options and invalid values throw InvalidInput naming them.
std::unique_ptr<Scheduler> make_scheduler(Optimizer& opt, const SchedulerSpec& spec);

// A spec from its JSON text, {"name": ..., "options": {...}, "schedulers":
// [...]} (the replay format's, --scheduler's and a configuration file's);
// errors are one line starting with `source`.
SchedulerSpec parse_scheduler_spec(std::string_view json_text, std::string_view source);
// make_scheduler(opt, parse_scheduler_spec(json_text, "scheduler")).
std::unique_ptr<Scheduler> make_scheduler(Optimizer& opt, std::string_view json_text);
// A spec from a name and the command line's KEY=VALUE options: a number,
// true/false, a comma list of numbers, or a word.
SchedulerSpec scheduler_spec_from_options(std::string name, std::span<const std::string> key_values);

}  // namespace distopt
