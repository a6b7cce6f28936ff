// A strategy that exists only in this file: ddp's code under another name
// and memory model, added to the registry when the module loads. Linked into
// a test build of distopt._core (python/CMakeLists.txt), it shows that a new
// strategy reaches the Python front end with one file and one registry call
// (test_sharded.py, test_a_registered_strategy_reaches_python).
#include "distopt/parallel/strategy.hpp"

namespace {

const distopt::parallel::StrategyInfo& throwaway() {
  // kDdp is constant-initialized, so copying it during static
  // initialization is safe.
  static const distopt::parallel::StrategyInfo info = [] {
    distopt::parallel::StrategyInfo s = distopt::parallel::strategy_or_throw("ddp");
    s.name = "throwaway";
    s.help = "a test's strategy: ddp's code";
    s.memory = {.whole = 3, .divided = 2, .units_in_flight = 1};
    return s;
  }();
  return info;
}

[[maybe_unused]] const bool kRegistered = (distopt::parallel::register_strategy(throwaway()), true);

}  // namespace
