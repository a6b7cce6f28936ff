// osgp, Overlap SGP (Assran et al. 2019; docs/gossip.md, "Training"): a
// push-sum round is sent after every step and added synch_freq + 1 steps
// later (waiting for it then if it has not arrived), so synch_freq + 1
// gossipers take turns in a pipeline; 1-OSGP with synch_freq 0. The
// schedule does not depend on arrival times: runs are reproducible bit for
// bit, and every rank ends with the same rounds sent.
#include "core.hpp"

namespace distopt::parallel::detail {

namespace {

class Osgp final : public GossipCore {
 public:
  explicit Osgp(const StrategyArgs& a) : GossipCore(a) {
    add_push_sum();
    for (int j = 1; j <= options_.synch_freq; ++j) add_push_sum(gossip::PushSum::kTag + j);
  }

 private:
  // Round k (the step's, from 0) goes to gossiper k mod (synch_freq + 1),
  // which first adds the round it sent synch_freq + 1 steps ago.
  void mix() override {
    const std::uint64_t round = steps_ - 1;
    const std::uint64_t turn = round % (pipeline_.size() + 1);
    gossip::PushSum& slot = turn == 0 ? *push_sum_ : *pipeline_[turn - 1];
    if (slot.in_flight()) blocked([&] { slot.finish(x_, w_); });
    slot.set_iteration(round);
    slot.start(x_, w_);
  }
};

}  // namespace

constexpr const char* kHelp =
    "sgp overlapped: a push-sum round sent after every step is added synch_freq + 1 steps later";
extern const StrategyInfo kOsgp{.name = "osgp", .help = kHelp, .per_rank_models = true,
                                .topology = "exponential", .option_misfit = topology_flags<true>, .make = make_gossip<Osgp>};

}  // namespace distopt::parallel::detail
