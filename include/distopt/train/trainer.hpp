// The training loop behind `distopt train`: a built-in model, a dataset, a
// parallel strategy and an optimizer, on one communicator (every rank runs
// train() with its own). Rank 0 reports progress to an observer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "distopt/comm/communicator.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::train {

struct TrainConfig {
  std::string model = "mlp";
  std::vector<std::size_t> hidden;  // mlp hidden widths; empty: 256, 128
  std::string strategy = "ddp";
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
};

struct StepMetrics {
  int epoch;                 // 1-based
  std::size_t step;          // steps so far, all epochs
  std::size_t epoch_step, epoch_steps;
  double loss;               // mean loss of this global batch
  double lr;                 // group 0's lr used by this step
  double wall_s;             // since training started
  double samples_per_s;      // training throughput so far in this epoch
};

struct EpochMetrics {
  int epoch;
  std::size_t step;
  double train_loss;  // mean over the epoch's samples
  double test_loss, test_accuracy;
  double samples_per_s;  // training samples / training time (evaluation excluded)
  double wall_s;
};

class Observer {
 public:
  virtual ~Observer() = default;
  virtual void on_start(int /*epochs*/, std::size_t /*steps_per_epoch*/) {}
  virtual void on_step(const StepMetrics&) {}
  virtual void on_epoch(const EpochMetrics&) {}
};

struct TrainResult {
  double test_accuracy = 0, test_loss = 0, train_loss = 0;
  std::size_t steps = 0;
  double samples_per_s = 0;
  std::string param_hash;        // XXH3-64 of the final fp32 parameters, hex
  parallel::MemoryUse memory;
  std::vector<ParamSlot> slots;  // offsets into `params` (no padding)
  std::vector<float> params;     // final, unsharded
};

// Throws InvalidInput for bad configurations (unknown model, batch smaller
// than the world, ...) on every rank alike, before any communication.
TrainResult train(Communicator& comm, const data::Split& data, const TrainConfig& config,
                  Observer* observer = nullptr);

// XXH3-64 of the float32 values' bytes (little-endian), as 16 hex digits.
std::string hash_params(const std::vector<float>& params);

}  // namespace distopt::train
