// Shared by the strategy engines of src/parallel (not installed).
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "distopt/parallel/strategy.hpp"

namespace distopt::parallel::detail {

// Setup check: every rank must agree on what it is about to train; a
// mismatch names the first rank that differs from rank 0 and the item.
void check_agreement(Communicator& comm, std::string_view strategy, const ShardLayout& layout,
                     const OptimizerSpec& spec, const StrategyOptions& options);

// sgp, osgp, dpsgd, slowmo (gossip_engine.cpp).
std::unique_ptr<Strategy> make_gossip_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                               std::span<const float> initial, const OptimizerSpec& optimizer,
                                               const StrategyOptions& options);

}  // namespace distopt::parallel::detail
