// The training loop behind `distopt train`: a built-in model, a dataset, a
// parallel strategy and an optimizer, on one communicator (every rank runs
// train() with its own). Rank 0 reports progress to an observer.
#pragma once

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distopt/checkpoint/run.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/core/fault.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/optim/averaging.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::train {

struct TrainConfig {
  std::string model = "mlp";
  std::vector<std::size_t> hidden;  // mlp hidden widths; empty: 256, 128
  models::GptShape gpt;              // model gpt's shape (its context must match the data's windows)
  int threads = 1;                   // threads per rank for the model (gpt); the bits do not depend on it
  models::MatmulPrecision matmul_precision = models::MatmulPrecision::f32;  // gpt's products
  // gpt: blocks keep only their input and recompute their forward in
  // backward (the same bits; models::make_gpt).
  bool activation_checkpointing = false;
  // mlp: layers of more than this many outputs computed and used in row
  // tiles of it (models::ModelOptions::tile_rows; 0: whole layers).
  std::size_t tile_rows = 0;
  // Whose TrainResult holds the final parameters (params, averaged
  // params): every rank's, rank 0's alone, or none. Every rank's holds
  // their hash, computed as they are gathered a unit at a time, so that
  // the run's end need not hold a whole model per rank (the command line
  // keeps them only on rank 0, and only to export them).
  enum class KeepParams { every_rank, rank0, none };
  KeepParams keep_params = KeepParams::every_rank;
  std::string strategy = "ddp";
  // Bucket size and parameter dtype of the strategy (parallel::StrategyOptions).
  parallel::StrategyOptions parallel;
  parallel::OptimizerSpec optimizer{"adamw", {}};
  int epochs = 1;
  std::size_t batch_size = 128;  // global: the same at every world size
  std::uint64_t seed = 0;
  bool drop_last = false;
  std::size_t max_steps = 0;  // stop after this many steps in all (0: no limit)
  // Flush denormal floats to zero in the rank's thread while it trains
  // (x86 FTZ/DAZ, as TensorFlow does by default on CPUs): late in training,
  // tiny gradients and Adam's squared averages turn denormal and every
  // operation on them costs ~100 cycles (docs/performance.md).
  bool flush_denormals = true;
  // An lr scheduler on the strategy's optimizer, stepped after every
  // optimizer step, or after every epoch when scheduler_per_epoch is set;
  // reducelronplateau always steps per epoch, with the test loss as metric.
  std::optional<SchedulerSpec> scheduler;
  bool scheduler_per_epoch = false;

  // Gradient clipping between the gradient's reduction and the update:
  // clip_grad_norm (norm_type 1, 2, inf or any p > 0), then clip_grad_value.
  std::optional<double> clip_grad_norm;
  double clip_norm_type = 2.0;
  std::optional<double> clip_grad_value;

  // Dynamic loss scaling (GradScaler): the backward pass computes the
  // gradient of scale * loss; the update unscales it, skips the step on
  // inf/NaN and adapts the scale. Clipping sees unscaled gradients.
  std::optional<GradScalerOptions> loss_scale;

  // Weight averaging, evaluated beside the trained model after every epoch:
  // SWA (AveragedModel's running mean of the parameters at the end of
  // epoch swa_start and every later epoch; with swa_lr, SWALR anneals the
  // lr towards it per epoch from then on, in place of `scheduler`), or EMA
  // (averaged after every optimizer step with decay ema_decay).
  int swa_start = 0;  // 0: no SWA
  std::optional<double> swa_lr;
  long swa_anneal_epochs = 10;
  std::string swa_anneal_strategy = "cos";
  std::optional<double> ema_decay;

  // Divergence: a non-finite loss (on any rank) or, with clipping, a
  // non-finite total gradient norm in a step that was not skipped on
  // purpose by loss scaling. error: throw NonFiniteError naming the step,
  // the rank and the last finite loss; warn: tell the observer once and go
  // on; ignore: go on. Every rank decides the same at the same step.
  enum class OnNonFinite { error, warn, ignore };
  OnNonFinite on_nonfinite = OnNonFinite::error;

  // Cooperative stop: when *stop_flag is non-zero on any rank (a signal
  // handler sets it), every rank stops after the same step, evaluates, and
  // returns with TrainResult::interrupted set. The ranks agree through the
  // per-step loss gather, so a flag set on one rank only is enough.
  const std::atomic<int>* stop_flag = nullptr;

  // Checkpoints (docs/formats.md): with a directory, one every
  // checkpoint_every steps (0: only the last) and one when training ends
  // (also on a signal), keeping the newest keep_checkpoints. checkpoint_run
  // is a JSON object the manifest carries as "config" (distopt train saves
  // its effective configuration there, for --resume).
  std::string checkpoint_dir;
  std::size_t checkpoint_every = 0;
  std::size_t keep_checkpoints = 3;
  std::string checkpoint_run = "{}";
  // Resumes from a checkpoint (checkpoint::load_latest) at the step it was
  // saved at, at any world size and strategy.
  std::shared_ptr<const checkpoint::Loaded> resume;
  // A rank lost (failed, or silent past the communicator's time-out):
  // stop (every rank ends with the error), or go on with the survivors
  // (docs/reliability.md, "Survivors"): they re-form the world
  // (Communicator::shrink, an elastic threads world), take the state of the
  // last step they all completed from their own replica (ddp) or go back
  // to the last checkpoint in checkpoint_dir (zero1-3: the lost rank held
  // the only copy of its shard; see memory_checkpoint) or go on from each
  // one's own model (gossip and diloco), re-cut the data over the new world
  // and go on from the next step. adpsgd cannot.
  enum class OnRankFailure { stop, go_on };
  OnRankFailure on_rank_failure = OnRankFailure::stop;
  // With go_on under zero1-3: every checkpoint_every steps (and when a
  // segment starts) each rank keeps its checkpoint file in memory and sends
  // a copy to rank r + 1 (checkpoint::keep_in_memory); survivors go back to
  // it, the lost rank's file from its buddy, without reading the disk (the
  // checkpoint in checkpoint_dir, if any, when two neighbours were lost).
  bool memory_checkpoint = false;
  // Each rank is a process of its own (the mpi and gloo backends):
  // DISTOPT_FAULT's stall:RANK:STEP stops the process (SIGSTOP) and
  // kill:RANK:STEP kills it (SIGKILL), as `kill -STOP` and `kill -9` would.
  bool process_per_rank = false;
  // This process was admitted into a running run (gloo's --join): train()
  // takes the run's state from the others first (rank 0's replica under
  // ddp, the last checkpoint under zero1-3) and goes on with them. With
  // OnRankFailure::go_on, a run admits the processes that wait to join
  // between two steps (Communicator::pending_joins, grow).
  bool joining = false;
  // Fed on every rank, where train()'s observer is fed on rank 0 only: a
  // process world whose rank 0 may change (a survivor promoted after a
  // loss) keeps each process's record of the whole run until the end shows
  // which one reports.
  class Observer* every_rank_observer = nullptr;
};

// A change of the run's world: ranks lost after `step`.
struct MembershipChange {
  std::size_t step = 0;     // the step training goes on from (the next one is step + 1)
  // Steps done since that step, done again: a sharded strategy goes back to
  // its last checkpoint (0 for ddp, which goes on from its last step).
  std::size_t steps_redone = 0;
  int world_before = 0, world = 0;
  std::vector<int> lost;    // ranks of the world before
  std::vector<int> joined;  // ranks of the new world that joined it (Communicator::grow)
  double seconds = 0;       // spent re-forming the world and resuming from memory
  std::string reason;       // what a survivor saw (the lost collective)
};

struct StepMetrics {
  int epoch;                 // 1-based
  std::size_t step;          // steps so far, all epochs
  std::size_t epoch_step, epoch_steps;
  double loss;               // mean loss of this global batch
  double lr;                 // group 0's lr used by this step
  double wall_s;             // since training started
  double samples_per_s;      // training throughput so far in this epoch
  double grad_norm = -1;     // with clip_grad_norm: the total norm before clipping; else -1
  double loss_scale = 0;     // with loss_scale: the scale this step's backward used; else 0
  bool skipped = false;      // loss scaling found inf/NaN and skipped the update
  std::uint64_t bytes_sent = 0;  // by this rank through its communicator so far, setup included
};

struct EpochMetrics {
  int epoch;
  std::size_t step;
  double train_loss;  // mean over the epoch's samples
  double test_loss, test_accuracy;  // NaN without a test set (reported as null)
  double samples_per_s;  // training samples / training time (evaluation excluded)
  double wall_s;
  // The averaged model's figures, once it has averaged at least once.
  bool averaged = false;
  double avg_test_loss = 0, avg_test_accuracy = 0;
  // Gossip strategies: (1/n) sum_i |z_i - z_mean|^2 at the epoch's end; NaN otherwise.
  double consensus_distance = std::nan("");
};

class Observer {
 public:
  virtual ~Observer() = default;
  virtual void on_start(int /*epochs*/, std::size_t /*steps_per_epoch*/) {}
  virtual void on_step(const StepMetrics&) {}
  virtual void on_epoch(const EpochMetrics&) {}
  // Something the user should know that does not stop training (the first
  // non-finite step under OnNonFinite::warn), as one line.
  virtual void on_warning(const std::string&) {}
  // The world lost ranks and the survivors went on (OnRankFailure::go_on).
  virtual void on_membership(const MembershipChange&) {}
};

// Two observers as one (either may be null).
class BothObservers final : public Observer {
 public:
  BothObservers(Observer* a, Observer* b) : a_(a), b_(b) {}
  bool any() const { return a_ != nullptr || b_ != nullptr; }
  void on_start(int e, std::size_t s) override { each([&](Observer& o) { o.on_start(e, s); }); }
  void on_step(const StepMetrics& m) override { each([&](Observer& o) { o.on_step(m); }); }
  void on_epoch(const EpochMetrics& m) override { each([&](Observer& o) { o.on_epoch(m); }); }
  void on_warning(const std::string& w) override { each([&](Observer& o) { o.on_warning(w); }); }
  void on_membership(const MembershipChange& c) override { each([&](Observer& o) { o.on_membership(c); }); }

 private:
  template <class F>
  void each(F f) {
    if (a_ != nullptr) f(*a_);
    if (b_ != nullptr) f(*b_);
  }
  Observer *a_, *b_;
};

struct AveragedResult {
  AveragingKind kind = AveragingKind::swa;
  std::int64_t n_averaged = 0;
  double test_loss = 0, test_accuracy = 0;
  std::string param_hash;
  std::vector<float> params;  // unsharded, slot order like TrainResult::params
};

struct TrainResult {
  // NaN where there is nothing to measure (no test set): reported as null.
  double test_accuracy = 0, test_loss = 0, train_loss = 0;
  std::size_t steps = 0;
  double samples_per_s = 0;
  std::string param_hash;        // XXH3-64 of the final fp32 parameters, hex
  parallel::MemoryUse memory;
  std::uint64_t bytes_sent = 0;  // by this rank through its communicator, setup and evaluation included
  std::vector<ParamSlot> slots;  // offsets into `params` (no padding)
  std::vector<float> params;     // final, unsharded (see TrainConfig::keep_params)
  std::size_t skipped_steps = 0;  // loss scaling: updates skipped on inf/NaN
  double loss_scale = 0;          // loss scaling: the final scale
  std::optional<AveragedResult> averaged;  // SWA/EMA: the averaged model
  bool interrupted = false;        // stopped early through TrainConfig::stop_flag
  int stop_signal = 0;             // the flag's value that stopped it (a signal number)
  std::size_t nonfinite_steps = 0;  // steps with a non-finite loss or norm (warn/ignore)
  // Gossip strategies: the test figures and params are the average model's;
  // this is the ranks' consensus distance at the end. NaN otherwise.
  double consensus_distance = std::nan("");
  // With checkpoint_dir: how many were written, the seconds spent writing
  // them (this rank's wall time, the collective included), and the bytes
  // of the last one's rank files.
  std::size_t checkpoints_written = 0;
  std::size_t checkpoints_in_memory = 0;  // memory_checkpoint's (their seconds in checkpoint_seconds)
  double checkpoint_seconds = 0;
  std::uint64_t checkpoint_bytes = 0;
  // With TrainConfig::resume: the seconds this rank took to make its
  // strategy from the checkpoint and load the state (reading its ranges).
  double resume_seconds = 0;
  // The run's changes of world (OnRankFailure::go_on), in order.
  std::vector<MembershipChange> membership;
  // This rank's rank at the end: after changes of world, not the one train()
  // was called with (rank 0 at the end reports the run).
  int rank_at_end = 0;
};

// Throws InvalidInput for bad configurations (unknown model, batch smaller
// than the world, ...) on every rank alike, before any communication.
TrainResult train(Communicator& comm, const data::Split& data, const TrainConfig& config,
                  Observer* observer = nullptr);

// XXH3-64 of the float32 values' bytes (little-endian), as 16 hex digits.
std::string hash_params(const std::vector<float>& params);

}  // namespace distopt::train
