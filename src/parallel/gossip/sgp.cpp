// sgp, Stochastic Gradient Push (Assran et al. 2019; docs/gossip.md,
// "Training"): after every step one synchronous push-sum round of (x, w) on
// the topology (default exponential); the model runs on the de-biased
// x / w. The weights, counting none in flight, sum to the world size.
#include "core.hpp"

namespace distopt::parallel::detail {

namespace {

class Sgp final : public GossipCore {
 public:
  Sgp(const StrategyInfo& info, Communicator& comm, const FlatLayout& flat, std::span<const float> initial,
      const OptimizerSpec& spec, const StrategyOptions& options)
      : GossipCore(info, comm, flat, initial, spec, options, "exponential") {
    add_push_sum();
  }

 private:
  void mix() override { mix_push_sum(); }
};

std::string misfit(std::string_view flag, const GossipOptions&) {
  return gossip_misfit(kSgp.name, flag, /*synch_freq=*/false, /*slowmo=*/false);
}

}  // namespace

extern const StrategyInfo kSgp{
    "sgp",
    "a whole model per rank; a push-sum round on the topology after every step",
    /*replicated_params=*/true,
    /*per_rank_models=*/true,
    /*whole_tensor_needs_gather=*/false,
    misfit,
    make_gossip<Sgp>,
    /*volume_psi=*/0};

}  // namespace distopt::parallel::detail
