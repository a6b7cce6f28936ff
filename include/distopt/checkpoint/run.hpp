// A training run's checkpoints, saved and resumed (docs/formats.md,
// "Checkpoints"): the one place a run's configuration enters checkpoint/
// -- save() while training, load_latest() and resume() to go on.
//
// A checkpoint holds the strategy's tensors (checkpoint/state.hpp: the
// parameters and optimizer state, cut into pieces; a gossip rank's own
// state), the averaged model's values, and a manifest whose "run" member
// records what the run was (strategy, model, optimizer, its configuration)
// and its state between two steps (run_state.hpp: the groups' options, the
// schedulers', the loss scaler's, the averaging count, a gossip run's
// per-rank numbers).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/optim/averaging.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::checkpoint {

// The parts of a run a checkpoint keeps besides the strategy; a null
// member is a part the run does not have.
struct RunParts {
  Optimizer* optimizer = nullptr;      // the groups' options (what a scheduler set)
  Scheduler* scheduler = nullptr;      // the main lr scheduler
  Scheduler* swa_scheduler = nullptr;  // SWALR, once SWA has started
  GradScaler* scaler = nullptr;        // dynamic loss scaling
  AveragedParams* averaged = nullptr;  // SWA/EMA; saved once it has averaged
};

// What the run is, as its manifest records it.
struct RunInfo {
  std::string strategy, model, optimizer;
  // A gossip checkpoint goes on rank by rank only in a run of the same
  // strategy, world size and gossip options; otherwise from the consensus.
  parallel::GossipOptions gossip;
  std::string config = "{}";  // the run's configuration, a JSON object (distopt train's flags)
};

// Where checkpoints go and how many stay.
struct SaveOptions {
  std::filesystem::path root;
  std::size_t keep = 3;
};

// Writes the checkpoint of `step` (reached in `epoch`) under options.root
// (collective): every rank its file, in parallel; rank 0 the manifest,
// last, and prunes to options.keep. Returns the bytes of all rank files.
// IoError on every rank when any rank cannot write. (DISTOPT_FAULT
// exit:RANK:STEP:file|manifest ends the process while rank RANK writes
// the checkpoint of STEP: core/fault.hpp.)
std::uint64_t save(Communicator& comm, parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                   const SaveOptions& options, std::uint64_t step, int epoch);

// A checkpoint read back, verified and assembled.
struct Loaded {
  std::filesystem::path dir;
  std::uint64_t step = 0;
  std::string config = "{}";  // the saved run's configuration (a JSON object)
  std::string state = "{}";   // its state between two steps (run_state.hpp)
  std::map<std::string, Whole> wholes;
};

// The latest complete checkpoint under `root`; InvalidInput when there is
// none, or a manifest that carries no run configuration.
Loaded load_latest(const std::filesystem::path& root);

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

// Brings a strategy made from initial_params(layout, from.wholes) and the
// run's parts to the saved state: the optimizer state (a gossip rank's own
// where the run matches the saved one, see RunInfo::gossip), the strategy's
// step count and gossip state, the schedulers', the loss scaler's, the
// averages and the groups' options (collective). `start_swa` makes SWALR
// when the saved run had started it (parts.swa_scheduler is then ignored).
// InvalidInput when the saved run and this one cannot go together (a
// scheduler or loss scaling added or dropped, ...). Returns a warning for
// the user ("" for none): a gossip checkpoint resumed from the consensus.
std::string resume(Communicator& comm, parallel::Strategy& strategy, const Loaded& from, const RunInfo& run,
                   const RunParts& parts, const std::function<Scheduler&()>& start_swa);

}  // namespace distopt::checkpoint
