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
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/source.hpp"
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

// A checkpoint to go on from: one on disk, verified, its tensors read as
// they are needed; or one kept in memory (survival.hpp), whole.
struct Loaded {
  std::filesystem::path dir;
  std::uint64_t step = 0;
  std::string config = "{}";  // the saved run's configuration (a JSON object)
  std::string state = "{}";   // its state between two steps (run_state.hpp)
  std::shared_ptr<const PieceFiles> files;  // on disk
  std::map<std::string, Whole> wholes;      // in memory
  bool has_tensors() const { return files != nullptr || !wholes.empty(); }
};

// A Loaded's tensors, wherever they are (`from` must outlive it).
class LoadedTensors final : public TensorSource {
 public:
  explicit LoadedTensors(const Loaded& from) : files_(from.files.get()), memory_(from.wholes) {}
  std::vector<std::string> names() const override { return in().names(); }
  const Shape* shape(const std::string& name) const override { return in().shape(name); }
  void read(const std::string& name, std::uint64_t begin, std::span<float> out) const override {
    in().read(name, begin, out);
  }

 private:
  const TensorSource& in() const { return files_ != nullptr ? *files_ : static_cast<const TensorSource&>(memory_); }
  const PieceFiles* files_;
  WholeTensors memory_;
};

// The latest complete checkpoint under `root`, its files verified (sizes
// and checksums) and their headers read; InvalidInput when there is none,
// or a manifest that carries no run configuration.
Loaded load_latest(const std::filesystem::path& root);

// Brings a strategy made from initial_params(layout, LoadedTensors(from)) and the
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
