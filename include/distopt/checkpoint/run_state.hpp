// A run's state between two steps, besides its tensors: the manifest's
// "state" member (docs/formats.md, "Checkpoints"). JSON has no inf or NaN:
// such numbers are written as the strings "inf", "-inf" and "nan".
//
// parse_run_state reads outside input (a manifest that may be damaged or
// crafted): every member is checked before anything is used, and anything
// malformed is one InvalidInput line naming it (fuzz/run_state_fuzz.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::checkpoint {

struct RunState {
  // Per group: the numbers a scheduler may change (numeric and pair
  // options) and the extras (initial_lr, max_lr, ...).
  struct Group {
    std::map<std::string, OptionValue> options;
    std::map<std::string, double> extras;
  };
  std::optional<std::vector<Group>> groups;
  std::optional<SchedulerState> scheduler;      // the main lr scheduler
  std::optional<SchedulerState> swa_scheduler;  // SWALR, once SWA has started
  std::optional<GradScalerState> scaler;
  std::optional<std::int64_t> n_averaged;  // SWA/EMA, once it has averaged
  // Gossip runs: what a resumed run must share to go on rank by rank, and
  // every rank's step count and LocalState numbers.
  struct Gossip {
    std::string strategy;
    int world = 0;
    std::optional<parallel::GossipOptions> options;  // none: unreadable, so never the same run
    struct Rank {
      std::uint64_t steps = 0;
      std::vector<double> numbers;
    };
    std::vector<Rank> ranks;
    // The state of survivors of a lost rank, kept in memory
    // (LocalState::survivor): never in a checkpoint on disk.
    bool survivors = false;
  };
  std::optional<Gossip> gossip;
};

// The groups' current options and extras, as RunState keeps them.
std::vector<RunState::Group> groups_of(const Optimizer& optimizer);
// Sets the saved options and extras of every group (InvalidInput when the
// group count or an option's name or kind differs).
void load_groups(Optimizer& optimizer, const std::vector<RunState::Group>& groups);

std::string run_state_json(const RunState& state);
RunState parse_run_state(std::string_view json_text);

}  // namespace distopt::checkpoint
