// The strategies this build runs: one line each, in the command-line
// contract's order (docs/architecture.md, "Where to add: a strategy").
// A strategy's properties live in its own file's StrategyInfo; this file
// only lists them and builds the one asked for.
#include <algorithm>
#include <vector>

#include "distopt/core/error.hpp"
#include "distopt/optim/rule.hpp"
#include "distopt/parallel/strategy.hpp"
#include "internal.hpp"

namespace distopt::parallel {

namespace detail {
// Each defined at the end of its strategy's file.
extern const StrategyInfo kDdp, kZero1, kZero2, kZero3;           // ddp.cpp, zero1.cpp, ...
extern const StrategyInfo kSgp, kOsgp, kDpsgd, kAdpsgd, kSlowmo, kDiloco;  // gossip/sgp.cpp, ...
}  // namespace detail

namespace {

std::vector<const StrategyInfo*>& registry() {
  static std::vector<const StrategyInfo*> all = {
      &detail::kDdp, &detail::kZero1, &detail::kZero2, &detail::kZero3,  // over the engine core
      &detail::kSgp, &detail::kOsgp,  &detail::kDpsgd, &detail::kAdpsgd,  // over the gossip core
      &detail::kSlowmo, &detail::kDiloco,
  };
  return all;
}

}  // namespace

std::span<const StrategyInfo* const> all_strategies() { return registry(); }

void register_strategy(const StrategyInfo& info) {
  if (find_strategy(info.name) != nullptr) throw InvalidInput(str("strategy '", info.name, "' is already registered"));
  if (info.make == nullptr) throw InvalidInput(str("strategy '", info.name, "' has no make function"));
  registry().push_back(&info);
}

const StrategyInfo* find_strategy(std::string_view name) {
  for (const StrategyInfo* s : registry())
    if (s->name == name) return s;
  return nullptr;
}

MemoryPerRank memory_per_rank(const StrategyInfo& info, int world) {
  return {info.memory.whole + info.memory.divided / world, info.memory.units_in_flight};
}

const StrategyInfo& strategy_or_throw(std::string_view name) {
  if (const StrategyInfo* s = find_strategy(name)) return *s;
  std::string known;
  for (const StrategyInfo* s : registry()) known += (known.empty() ? "" : ", ") + std::string(s->name);
  throw InvalidInput(str("unknown strategy '", name, "' (known: ", known, ")"));
}

void require_strategy(std::string_view name) { (void)strategy_or_throw(name); }

void require_exact(std::string_view strategy, const RuleInfo& rule) {
  const StrategyInfo& s = strategy_or_throw(strategy);
  if (!s.whole_tensor_needs_gather || rule.locality != Locality::whole_tensor || rule.whole != nullptr) return;
  throw InvalidInput(str("optimizer ", rule.name, " needs whole tensors (", name_of(rule.locality), "): strategy ",
                         strategy, " cannot run it exactly yet; use --strategy ddp"));
}

std::unique_ptr<Strategy> make_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                        const InitialParams& initial, const OptimizerSpec& optimizer,
                                        const StrategyOptions& options) {
  require_exact(name, rule_or_throw(optimizer.name));
  if (!optimizer.fallback.empty()) require_exact(name, rule_or_throw(optimizer.fallback));
  const StrategyInfo& info = strategy_or_throw(name);
  if (options.prefetch_units < 0)
    throw InvalidInput(str("prefetch units must be at least 0 (got ", options.prefetch_units, ")"));
  if (options.max_buckets_in_flight < 1)
    throw InvalidInput(str("buckets in flight must be at least 1 (got ", options.max_buckets_in_flight, ")"));
  return info.make({info, comm, layout, initial, optimizer, options});
}

}  // namespace distopt::parallel
