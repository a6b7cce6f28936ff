// The training loop with the ddp strategy on the threads backend, and the
// safetensors export.
#include <gtest/gtest.h>
#include <unistd.h>
#if defined(__SSE3__)
#include <pmmintrin.h>
#endif

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/train/trainer.hpp"
#include "train_run.hpp"

using namespace distopt;

namespace {

train::TrainConfig small_config() {
  train::TrainConfig c;
  c.model = "mlp";
  c.hidden = {32, 16};
  c.optimizer = {"adamw", {{"lr", 3e-3}}};
  c.epochs = 3;
  c.batch_size = 64;
  c.seed = 5;
  return c;
}

train::TrainResult run(int world, const data::Split& d, const train::TrainConfig& c) {
  return test_support::run_ranks(world, d, c);
}

}  // namespace

TEST(Train, LearnsTheSyntheticTeacher) {
  const data::Split d = data::make_synthetic_classification(32, 4, 4096, 1024, 1);
  const train::TrainResult r = run(1, d, small_config());
  EXPECT_EQ(r.steps, 3u * 64);  // 4096 / 64 per epoch
  std::vector<double> per_class(4);
  for (float y : d.test.y) per_class[static_cast<std::size_t>(y)] += 1.0 / double(d.test.size());
  const double majority = *std::max_element(per_class.begin(), per_class.end());
  EXPECT_GT(r.test_accuracy, majority + 0.2) << "always answering the commonest class scores " << majority;
  EXPECT_LT(r.train_loss, 0.8 * std::log(4.0)) << "the loss of a uniform guess is log 4";
}

// TrainConfig::keep_params decides whose result holds the final
// parameters, never their hash (streamed as they are gathered, the hash
// of the concatenation); zero3 and the gossip average included.
TEST(Train, KeepParamsDecidesWhoHoldsTheParametersNotTheirHash) {
  const data::Split d = data::make_synthetic_classification(32, 4, 512, 128, 1);
  using Keep = train::TrainConfig::KeepParams;
  for (const char* strategy : {"ddp", "zero3", "sgp"}) {
    train::TrainConfig c = small_config();
    c.epochs = 1;
    c.strategy = strategy;
    c.ema_decay = 0.9;
    const train::TrainResult all = run(3, d, c);
    ASSERT_FALSE(all.params.empty());
    EXPECT_EQ(all.param_hash, train::hash_params(all.params)) << strategy;
    EXPECT_EQ(all.averaged->param_hash, train::hash_params(all.averaged->params)) << strategy;
    for (Keep keep : {Keep::rank0, Keep::none}) {
      c.keep_params = keep;
      std::mutex m;
      std::vector<train::TrainResult> results(3);
      spawn(3, [&](Communicator& comm) {
        train::TrainResult r = train::train(comm, d, c);
        std::lock_guard lock(m);
        results[static_cast<std::size_t>(comm.rank())] = std::move(r);
      });
      for (int rank = 0; rank < 3; ++rank) {
        const train::TrainResult& r = results[static_cast<std::size_t>(rank)];
        EXPECT_EQ(r.param_hash, all.param_hash) << strategy << " rank " << rank;
        EXPECT_EQ(r.averaged->param_hash, all.averaged->param_hash) << strategy << " rank " << rank;
        const bool holds = keep == Keep::rank0 && rank == 0;
        EXPECT_EQ(r.params.size(), holds ? all.params.size() : 0u) << strategy << " rank " << rank;
        EXPECT_EQ(r.averaged->params.size(), holds ? all.params.size() : 0u) << strategy << " rank " << rank;
        if (holds) {
          EXPECT_EQ(r.params, all.params) << strategy;
        }
      }
    }
  }
}

TEST(Train, WorldSizesTrainTheSameModel) {
  // The same global batches at every world size: only the order of the
  // gradient additions differs, so the runs stay close.
  const data::Split d = data::make_synthetic_classification(32, 4, 2000, 500, 2);
  train::TrainConfig c = small_config();
  c.epochs = 2;
  const train::TrainResult a = run(1, d, c), b = run(3, d, c), e = run(4, d, c);
  ASSERT_EQ(a.params.size(), b.params.size());
  EXPECT_EQ(a.steps, b.steps);
  double max_diff = 0;
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    max_diff = std::max(max_diff, double(std::abs(a.params[i] - b.params[i])));
    max_diff = std::max(max_diff, double(std::abs(a.params[i] - e.params[i])));
  }
  EXPECT_LT(max_diff, 1e-3);
  EXPECT_NEAR(a.test_accuracy, b.test_accuracy, 0.01);
  EXPECT_NEAR(a.train_loss, e.train_loss, 1e-3);
}

TEST(Train, RunsAreReproducibleBitForBit) {
  const data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  c.epochs = 1;
  const std::string first = run(2, d, c).param_hash;
  EXPECT_EQ(run(2, d, c).param_hash, first);
  c.seed = 6;
  EXPECT_NE(run(2, d, c).param_hash, first);
}

TEST(Train, PartialLastBatchAndMaxSteps) {
  const data::Split d = data::make_synthetic_classification(16, 3, 1000, 100, 4);
  train::TrainConfig c = small_config();
  c.epochs = 2;
  c.batch_size = 300;  // 3 full batches and one of 100
  EXPECT_EQ(run(2, d, c).steps, 8u);
  c.drop_last = true;
  EXPECT_EQ(run(2, d, c).steps, 6u);
  c.max_steps = 4;
  EXPECT_EQ(run(1, d, c).steps, 4u);
}

TEST(Train, DenormalFlushingIsScopedToTraining) {
  const data::Split d = data::make_synthetic_classification(16, 3, 512, 64, 4);
  train::TrainConfig c = small_config();
  c.epochs = 1;
#if defined(__SSE3__)
  const unsigned before = _mm_getcsr();
#endif
  const train::TrainResult flushed = run(1, d, c);
#if defined(__SSE3__)
  EXPECT_EQ(_mm_getcsr(), before) << "train() must restore the caller's floating-point mode";
#endif
  c.flush_denormals = false;
  const train::TrainResult kept = run(1, d, c);
  ASSERT_EQ(kept.params.size(), flushed.params.size());
  // Normal-range values compute identically either way; a short run stays close.
  double max_diff = 0;
  for (std::size_t i = 0; i < kept.params.size(); ++i)
    max_diff = std::max(max_diff, double(std::abs(kept.params[i] - flushed.params[i])));
  EXPECT_LT(max_diff, 1e-4);
}

TEST(Train, LinearRegressionWithSgdReachesTheNoiseFloor) {
  const data::Split d = data::make_synthetic_regression(8, 4096, 1024, 0.1, 5);
  train::TrainConfig c;
  c.model = "linreg";
  c.optimizer = {"sgd", {{"lr", 0.05}, {"momentum", 0.9}}};
  c.epochs = 3;
  c.batch_size = 32;
  const train::TrainResult r = run(2, d, c);
  EXPECT_LT(r.test_loss, 0.5 * 0.1 * 0.1 * 1.5);  // noise variance / 2, plus 50%
}

TEST(Train, BadConfigurationsAreRejectedBeforeTraining) {
  const data::Split d = data::make_synthetic_classification(16, 3, 100, 10, 4);
  train::TrainConfig c = small_config();
  c.batch_size = 2;
  EXPECT_THROW(run(4, d, c), InvalidInput);
  c = small_config();
  c.model = "transformer";
  EXPECT_THROW(run(1, d, c), InvalidInput);
  c = small_config();
  c.strategy = "zero9";
  EXPECT_THROW(run(1, d, c), InvalidInput);
  c = small_config();
  c.optimizer.name = "adamz";
  EXPECT_THROW(run(1, d, c), InvalidInput);
  c = small_config();
  c.epochs = 0;
  EXPECT_THROW(run(1, d, c), InvalidInput);
}

TEST(Safetensors, RoundTripsAndReplacesAtomically) {
  const std::string dir = std::filesystem::temp_directory_path() / ("distopt_st_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  checkpoint::NamedTensors t;
  t.slots = {{"fc1.weight", 0, {2, 3}}, {"fc1.bias", 6, {2}}};
  t.data = {1, 2, 3, 4, 5, 6, -0.5f, 1e-30f};
  t.metadata = {{"model", "mlp"}};
  const std::string path = dir + "/p.safetensors";
  checkpoint::write_safetensors(path, t);
  const checkpoint::NamedTensors back = checkpoint::read_safetensors(path);
  ASSERT_EQ(back.slots.size(), 2u);
  EXPECT_EQ(back.metadata.at("model"), "mlp");
  for (const ParamSlot& s : t.slots) {
    const auto it = std::find_if(back.slots.begin(), back.slots.end(), [&](const ParamSlot& b) { return b.name == s.name; });
    ASSERT_NE(it, back.slots.end());
    EXPECT_EQ(it->shape, s.shape);
    for (std::size_t k = 0; k < s.numel(); ++k) EXPECT_EQ(back.data[it->offset + k], t.data[s.offset + k]);
  }
  // The header is 8-byte aligned and the file has exactly header + data.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(std::filesystem::file_size(path), 8 + n + 8 * 4);
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()), 1);
  // A failed write leaves the old file alone.
  EXPECT_THROW(checkpoint::write_safetensors(dir + "/missing/p.safetensors", t), IoError);
  // Corrupt files get clear errors.
  std::ofstream(dir + "/bad.safetensors", std::ios::binary) << "\x10\0\0\0\0\0\0\0{not json";
  EXPECT_THROW(checkpoint::read_safetensors(dir + "/bad.safetensors"), InvalidInput);
  std::filesystem::remove_all(dir);
}

namespace {

// Records rank 0's per-step and per-epoch figures.
struct Recorder final : train::Observer {
  std::vector<train::StepMetrics> steps;
  std::vector<train::EpochMetrics> epochs;
  void on_step(const train::StepMetrics& m) override { steps.push_back(m); }
  void on_epoch(const train::EpochMetrics& m) override { epochs.push_back(m); }
};

train::TrainResult run_recorded(int world, const data::Split& d, const train::TrainConfig& c, Recorder& rec) {
  train::TrainResult r0;
  spawn(world, [&](Communicator& comm) {
    train::TrainResult r = train::train(comm, d, c, &rec);
    if (comm.rank() == 0) r0 = std::move(r);
  });
  return r0;
}

}  // namespace

TEST(Train, PowerOfTwoLossScalingIsBitwiseNeutralAndGrows) {
  // A power-of-two scale multiplies and divides gradients exactly, so a
  // dynamically scaled fp32 run equals the unscaled one bit for bit.
  const data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  c.epochs = 2;
  const train::TrainResult plain = run(2, d, c);
  c.loss_scale = GradScalerOptions{.init_scale = 1024.0, .growth_interval = 7};
  Recorder rec;
  const train::TrainResult scaled = run_recorded(2, d, c, rec);
  EXPECT_EQ(scaled.param_hash, plain.param_hash);
  EXPECT_EQ(scaled.skipped_steps, 0u);
  EXPECT_EQ(scaled.loss_scale, 1024.0 * std::exp2(double(scaled.steps / 7)));
  ASSERT_EQ(rec.steps.size(), scaled.steps);
  EXPECT_EQ(rec.steps[0].loss_scale, 1024.0);
  EXPECT_EQ(rec.steps[7].loss_scale, 2048.0) << "grown after 7 good steps";
}

TEST(Train, NonFiniteGradientsSkipEveryStepAndBackOffTheScale) {
  // A huge lr blows the parameters up in step 1; from step 2 on the loss and
  // gradients are NaN, so every later step is skipped (the parameters stay
  // those after step 1) and the scale halves each time, as torch's does.
  const data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  c.optimizer = {"sgd", {{"lr", 1e30}}};
  c.loss_scale = GradScalerOptions{.init_scale = 4096.0};
  c.on_nonfinite = train::TrainConfig::OnNonFinite::ignore;  // the loss is NaN from step 2 on
  c.max_steps = 1;
  const train::TrainResult one = run(2, d, c);
  EXPECT_EQ(one.skipped_steps, 0u);
  c.max_steps = 9;
  Recorder rec;
  const train::TrainResult r = run_recorded(2, d, c, rec);
  ASSERT_EQ(r.steps, 9u);
  EXPECT_EQ(r.skipped_steps, 8u);
  EXPECT_EQ(r.param_hash, one.param_hash) << "a skipped step must leave the parameters alone";
  EXPECT_EQ(r.loss_scale, 4096.0 / 256.0);
  ASSERT_EQ(rec.steps.size(), 9u);
  EXPECT_FALSE(rec.steps[0].skipped);
  for (std::size_t i = 1; i < rec.steps.size(); ++i) {
    EXPECT_TRUE(rec.steps[i].skipped) << "step " << i + 1;
    EXPECT_EQ(rec.steps[i].loss_scale, 4096.0 / std::exp2(double(i - 1))) << "the scale step " << i + 1 << " used";
  }
}

TEST(Train, ClippingReportsTheNormAndAHugeBoundChangesNothing) {
  const data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  c.epochs = 1;
  const train::TrainResult plain = run(2, d, c);
  // A bound far above every norm: torch still multiplies by min(coef, 1) = 1.
  c.clip_grad_norm = 1e9;
  Recorder rec;
  EXPECT_EQ(run_recorded(2, d, c, rec).param_hash, plain.param_hash);
  double max_norm = 0;
  for (const auto& s : rec.steps) max_norm = std::max(max_norm, s.grad_norm);
  ASSERT_GT(max_norm, 0.0);
  // A bound below most norms changes the run, which still learns.
  c.clip_grad_norm = 0.5 * max_norm;
  c.clip_norm_type = std::numeric_limits<double>::infinity();
  Recorder tight;
  const train::TrainResult clipped = run_recorded(2, d, c, tight);
  EXPECT_NE(clipped.param_hash, plain.param_hash);
  EXPECT_LT(clipped.train_loss, std::log(4.0));
  for (const auto& s : tight.steps) EXPECT_GE(s.grad_norm, 0.0);
}

TEST(Train, SwaAveragesTheParametersOfEveryEpochEndFromSwaStart) {
  const data::Split d = data::make_synthetic_classification(16, 3, 600, 100, 4);
  train::TrainConfig c = small_config();
  // Runs are reproducible, so the parameters at the end of epoch k are
  // those of a run with k epochs.
  std::vector<std::vector<float>> ends;
  for (int e = 2; e <= 4; ++e) {
    c.epochs = e;
    ends.push_back(run(1, d, c).params);
  }
  AveragedParams want(ends[0].size());
  for (const auto& p : ends) want.update(p);
  c.epochs = 4;
  c.swa_start = 2;
  Recorder rec;
  const train::TrainResult r = run_recorded(2, d, c, rec);
  ASSERT_TRUE(r.averaged.has_value());
  EXPECT_EQ(r.averaged->n_averaged, 3);
  EXPECT_EQ(r.averaged->kind, AveragingKind::swa);
  ASSERT_EQ(r.averaged->params.size(), ends[0].size());
  double max_diff = 0;  // world 2 vs 1: the gradient sums differ in order
  for (std::size_t i = 0; i < ends[0].size(); ++i)
    max_diff = std::max(max_diff, double(std::abs(r.averaged->params[i] - want.params()[i])));
  EXPECT_LT(max_diff, 1e-4);
  ASSERT_EQ(rec.epochs.size(), 4u);
  EXPECT_FALSE(rec.epochs[0].averaged);
  EXPECT_TRUE(rec.epochs[1].averaged);
  EXPECT_EQ(rec.epochs[3].avg_test_accuracy, r.averaged->test_accuracy);
}

TEST(Train, SwaLrTakesOverTheLrWhenAveragingStarts) {
  const data::Split d = data::make_synthetic_classification(16, 3, 600, 100, 4);
  train::TrainConfig c = small_config();
  c.epochs = 4;
  c.batch_size = 100;  // 6 steps an epoch
  c.swa_start = 2;
  c.swa_lr = 1e-4;
  c.swa_anneal_epochs = 2;
  c.swa_anneal_strategy = "linear";
  c.scheduler = SchedulerSpec{"steplr", {{"step_size", 1.0}, {"gamma", 0.5}}, {}};
  c.scheduler_per_epoch = true;
  Recorder rec;
  run_recorded(1, d, c, rec);
  ASSERT_EQ(rec.steps.size(), 24u);
  EXPECT_DOUBLE_EQ(rec.steps[0].lr, 3e-3);
  EXPECT_DOUBLE_EQ(rec.steps[6].lr, 1.5e-3) << "StepLR until SWA starts";
  // End of epoch 2: SWALR's first step, half way (linear) from 1.5e-3 to swa_lr.
  EXPECT_DOUBLE_EQ(rec.steps[12].lr, 0.5 * 1.5e-3 + 0.5 * 1e-4);
  EXPECT_DOUBLE_EQ(rec.steps[18].lr, 1e-4);
}

TEST(Train, EmaWithDecayZeroIsTheModelItself) {
  const data::Split d = data::make_synthetic_classification(16, 3, 600, 100, 4);
  train::TrainConfig c = small_config();
  c.epochs = 1;
  c.ema_decay = 0.0;
  const train::TrainResult r = run(2, d, c);
  ASSERT_TRUE(r.averaged.has_value());
  EXPECT_EQ(r.averaged->n_averaged, static_cast<std::int64_t>(r.steps));
  EXPECT_EQ(r.averaged->param_hash, r.param_hash);
  EXPECT_EQ(r.averaged->test_accuracy, r.test_accuracy);
  c.ema_decay = 0.99;
  const train::TrainResult s = run(2, d, c);
  EXPECT_NE(s.averaged->param_hash, s.param_hash);
}

TEST(Train, BadClipScaleAndAveragingOptionsAreRejected) {
  const data::Split d = data::make_synthetic_classification(16, 3, 100, 10, 4);
  auto rejects = [&](auto&& change, const char* what) {
    train::TrainConfig c = small_config();
    change(c);
    try {
      run(1, d, c);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  rejects([](auto& c) { c.clip_grad_norm = -1.0; }, "--clip-grad-norm must be a positive number");
  rejects([](auto& c) { c.clip_grad_value = 0.0; }, "--clip-grad-value must be a positive number");
  rejects([](auto& c) { c.clip_norm_type = 0.0; }, "--clip-norm-type must be positive");
  rejects([](auto& c) { c.swa_start = 9; }, "is after the last epoch");
  rejects([](auto& c) { c.swa_start = 1, c.ema_decay = 0.9; }, "cannot be combined");
  rejects([](auto& c) { c.swa_start = 2, c.max_steps = 2; }, "ends training in epoch 1 (2 steps each)");
  rejects([](auto& c) { c.swa_lr = 0.1; }, "--swa-lr needs --swa-start");
  rejects([](auto& c) { c.ema_decay = 1.5; }, "--ema-decay must be in [0, 1]");
  rejects([](auto& c) { c.loss_scale = GradScalerOptions{.growth_factor = 0.9}; }, "The growth factor must be > 1.0");
  rejects([](auto& c) { c.loss_scale = GradScalerOptions{.init_scale = 1e39}; }, "positive finite float32");
  rejects([](auto& c) { c.loss_scale = GradScalerOptions{.init_scale = 1e-50}; }, "positive finite float32");
}

// Divergence, missing values and cooperative stops (docs/reliability.md).

TEST(Train, ANonFiniteLossStopsEveryRankNamingTheStepAndTheRank) {
  // One training sample holds a NaN: the first step whose batch includes it
  // has a NaN loss on the rank that holds the sample.
  data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  const std::size_t poisoned = 123;
  d.train.x[poisoned * d.train.features + 5] = std::nanf("");
  data::BatchSampler sampler(d.train.size(), c.batch_size, c.seed, false);
  std::size_t step = 0;
  int rank = -1;
  for (std::size_t k = 0; k < sampler.batches_per_epoch() && rank < 0; ++k)
    for (int r = 0; r < 3 && rank < 0; ++r)
      for (std::uint32_t i : sampler.local_batch(k, r, 3))
        if (i == poisoned) step = k + 1, rank = r;
  ASSERT_GE(rank, 0);
  ASSERT_GT(step, 1u) << "pick another sample: the test needs a finite step before";
  try {
    run(3, d, c);
    FAIL() << "no error";
  } catch (const NonFiniteError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(str("step ", step, ": the loss is nan on rank ", rank, " (the last finite loss was "), 0), 0u)
        << what;
    EXPECT_NE(what.find(str(", at step ", step - 1, ")")), std::string::npos) << what;
  }
  // warn and ignore train on and count the steps; warn says so once.
  struct Warnings final : train::Observer {
    std::vector<std::string> lines;
    void on_warning(const std::string& w) override { lines.push_back(w); }
  } warnings;
  c.on_nonfinite = train::TrainConfig::OnNonFinite::warn;
  c.epochs = 1;
  train::TrainResult r0;
  spawn(3, [&](Communicator& comm) {
    train::TrainResult r = train::train(comm, d, c, &warnings);
    if (comm.rank() == 0) r0 = std::move(r);
  });
  EXPECT_GE(r0.nonfinite_steps, 1u);
  ASSERT_EQ(warnings.lines.size(), 1u);
  EXPECT_EQ(warnings.lines[0].rfind(str("step ", step, ": the loss is nan on rank ", rank), 0), 0u) << warnings.lines[0];
  c.on_nonfinite = train::TrainConfig::OnNonFinite::ignore;
  EXPECT_EQ(run(3, d, c).nonfinite_steps, r0.nonfinite_steps);
}

TEST(Train, StepsThatLossScalingSkipsOnPurposeAreNotDivergence) {
  // An init scale of 2^30 overflows the f16 gradients of the first steps
  // (the norm is inf); the scaler skips them and backs off, the loss stays
  // finite: no divergence.
  const data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  c.epochs = 1;
  c.parallel.param_dtype = DType::f16;
  c.clip_grad_norm = 1.0;
  c.loss_scale = GradScalerOptions{.init_scale = std::ldexp(1.0, 30)};
  const train::TrainResult r = run(2, d, c);
  EXPECT_GT(r.skipped_steps, 0u);
  EXPECT_EQ(r.nonfinite_steps, 0u);
}

TEST(Train, WithoutATestSetTheTestFiguresAreMissingNotZero) {
  data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  d.test = data::Dataset{d.test.features, d.test.classes, {}, {}, {}};
  train::TrainConfig c = small_config();
  c.epochs = 1;
  c.ema_decay = 0.9;
  const train::TrainResult r = run(2, d, c);
  EXPECT_TRUE(std::isnan(r.test_accuracy));
  EXPECT_TRUE(std::isnan(r.test_loss));
  EXPECT_TRUE(std::isfinite(r.train_loss));
  ASSERT_TRUE(r.averaged);
  EXPECT_TRUE(std::isnan(r.averaged->test_accuracy));
  c.scheduler = SchedulerSpec{"reducelronplateau", {}, {}};
  EXPECT_THROW(run(2, d, c), InvalidInput);
}

TEST(Train, AStopRequestOnOneRankStopsEveryRankAfterTheSameStep) {
  // Only rank 2 sees the flag (as when SIGTERM reaches one MPI process):
  // all three ranks stop after the step it was seen in, evaluate and
  // return the same parameters.
  const data::Split d = data::make_synthetic_classification(32, 4, 1000, 200, 3);
  train::TrainConfig c = small_config();
  std::atomic<int> flag{0};
  std::vector<train::TrainResult> results(3);
  spawn(3, [&](Communicator& comm) {
    train::TrainConfig mine = c;
    if (comm.rank() == 2) mine.stop_flag = &flag;
    struct SetFlagAtStep4 final : train::Observer {
      std::atomic<int>* f;
      void on_step(const train::StepMetrics& m) override {
        if (m.step == 4) f->store(15);
      }
    } set{};
    set.f = &flag;
    results[comm.rank()] = train::train(comm, d, mine, comm.rank() == 0 ? &set : nullptr);
  });
  for (const auto& r : results) {
    EXPECT_TRUE(r.interrupted);
    EXPECT_EQ(r.stop_signal, 15);
    // Rank 0 raises the flag after step 4's gather; rank 2 reads it when
    // it posts step 5's or 6's contribution, depending on timing.
    EXPECT_GE(r.steps, 5u);
    EXPECT_LE(r.steps, 6u);
    EXPECT_EQ(r.steps, results[0].steps);
    EXPECT_EQ(r.param_hash, results[0].param_hash);
    EXPECT_TRUE(std::isfinite(r.test_accuracy)) << "evaluated after stopping";
  }
}
