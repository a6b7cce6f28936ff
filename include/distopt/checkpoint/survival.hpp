// Checkpoints kept in memory for a change of world (docs/reliability.md,
// "Survivors"): what the survivors of a lost rank, and the ranks that admit
// new ones, go on from without the disk -- a replica's state (capture), a
// gossip survivor's own (capture_survivor, rebase_survivor), the buddy
// copies of --memory-checkpoint (keep_in_memory, restore_from_memory), and
// a state as bytes for a rank that joins (to_bytes, from_bytes). The
// training loop's re-forming (src/train/membership.cpp) is their user.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/checkpoint/run.hpp"

namespace distopt::checkpoint {

// The state of a strategy whose every rank holds all of it (ddp: replicated
// parameters and optimizer state), with the run's parts, as a checkpoint of
// `step` kept in memory, from this rank alone (no communication): what the
// survivors of a lost rank resume from at their new world size
// (docs/reliability.md, "Survivors"). InvalidInput for a strategy whose
// ranks do not each hold the whole (zero1-3, gossip).
Loaded capture(parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts, std::uint64_t step);

// A gossip rank's own state after a collective of its world failed
// (`local`, its Strategy::survivor_state(); no communication), as a
// checkpoint of local.steps kept in memory for rank `rank` of a run of
// `world` ranks: what the survivors go on from, each its own
// (docs/reliability.md, "Survivors").
Loaded capture_survivor(parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                        const parallel::LocalState& local, int rank, int world);
// A survivor's state (capture_survivor) made rank `rank`'s of `world`
// ranks after `step` steps, with the run's state (schedulers, scaler,
// groups) of `run_state` (another survivor's, when it was ahead).
void rebase_survivor(Loaded& state, int rank, int world, std::uint64_t step, std::string_view run_state);
// Whether `state` is a survivor's (capture_survivor).
bool is_survivors_state(const Loaded& state);

// --memory-checkpoint (zero1-3; docs/reliability.md, "Survivors"): this
// rank's file of a checkpoint of `step`, as save() writes it, and its
// buddy's (rank r - 1's, the buddy of rank r + 1 being rank r), kept in
// memory; the run's configuration and state besides the tensors.
struct InMemory {
  std::uint64_t step = 0;
  int world = 0, rank = 0;
  std::vector<std::byte> mine, buddy;
  std::string config, state;
};
// Collective (a send to rank r + 1 and a receive from rank r - 1 on each).
InMemory keep_in_memory(Communicator& comm, parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                        std::uint64_t step);
// Collective on the survivors of the world the checkpoints were kept in,
// each passing the ones it keeps (any order; none is allowed): the
// checkpoint of the newest step every survivor keeps, each lost rank's
// file from its buddy. None where no step is kept by all, or a lost
// rank's buddy was lost too (the checkpoint on disk is then the way back).
// A rank that joins the run keeps none and passes `joining`: it receives
// the checkpoint with the others.
std::optional<Loaded> restore_from_memory(Communicator& comm, std::span<const InMemory> kept, bool joining = false);

// A state kept in memory (capture) as bytes, to send to a rank that joins
// a run, and back. from_bytes checks every size against the bytes before
// allocating; InvalidInput names what is malformed.
std::vector<char> to_bytes(const Loaded& state);
Loaded from_bytes(std::span<const char> bytes);

}  // namespace distopt::checkpoint
