// One segment of a run (docs/architecture.md, "The training loop"): from a
// start or a resume to the run's end, or until its world changes (a lost
// rank, an admission: membership.hpp's Interruption is thrown). A step is
// a sequence of named parts: load the batch, forward and backward, the
// strategy's step (reduce, then the StepChain: unscale, clip, step, and
// what follows an update), observe (the loss gathered in rank order, its
// report, non-finite values), checkpoint, fault injection, admissions; an
// epoch ends with evaluation, SWA and the per-epoch schedulers. Private to
// the train room.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/survival.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/averaging.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/parallel/layout.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "membership.hpp"
#include "step_chain.hpp"

namespace distopt::train {

// Throws InvalidInput for a configuration no segment can run (trainer.cpp).
void validate(const Communicator& comm, const data::Split& data, const TrainConfig& config);

// 16 hex digits.
std::string hex64(std::uint64_t h);

// What a rank reports to: the run's observer (rank 0's only) and
// TrainConfig::every_rank_observer; either may be null.
BothObservers reporting_of(const Communicator& comm, Observer* observer, const TrainConfig& config);

class Segment {
 public:
  // Checks the configuration, builds the model and the strategy (from the
  // model's initial values, or config.resume), and the optimizer's
  // companions. `first`: the run's first segment (reports its start,
  // injects DISTOPT_FAULT).
  Segment(Communicator& comm, const data::Split& data, const TrainConfig& config, Observer* observer, bool first);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Trains to the end; throws Interruption where the world changes.
  TrainResult run();

 private:
  enum class After { next, stop };
  void resume();
  void build_chain();
  checkpoint::RunParts parts();
  After train_epoch(int epoch);
  After train_step(int epoch, std::size_t k);
  std::size_t load_batch(int epoch, std::size_t k);  // this rank's piece of batch k: its size
  // The step's loss over all ranks, its report and its non-finite checks;
  // returns the stop request and the processes waiting to join.
  struct Observed {
    double stop_request = 0, joins = 0;
  };
  Observed observe(int epoch, std::size_t k, double lr, double loss_scale);
  void checkpoint_if_due(int epoch, std::size_t k, bool stopping);
  void inject_fault() const;
  void admit(int joins, int epoch);
  void end_epoch(int epoch);
  void finish();
  void keep_in_memory();
  void save(int epoch);
  Interruption on_rank_lost(const RankLost& e);

  bool validated_;  // first: the configuration is checked before anything is built
  Communicator& comm_;
  const data::Split& data_;
  const TrainConfig& config_;
  Observer* observer_;
  const bool first_;
  const DenormalMode denormals_;
  std::unique_ptr<models::Model> model_;
  parallel::FlatLayout layout_;
  std::size_t model_bytes_[2] = {};  // the largest activation_bytes(), workspace_bytes() after a step
  std::unique_ptr<parallel::Strategy> strategy_;
  Optimizer* optimizer_ = nullptr;
  std::unique_ptr<Scheduler> scheduler_;
  bool step_scheduler_per_batch_ = false;
  std::unique_ptr<Scheduler> swa_scheduler_;  // SWALR, built when SWA starts
  std::optional<GradScaler> scaler_;
  std::optional<AveragedParams> averaged_;
  checkpoint::RunInfo run_info_;
  double grad_norm_ = -1;
  StepChain chain_;

  std::optional<data::BatchSampler> sampler_;
  std::size_t per_epoch_ = 0, features_ = 0;
  BothObservers reporting_;
  bool report_ = false;
  std::vector<float> xb_, yb_;  // this rank's piece of a batch
  std::size_t eval_chunk_ = 0;

  // Per step, every rank contributes {loss sum, sample count, stop request,
  // and in an elastic world processes waiting to join} to a gather that
  // runs while the step does.
  int world_ = 0;
  bool elastic_ = false;
  std::size_t per_ = 3;
  double mine_[4] = {0, 0, 0, 0};
  std::vector<double> all_;
  std::unique_ptr<Request> gather_;  // waited for on the way out, also on an exception
  double last_finite_loss_ = 0;
  std::size_t last_finite_step_ = 0;
  bool warned_ = false;

  Fault fault_;
  TrainResult result_;
  Clock::time_point start_;
  double train_seconds_ = 0, train_samples_ = 0;
  double epoch_loss_ = 0, epoch_count_ = 0;
  Clock::time_point epoch_start_;
  bool stop_ = false;
  std::size_t start_step_ = 0;  // a resumed run goes on from the batch after its checkpoint's step
  int first_epoch_ = 1;
  bool checkpointing_ = false;
  std::size_t last_saved_ = 0;
  int epoch_now_ = 1;
  bool evaluated_ = false;
  bool save_after_epoch_ = false;
  // --memory-checkpoint: the checkpoints kept in memory, newest first (two
  // only until the next step shows that every rank kept the newest).
  bool in_memory_ = false;
  std::vector<checkpoint::InMemory> kept_;
  bool applied_ = false;  // the step in progress has updated the parameters
  bool may_grow_ = false;
  Clock::time_point last_step_end_;
};

}  // namespace distopt::train
