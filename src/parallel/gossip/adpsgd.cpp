// adpsgd, AD-PSGD (Lian et al. 2018; docs/gossip.md, "Asynchronous pairwise
// averaging"): x <- (x + x_partner) / 2 on a communication thread of its own
// (gossip::AsyncPairwise), the partner from a bipartite matching per round.
// The gradient is taken at z, a copy of x made after the last step with
// every average that had arrived; a step allows its round and waits only
// for the round synch_freq + 1 steps old. The only strategy whose bits
// depend on timing: the averages land in x whenever they complete.
#include "core.hpp"
#include "distopt/gossip/pairwise.hpp"

namespace distopt::parallel::detail {

namespace {

class Adpsgd final : public GossipCore {
 public:
  explicit Adpsgd(const StrategyArgs& a) : GossipCore(a) {
    z_ = x_;
    if (comm_.size() > 1) {
      pair_comm_ = comm_.split(0, comm_.rank());
      pairwise_ = std::make_unique<gossip::AsyncPairwise>(*pair_comm_, x_, x_mutex_);
    }
  }

  static void check_policy_options(const GossipOptions& g) {
    if (!g.topology.empty() && g.topology != "bipartite-exponential")
      throw InvalidInput(str("--topology ", g.topology,
                             ": adpsgd averages in pairs on bipartite-exponential (its only topology)"));
    if (g.peers_per_iteration != 1)
      throw InvalidInput("--peers-per-iteration: adpsgd averages with one partner at a time");
  }

  std::uint64_t bytes_sent() const override {
    return GossipCore::bytes_sent() + (pairwise_ ? pairwise_->bytes_sent() : 0);
  }

  // Pairs average at any time: no step at which the survivors' models stand.
  std::optional<LocalState> survivor_state() override { return std::nullopt; }

  void resume(std::uint64_t steps, const LocalState* saved) override {
    GossipCore::resume(steps, saved);
    z_ = x_;
    if (pairwise_) {
      pairwise_.reset();  // none allowed: ends at once
      pairwise_ =
          std::make_unique<gossip::AsyncPairwise>(*pair_comm_, x_, x_mutex_, gossip::AsyncPairwise::kTag, steps);
    }
  }

 private:
  // Allows the pairwise round of this step, waits for the one synch_freq + 1
  // steps older (bounded staleness), and takes the model's copy of x.
  void mix() override {
    if (pairwise_) pairwise_->allow(steps_);
    const auto lag = static_cast<std::uint64_t>(options_.synch_freq) + 1;
    copy_model_after(steps_ > lag ? steps_ - lag : 0);
  }
  std::span<const float> model_values() override { return z_; }
  // Every round allowed has completed, so x is every rank's x after the
  // same rounds.
  void settle() override { copy_model_after(steps_); }
  // The gossip thread's snapshot and received message.
  void add_memory(MemoryUse& m) const override { m.params += (pairwise_ ? 2 * x_.size() : 0) * sizeof(float); }

  // Waits until `rounds` pairwise rounds have completed, then takes the
  // model's copy of x with every average that has arrived.
  void copy_model_after(std::uint64_t rounds) {
    if (pairwise_ && rounds > 0) blocked([&] { pairwise_->wait_for(rounds); });
    std::lock_guard lock(x_mutex_);
    std::copy(x_.begin(), x_.end(), z_.begin());
  }

  // x_ is shared with the gossip thread, which has a communicator of its
  // own; pairwise_ is declared last so that it ends (joining its thread)
  // before everything it touches.
  std::unique_ptr<Communicator> pair_comm_;
  std::unique_ptr<gossip::AsyncPairwise> pairwise_;
};

}  // namespace

constexpr const char* kHelp = "a whole model per rank; asynchronous pairwise averaging on a communication thread";
extern const StrategyInfo kAdpsgd{.name = "adpsgd", .help = kHelp, .per_rank_models = true,
                                  .cannot_go_on = "asynchronous pairs", .option_misfit = topology_flags<true>, .make = make_gossip<Adpsgd>};

}  // namespace distopt::parallel::detail
