// The core under the gossip strategies (not installed; the policies are
// sgp.cpp, osgp.cpp, dpsgd.cpp, adpsgd.cpp, slowmo.cpp and diloco.cpp beside it;
// docs/gossip.md, "Training"). As in SGP (Assran et al. 2019), each rank
// holds the whole model: the numerator x (what its optimizer steps, in the
// padded layout) and the push-sum weight w; the model runs on the
// de-biased z = x / w. The trainer scales backward so that the ranks'
// gradients sum to the global batch's; a gossip rank steps with its own
// local mean gradient, which is n times its contribution.
//
// The core runs the step (own gradient, update, then the policy's mixing),
// evaluation on the ranks' average, the consensus distance, the LocalState
// of a checkpoint (docs/formats.md, "Gossip runs") and its resumption, and
// owns the push-sum gossipers: the main one, then any that take turns with
// it on one schedule (osgp's pipeline). A policy overrides the hooks: what
// happens before the update, the mixing after it, the values the model runs
// on, its own LocalState tensors and memory, its topology and its options.
//
// Invariants: x_ never reallocates (the optimizer's views point into it);
// every rank starts the same rounds in the same order, so rounds in flight
// at the end all complete.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../internal.hpp"
#include "distopt/gossip/push_sum.hpp"
#include "distopt/gossip/topology.hpp"

namespace distopt::parallel::detail {

class GossipCore : public StrategyCore {
 public:
  ~GossipCore() override;

  MemoryUse memory() const final;

  // ---- UnitAccess: the model runs on model_values() ----
  std::span<const float> acquire(std::size_t u, models::Pass) final;
  void release(std::size_t, models::Pass) final {}
  std::span<float> grads(std::size_t u) final;
  void grads_done(std::size_t) final {}

  void step(const UpdateFn& update) final;
  std::span<const float> own_params() final;
  void for_each_param(std::span<const float> own, const ParamVisitor& each) final {
    for_each_padded_param(layout_, average(own), each);
  }
  std::unique_ptr<models::UnitAccess> access_to(std::span<const float> own) final;
  models::UnitAccess& eval_access() final;
  std::vector<float> mean_over_ranks(std::span<const float> values) final { return average(values); }
  double consensus_distance() final;
  std::optional<LocalState> local_state() final;
  std::optional<LocalState> survivor_state() override;
  void complete_in_flight() override;
  bool can_run_at(int world) override;
  void resume(std::uint64_t steps, const LocalState* saved) override;

  // The checks a policy adds to check_gossip_options(); none by default.
  static void check_policy_options(const GossipOptions&) {}

 protected:
  // The graph is --topology, or without it the registry entry's
  // StrategyInfo::topology; none when that is empty.
  explicit GossipCore(const StrategyArgs& a);

  // ---- the policy's hooks ----
  // Before the update, after the gradient is the rank's own (dpsgd: x <- W x).
  virtual void before_update() {}
  // After the update; steps_ counts it already.
  virtual void mix() = 0;
  // x itself on a regular graph in step (w = 1), else z = x / w.
  virtual std::span<const float> model_values();
  // Before the model's values are read outside a step (adpsgd: every round
  // allowed has landed). Nothing by default.
  virtual void settle() {}
  // LocalState's tensors after x (local_state()'s, then resume()'s order).
  virtual void save_tensors(LocalState&) {}
  virtual void load_tensors(const LocalState&) {}
  // A survivor's tensors after x (survivor_state(), without communication;
  // load_tensors reads them back with LocalState::survivor set), and the
  // survivors' agreement on what they share once resumed (collective).
  virtual void survivor_tensors(LocalState&) {}
  virtual void agree_survivors() {}
  // resume() without a saved state, after the gossipers' iterations are set.
  virtual void start_fresh() {}
  // Bytes beyond x, z and the gradients and optimizer state.
  virtual void add_memory(MemoryUse&) const {}

  // ---- for the policies ----
  // A push-sum gossiper on the topology (the main one first).
  gossip::PushSum& add_push_sum(int tag = gossip::PushSum::kTag);
  // One synchronous push-sum round of (x, w) on the main gossiper.
  void mix_push_sum();
  // x_ takes new values in place: the optimizer's parameter views point
  // into its storage.
  void set_x(std::span<const float> values);
  // The mean over ranks of padded values (rank-ordered sum, then / n).
  std::vector<float> average(std::span<const float> values);
  // A saved tensor of `st` by name, model-sized (a push-sum share: any
  // size) or of `size` elements when given; InvalidInput naming the
  // strategy and rank otherwise.
  const std::vector<float>& saved_tensor(const LocalState& st, const std::string& name, std::size_t size = 0) const;

  GossipOptions options_;
  std::optional<gossip::Topology> topology_;  // none for adpsgd
  std::vector<float> x_, grads_, z_, eval_values_;
  std::vector<TensorView> owned_;
  std::optional<gossip::PushSum> push_sum_;
  std::vector<std::unique_ptr<gossip::PushSum>> pipeline_;  // osgp: the other synch_freq rounds in flight
  std::unique_ptr<ValuesAccess> eval_;
  double w_ = 1.0;
  bool z_valid_ = false;
  std::uint64_t steps_ = 0;
  // adpsgd's gossip thread adds its averages to x under this lock.
  std::mutex x_mutex_;

 private:
  // The push-sum gossipers in a fixed order: the main one, then the pipeline.
  std::vector<gossip::PushSum*> gossipers();
  // resume() from a LocalState of local_state()'s layout.
  void load_local(const LocalState& st);
  // Model-sized values from the padded layout (which depends on the world
  // size) to the model's flat one, and back (padding zero).
  std::vector<float> to_flat(std::span<const float> padded) const;
  std::vector<float> to_padded(std::span<const float> flat) const;
};

// The options every gossip strategy checks (the parameter dtype, the ranges
// of GossipOptions); InvalidInput naming `strategy` otherwise.
void check_gossip_options(std::string_view strategy, const StrategyOptions& options);

// Why `flag` (without its dashes) does not apply to the gossip strategy
// `strategy`, which reads --topology and --peers-per-iteration, and
// --synch-freq when `synch_freq`, slowmo's flags when `slowmo`, diloco's
// (--sync-every, --outer-*) when `outer`; "" when it applies (slowmo adds
// what its base decides, diloco that it has no topology).
std::string gossip_misfit(std::string_view strategy, std::string_view flag, bool synch_freq, bool slowmo,
                          bool outer = false);
// A registry entry's option_misfit for a strategy that reads --topology and
// --peers-per-iteration, and --synch-freq when kSynchFreq.
template <bool kSynchFreq>
std::string topology_flags(const StrategyInfo& self, std::string_view flag, const GossipOptions&) {
  return gossip_misfit(self.name, flag, kSynchFreq, /*slowmo=*/false);
}

// A registry entry's make: the options checked, then the policy built.
template <class Policy>
std::unique_ptr<Strategy> make_gossip(const StrategyArgs& args) {
  check_gossip_options(args.info.name, args.options);
  Policy::check_policy_options(args.options.gossip);
  return std::make_unique<Policy>(args);
}

}  // namespace distopt::parallel::detail
