// sgp, Stochastic Gradient Push (Assran et al. 2019; docs/gossip.md,
// "Training"): after every step one synchronous push-sum round of (x, w) on
// the topology (default exponential); the model runs on the de-biased
// x / w. The weights, counting none in flight, sum to the world size.
#include "core.hpp"

namespace distopt::parallel::detail {

namespace {

class Sgp final : public GossipCore {
 public:
  explicit Sgp(const StrategyArgs& a) : GossipCore(a) { add_push_sum(); }

 private:
  void mix() override { mix_push_sum(); }
};

}  // namespace

constexpr const char* kHelp = "a whole model per rank; a push-sum round on the topology after every step";
extern const StrategyInfo kSgp{.name = "sgp", .help = kHelp, .per_rank_models = true, .topology = "exponential",
                               .option_misfit = topology_flags<false>, .make = make_gossip<Sgp>};

}  // namespace distopt::parallel::detail
