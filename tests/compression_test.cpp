// Gradient compression (StrategyOptions::grad_compression; docs/sharding.md,
// "Gradient compression"): the gradients of ddp, zero1, zero2 and zero3 go
// on the wire as bf16 or fp16, so the strategies still give each other's
// bits (not uncompressed ddp's), the reduction's bytes halve as the theory
// says, and what cannot be compressed is refused in one line.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "distopt/core/error.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "train_run.hpp"

namespace distopt {
namespace {

using parallel::GradCompression;

const std::vector<const char*> kStrategies{"ddp", "zero1", "zero2", "zero3"};

train::TrainConfig config(const std::string& optimizer, const std::string& strategy, GradCompression c) {
  train::TrainConfig t;
  t.model = "mlp";
  t.hidden = {24, 40, 8};  // units straddle shard boundaries at every world size
  t.optimizer = {optimizer, {}};
  if (optimizer == "sgd") t.optimizer.options = {{"lr", 0.05}, {"momentum", 0.9}};
  t.epochs = 2;
  t.batch_size = 32;
  t.seed = 11;
  t.strategy = strategy;
  t.parallel.bucket_elements = 300;  // several buckets, one of two units
  t.parallel.grad_compression = c;
  return t;
}

TEST(Compression, EveryStrategyGivesTheSameBitsWithCompressedGradients) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  for (const char* optimizer : {"adamw", "sgd"})
    for (int world : {1, 2, 3, 4}) {
      std::map<GradCompression, std::string> of;
      for (GradCompression c : {GradCompression::none, GradCompression::bf16, GradCompression::fp16}) {
        for (const char* strategy : kStrategies) {
          const std::string h = test_support::run_ranks(world, d, config(optimizer, strategy, c)).param_hash;
          if (!of.count(c)) of[c] = h;
          EXPECT_EQ(h, of[c]) << optimizer << " " << strategy << " world " << world << " " << parallel::name_of(c);
        }
      }
      // The rounding really happens, and differs between the two.
      EXPECT_NE(of[GradCompression::bf16], of[GradCompression::none]) << optimizer << " world " << world;
      EXPECT_NE(of[GradCompression::fp16], of[GradCompression::none]) << optimizer << " world " << world;
      EXPECT_NE(of[GradCompression::fp16], of[GradCompression::bf16]) << optimizer << " world " << world;
    }
}

// The reduction's bytes by the ZeRO model (StrategyInfo::volume_psi): per
// step a rank sends (n - 1) / n of the padded gradient in a reduce-scatter,
// and ddp as much again in its all-gather. Compressed, the gradients' share
// takes 2 bytes an element instead of 4; everything else a run sends (the
// parameters' all-gathers of zero1-3, setup, evaluation) is unchanged, so
// the difference is the theory's saving, within 5%.
TEST(Compression, TheReductionsBytesHalveAsTheTheorySays) {
  const data::Split d = data::make_synthetic_classification(20, 5, 400, 40, 3);
  for (const char* strategy : kStrategies)
    for (int world : {2, 4}) {
      train::TrainConfig c = config("adamw", strategy, GradCompression::none);
      c.hidden = {256, 64};
      c.epochs = 1;
      c.parallel.bucket_elements = 1 << 20;
      const train::TrainResult plain = test_support::run_ranks(world, d, c);
      c.parallel.grad_compression = GradCompression::bf16;
      const train::TrainResult half = test_support::run_ranks(world, d, c);
      // The padded gradient: what ddp's gradient buffer holds (zero2/3 hold a shard).
      c.strategy = "ddp";
      c.parallel.grad_compression = GradCompression::none;
      const double padded = static_cast<double>(test_support::run_ranks(world, d, c).memory.grads) / 4;
      const double reductions = std::string(strategy) == "ddp" ? 2 : 1;
      const double saving = static_cast<double>(plain.steps) * reductions * (world - 1) / world * padded * 2;
      const double measured = static_cast<double>(plain.bytes_sent) - static_cast<double>(half.bytes_sent);
      EXPECT_NEAR(measured / saving, 1.0, 0.05)
          << strategy << " world " << world << ": " << plain.bytes_sent << " bytes against " << half.bytes_sent;
      EXPECT_EQ(plain.steps, half.steps);
    }
}

TEST(Compression, WhatCannotBeCompressedIsRefusedInOneLine) {
  const data::Split d = data::make_synthetic_classification(20, 5, 64, 16, 3);
  auto refusal = [&](train::TrainConfig c) -> std::string {
    try {
      test_support::run_ranks(2, d, c);
    } catch (const InvalidInput& e) {
      return e.what();
    }
    return "accepted";
  };
  train::TrainConfig c = config("adamw", "sgp", GradCompression::bf16);
  EXPECT_EQ(refusal(c),
            "--grad-compression bf16: strategy sgp sends no gradients (compression is for ddp and zero1-3; diloco "
            "has --outer-dtype)");
  c = config("adamw", "zero2", GradCompression::fp16);
  c.parallel.param_dtype = DType::bf16;
  EXPECT_EQ(refusal(c),
            "--grad-compression fp16 with --param-dtype bf16: the gradients are bf16 on the wire already "
            "(compression is for f32 parameters)");
  EXPECT_EQ(parallel::parse_grad_compression("int2"), std::nullopt);
  EXPECT_EQ(parallel::grad_compression_names(), "none, bf16, fp16");
}

}  // namespace
}  // namespace distopt
