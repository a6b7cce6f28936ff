// The sharded and gossip optimizers of distopt._core, PySharded
// (python/distopt/torch/distributed.py; docs/python.md, "The sharded
// optimizer" and "Gossip and DiLoCo"): the class here, its members in
// sharded.cpp, its bindings in sharded_bindings.cpp.
//
// The sharded optimizer runs a C++ strategy (ddp, zero1, zero2) over a
// FlatLayout with one unit per torch parameter. The parameters' values
// live in the strategy's own buffer (torch's parameters become views of
// it). Their gradients: where the strategy keeps the whole gradient in one
// persistent buffer (ddp, zero1: !StrategyInfo::sharded_grads) torch's
// `.grad` views that buffer, as DDP's gradient_as_bucket_view does; zero2
// writes each bucket into a transient buffer, so there each unit's gradient
// is delivered as backward produces it (deliver(), below). Each unit's
// gradient is divided by the world size (as torch's DDP does) and handed to
// the strategy in backward order (its buckets reduce in distopt's fixed
// rank order); a step runs the strategy's step (statistics reduced, matrices gathered,
// parameters all-gathered into the same buffer) and waits for every unit.
//
// A gossip strategy (StrategyInfo::per_rank_models: sgp, osgp, dpsgd,
// slowmo, diloco) runs the same way with each rank's own model: its values
// move between the strategy's buffers (x, or the de-biased x / w), so torch's
// parameters view a flat buffer of this class that each step refills with
// the model the next forward runs on; gradients view the strategy's own
// persistent buffer, handed over divided by the world size as the command
// line's trainer hands them (the strategy steps with the rank's own mean).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::python {

// The strategies the sharded optimizer runs, in the registry's order: those
// with one model for all ranks whose parameters are whole between steps
// (StrategyInfo: not per_rank_models, not sharded_params). Nothing here
// names one.
std::vector<std::string> sharded_strategies();
// Those that keep only a shard of the parameters and gather each unit as
// the model runs it (sharded_params: zero3), which FullyShardedDataParallel
// runs.
std::vector<std::string> gathering_strategies();

// The strategies the gossip optimizer runs (StrategyInfo::per_rank_models).
std::vector<std::string> gossip_strategies();

// GossipOptions from Python's keyword names (the command line's flags with
// underscores: topology, synch_freq, sync_every, outer_lr, ...), each checked
// against `strategy` (StrategyInfo::option_misfit): InvalidInput naming an
// unknown one or one the strategy does not read.
parallel::GossipOptions gossip_options(const std::string& strategy, const py::dict& options);
// Those keyword names, in the command line's order.
std::vector<std::string> gossip_option_names();

// Parameter i as Python describes it: (name, shape).
using ParamSpec = std::pair<std::string, std::vector<std::int64_t>>;
// A unit of the layout as Python describes it: (name, how many of the
// parameters, in order, it holds). None given: one unit per parameter.
using UnitSpec = std::pair<std::string, std::size_t>;

// The flat layout of those parameters: one unit per parameter (units
// empty), or the units given, each tensor of 4096 or more elements placed
// on a multiple of 256 elements of its unit (place_in_unit) with zeros
// between; and, for FullyShardedDataParallel's flat tensors, each
// parameter's offset in its unit and each unit's length.
parallel::FlatLayout layout_of(const std::vector<ParamSpec>& params, const std::vector<UnitSpec>& units = {});
struct UnitOffsets {
  std::vector<std::size_t> offsets, lengths;
};
UnitOffsets unit_offsets(const std::vector<ParamSpec>& params, const std::vector<UnitSpec>& units);

// The reference the Python optimizers are tested against: the C++ strategy
// over the threads backend, one thread per rank, stepped with
// grads[step][rank] (each rank's flat gradient, the model's layout, as torch
// computed it) handed over as PySharded::step hands them. Returns, for
// each rank, the model the next forward would run on after each step (the
// model's layout): out[rank][step].
std::vector<std::vector<std::vector<float>>> replay_strategy(const std::string& strategy, const std::string& rule,
                                                             const std::vector<ParamSpec>& params,
                                                             std::span<const float> initial, const OptionMap& options,
                                                             const parallel::GossipOptions& gossip,
                                                             const std::vector<std::vector<std::vector<float>>>& grads);

// Retires every PySharded alive (Python's exit: before MPI is finalized or
// torch's process group destroyed, with which a request still in flight
// could not complete).
void retire_all_sharded();

class PySharded {
 public:
  PySharded(std::shared_ptr<Communicator> comm, const std::string& strategy, const std::string& rule,
            const std::vector<ParamSpec>& params, py::array_t<float, py::array::c_style | py::array::forcecast> initial,
            const py::dict& options, std::size_t bucket_elements, const py::dict& gossip = {},
            const std::vector<UnitSpec>& units = {}, const py::dict& strategy_options = {});

  ~PySharded();

  // Ends the strategy: what it has in flight (zero3's prefetch) completes,
  // its buffers go. At exit, before the communicator ends
  // (retire_all_sharded); nothing else may be called after.
  void retire();

  std::size_t num_params() const { return layout_.params.size(); }
  std::size_t num_units() const { return layout_.units.size(); }
  int rank() const { return comm_->rank(); }
  int world() const { return comm_->size(); }
  const std::string& strategy() const { return strategy_name_; }

  // Parameter i's values and its gradient, as numpy arrays viewing this
  // object's memory (their base keeps it alive).
  py::array param(py::object self, std::size_t i);
  py::array grad(py::object self, std::size_t i);
  void zero_grads();

  // A strategy that keeps only its shard of the parameters (zero3:
  // StrategyInfo::sharded_params) has no whole values for param(): the
  // model gathers unit u when it runs it, straight into torch's storage,
  // without a buffer of the strategy's between: gather_start(u, address)
  // starts the all-gather of unit u's shards into `address`
  // (unit_padded(u) elements: the unit's values, then padding),
  // gather_wait(u) waits for it (if a step has not: it waits for every
  // gather still reading the shards it updates, so a gather started before
  // a step has the old values). Python prefetches with these (the
  // strategy's own prefetch is off).
  bool gathers() const { return gathers_; }
  std::size_t unit_padded(std::size_t u) const;
  void gather_start(std::size_t u, std::uintptr_t address);
  void gather_wait(std::size_t u);

  // deliver() from the unit's parameters' gradients, each given apart (in
  // order, each flat or shaped): no concatenated copy.
  void deliver_parts(std::size_t u, const py::list& grads);

  // One step from the gradients in the flat buffer (or, where hooked(),
  // those delivered); clips to max_norm first when it is positive. Returns
  // the gradients' total norm (NaN without clipping).
  double step(double max_norm, double norm_type);

  // Where the strategy keeps only its gradient shard (zero2:
  // StrategyInfo::sharded_grads), gradients are delivered as backward
  // produces them, in backward order (unit n-1 first): deliver(u, g) hands
  // unit u's gradient (g: its values as torch computed them, the unit's
  // shape or flat) to the strategy, whose bucket reduce-scatters once its
  // last unit is in; a step needs every unit delivered. There is no flat
  // gradient buffer then.
  bool hooked() const { return hooked_; }
  // The unit deliver() takes next (-1: all are in).
  long next_unit() const { return static_cast<long>(pending_) - 1; }
  void deliver(std::size_t u, py::handle g);  // deliver_parts of one

  // Sets an option of the group torch sees (param_groups[0]). A learning
  // rate scales every group alike (Muon's AdamW group for its 1-D
  // parameters keeps its ratio to the main one), as distopt's schedulers
  // scale every group.
  void set_option(const std::string& key, py::handle value);
  py::dict group_options();

  // The whole state tensors, named as distopt's checkpoints name them
  // ("state.<index>.<key>", "param.<name>"), on every rank (collective).
  py::dict consolidated();

  // Loads whole state tensors (as consolidated() names them): every rank
  // takes its pieces.
  void load_consolidated(const py::dict& tensors);

  // distopt's reshardable checkpoint under `root` (collective): loadable
  // at any world size and by any of the strategies, here or by load().
  std::uint64_t save(const std::string& root, std::uint64_t step, std::size_t keep);

  // The latest checkpoint under `root`: a strategy is built from it and,
  // once it has taken the saved state, replaces the current one (the
  // parameters' addresses change: the caller views them again; on an error
  // nothing changes). The old strategy's buffers stay allocated until this
  // object goes, so that tensors still viewing them read stale values, not
  // freed memory. Returns the step it was saved at.
  std::uint64_t load(const std::string& root);

  py::dict memory() const;
  std::uint64_t bytes_sent() const { return strategy_->bytes_sent(); }

  // Gossip strategies: (1/n) sum_i |z_i - z_mean|^2 over the ranks' models
  // (collective); NaN for the others.
  double consensus_distance();
  // Every parameter's values as evaluation sees them, as new arrays: the
  // mean of the ranks' models under a gossip strategy (collective), the
  // parameters themselves otherwise.
  std::vector<py::array> averaged();
  // Steps taken (the strategy's count, carried by checkpoints).
  std::uint64_t steps() const { return steps_; }
  // What the last load() warned of ("" for nothing): a gossip checkpoint
  // resumed from its consensus.
  const std::string& load_warning() const { return load_warning_; }

 private:
  using StrategyInfo_ = parallel::StrategyInfo;

  const ParamSlot& slot(std::size_t i) const;

  checkpoint::RunInfo run_info() const;

  std::unique_ptr<parallel::Strategy> make(const parallel::InitialParams& initial) const;

  // `s` becomes the strategy; the parameters' and gradients' addresses are its.
  void adopt(std::unique_ptr<parallel::Strategy> s);

  // A gossip strategy: InvalidInput naming a parameter torch's view of
  // which no longer holds the strategy's model (written between steps).
  void check_model_unchanged();

  // Waits for the parameters' gathers; they land where torch's views are
  // (a gossip strategy's model is copied there).
  void wait_for_params();

  std::map<std::string, checkpoint::Whole> gather_wholes();

  std::shared_ptr<Communicator> comm_;
  std::string strategy_name_;
  parallel::FlatLayout layout_;
  parallel::OptimizerSpec spec_;
  parallel::StrategyOptions options_;
  std::unique_ptr<parallel::Strategy> strategy_;
  std::vector<std::unique_ptr<parallel::Strategy>> retired_;  // replaced by load(), still viewed perhaps
  std::vector<double> base_lr_;                               // each group's lr as made
  std::vector<std::size_t> unit_of_;                          // parameter i's unit
  bool gathers_ = false;                                      // zero3: parameters gathered per unit (gather_start)
  std::map<std::size_t, std::unique_ptr<Request>> gathers_in_flight_;  // gather_start's, by unit
  std::vector<float*> values_;   // unit u's parameters in the strategy's buffer (null where gathers_)
  std::vector<float*> grad_at_;  // !hooked_: unit u's gradient in the strategy's buffer
  bool hooked_ = false;          // gradients delivered unit by unit (deliver)
  std::size_t pending_ = 0;      // hooked_: units not yet delivered in this step
  bool per_rank_ = false;        // a gossip strategy: values_ point into model_
  std::vector<float> model_;     // per_rank_: the model torch's parameters view, the model's layout
  std::uint64_t steps_ = 0;
  std::string load_warning_;
};

}  // namespace distopt::python
