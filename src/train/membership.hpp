// A run's world when it changes (docs/reliability.md, "Survivors" and
// "Joins"): what a training segment throws when its world loses a rank or
// admits new ones (Interruption), and the re-forming that follows
// (membership::reform): a new communicator, the state every rank goes on
// from, and the change as the run reports it. train() in trainer.cpp is a
// loop over segments around it. Private to the train room.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/survival.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"

namespace distopt::train {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Thrown out of a segment whose world changes, under OnRankFailure::go_on:
// the state of the last step every survivor completed, kept in memory.
struct Interruption {
  // What the survivors go on from: this state (ddp), or the last
  // checkpoint, read once they have re-formed (zero1-3).
  std::optional<checkpoint::Loaded> state;
  std::string what;           // the loss, as the survivor saw it
  Clock::time_point since;    // when this rank's last step ended
  std::size_t done = 0;       // the steps this rank had completed
  TrainResult counts;         // the segment's counters (checkpoints, skipped and non-finite steps)
  // > 0: no rank was lost; this many processes wait to join (grow). < 0:
  // this process is the one joining (its state comes from the others).
  int joins = 0;
  std::vector<checkpoint::InMemory> memory = {};  // --memory-checkpoint's, newest first
};

// The counters a run sums over its segments.
inline void add_counts(TrainResult& into, const TrainResult& from) {
  into.checkpoints_written += from.checkpoints_written;
  into.checkpoints_in_memory += from.checkpoints_in_memory;
  into.checkpoint_seconds += from.checkpoint_seconds;
  into.skipped_steps += from.skipped_steps;
  into.nonfinite_steps += from.nonfinite_steps;
}

namespace membership {

// The communicator a rank trains in: the one train() was given, or the
// one the last change of world made (owned).
struct World {
  Communicator* comm;
  std::unique_ptr<Communicator> owned;
};

// This process was admitted into a running run (its communicator is the
// grown world): its state comes from the others in reform().
Interruption joining();

// A rank lost while a segment was being set up (the strategy's agreement, a
// resume): nothing trained in it, so the survivors start it again from
// `config`'s resume point.
Interruption lost_in_setup(const RankLost& e, const TrainConfig& config, const parallel::StrategyInfo& info);

// What the ranks of a re-formed world go on from.
struct Resumption {
  std::shared_ptr<const checkpoint::Loaded> resume;  // null: a fresh start
  MembershipChange change;
};

// Re-forms `world` after `lost` (shrinks, or grows to admit waiting
// processes; shrinks again if ranks are lost meanwhile), then brings every
// rank to one state and one step: a replica shared by the rank ahead, a
// checkpoint kept in memory or on disk, or each gossip survivor's own
// model. `config` is the segment's (its resume point, checkpoint
// directory, --memory-checkpoint).
Resumption reform(World& world, Interruption lost, const TrainConfig& config, const parallel::StrategyInfo& info);

}  // namespace membership
}  // namespace distopt::train
