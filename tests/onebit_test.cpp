// 1-bit Adam (--grad-compression onebit; docs/sharding.md, "1-bit Adam"):
// sign packets keep what they lose, the warm-up is plain Adam's bits, after
// it ddp, zero1 and zero2 give each other's bits and train about as well as
// uncompressed Adam, the bytes are the theory's, a checkpoint resumes to the
// uninterrupted run's bits, and what cannot run is refused in one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../src/parallel/onebit_wire.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/core/error.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "train_run.hpp"

namespace distopt {
namespace {

using parallel::GradCompression;

train::TrainConfig config(const std::string& strategy, GradCompression c, std::size_t warmup) {
  train::TrainConfig t;
  t.model = "mlp";
  t.hidden = {24, 40, 8};  // units straddle shard boundaries at every world size
  t.optimizer = {"adamw", {{"lr", 0.01}}};
  t.epochs = 2;
  t.batch_size = 32;
  t.seed = 11;
  t.strategy = strategy;
  t.parallel.bucket_elements = 300;  // several buckets, one of two units
  t.parallel.grad_compression = c;
  t.parallel.onebit_warmup = warmup;
  return t;
}

// A packet: one scale per block, the root mean square of the block's
// nonzero magnitudes of v = x + e, each clipped at 3 times their median; each value arrives as +scale (v >= 0, -0
// included) or -scale; what stays is v minus what arrives, so the two add
// up to v within the rounding of that subtraction; nothing is written past
// the packet; adding puts a second packet's values on top.
TEST(OneBit, PacketsAreSignsTimesTheirBlocksClippedRootMeanSquare) {
  using parallel::detail::kOnebitBlock;
  using parallel::detail::onebit_pack;
  using parallel::detail::onebit_packet_bytes;
  using parallel::detail::onebit_unpack;
  EXPECT_EQ(onebit_packet_bytes(0), 0u);
  EXPECT_EQ(onebit_packet_bytes(1), 4u + 4u);
  EXPECT_EQ(onebit_packet_bytes(1024), 4u + 128u);
  EXPECT_EQ(onebit_packet_bytes(1025), 8u + 132u);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  for (std::size_t n : {std::size_t{1}, std::size_t{31}, kOnebitBlock, std::size_t{3000}}) {
    std::vector<float> x(n), e(n);
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = normal(gen) * std::exp2(static_cast<float>(i % 20) - 10.0f);
      e[i] = normal(gen) * 1e-2f;
    }
    if (n > 4) x[1] = 0.0f, e[1] = 0.0f, x[2] = -0.0f, e[2] = -0.0f, x[3] = 0.0f, e[3] = -0.0f;
    if (n > kOnebitBlock) std::fill_n(x.begin(), kOnebitBlock, 0.0f), std::fill_n(e.begin(), kOnebitBlock, 0.0f);
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = x[i] + e[i];
    std::vector<char> packet(onebit_packet_bytes(n) + 1, '\x5a');
    onebit_pack(x.data(), e.data(), n, packet.data());
    EXPECT_EQ(packet.back(), '\x5a') << "wrote past the packet, n " << n;
    std::vector<float> got(n, 3.0f);
    onebit_unpack(packet.data(), n, got.data(), false);
    for (std::size_t b = 0; b * kOnebitBlock < n; ++b) {
      const std::size_t first = b * kOnebitBlock, last = std::min(n, first + kOnebitBlock);
      // The magnitudes' median (the upper one), each clipped at 3 times it.
      std::vector<double> mags;
      for (std::size_t i = first; i < last; ++i)
        if (v[i] != 0.0f) mags.push_back(std::fabs(v[i]));
      std::vector<double> sorted = mags;
      std::sort(sorted.begin(), sorted.end());
      long double squares = 0;
      for (double a : mags) squares += std::pow(std::min(a, 3.0 * (sorted.empty() ? 0 : sorted[sorted.size() / 2])), 2);
      float scale;
      std::memcpy(&scale, packet.data() + b * sizeof(float), sizeof scale);
      const double want = mags.empty() ? 0.0 : std::sqrt(static_cast<double>(squares / mags.size()));
      EXPECT_NEAR(scale, want, 1e-6 * want) << "n " << n << " block " << b;
      for (std::size_t i = first; i < last; ++i) {
        ASSERT_EQ(got[i], std::signbit(v[i]) && v[i] != 0.0f ? -scale : scale) << "n " << n << " element " << i;
        const double sum = static_cast<double>(got[i]) + static_cast<double>(e[i]);
        const float ae = std::fabs(e[i]);
        ASSERT_LE(std::fabs(sum - v[i]), 0.5 * (std::nextafter(ae, INFINITY) - ae) + 1e-30)
            << "n " << n << " element " << i;
      }
    }
    std::vector<float> twice = got;
    onebit_unpack(packet.data(), n, twice.data(), true);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(twice[i], got[i] + got[i]);
  }
  // Non-finite values: the scale is the finite values' (here 1.5 in every
  // block), -inf arrives as -scale, inf and NaN as +scale, and they leave
  // no residual; an all-NaN block sends scale 0.
  std::vector<float> x(3 * kOnebitBlock, 1.0f), e(3 * kOnebitBlock, 0.5f);
  x[3] = INFINITY;
  x[kOnebitBlock + 9] = NAN;
  x[kOnebitBlock + 10] = -INFINITY;
  std::fill(x.begin() + 2 * kOnebitBlock, x.end(), NAN);
  std::vector<char> packet(onebit_packet_bytes(x.size()));
  onebit_pack(x.data(), e.data(), x.size(), packet.data());
  std::vector<float> got(x.size());
  onebit_unpack(packet.data(), x.size(), got.data(), false);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float scale = i < 2 * kOnebitBlock ? 1.5f : 0.0f;
    EXPECT_EQ(got[i], x[i] == -INFINITY ? -scale : scale) << i;
    EXPECT_EQ(e[i], 0.0f) << i;
  }
}

// The median that clips a block is found by a selection on the magnitudes'
// bits, not a sort: on blocks where that selection is hardest (magnitudes
// that differ only in their last bits, all equal, two values, subnormals,
// spread over every exponent), with outliers above three times the median
// so that the clip decides the scale, the scale is bit for bit the one a
// sort gives (the same float clip, the same index-order double sum).
TEST(OneBit, TheClippingMedianIsTheSortedBlocksMiddle) {
  using parallel::detail::kOnebitBlock;
  std::mt19937 gen(11);
  std::uniform_int_distribution<std::uint32_t> low(0, 127), any(1, 0x7F7FFFFFu);
  std::vector<std::vector<float>> blocks(6, std::vector<float>(kOnebitBlock));
  for (std::size_t i = 0; i < kOnebitBlock; ++i) {
    const float sign = i % 3 == 0 ? -1.0f : 1.0f;
    blocks[0][i] = sign * std::bit_cast<float>(0x3F800000u + low(gen));  // 1 + a few ulps
    blocks[1][i] = sign * 0.25f;
    blocks[2][i] = sign * (i % 2 == 0 ? 0.5f : 0.5000001f);
    blocks[3][i] = sign * std::bit_cast<float>(1u + low(gen) * 1000u);  // subnormals
    blocks[4][i] = sign * std::bit_cast<float>(any(gen));
    blocks[5][i] = i < 700 ? sign * std::bit_cast<float>(0x3F800000u + (low(gen) << 8)) : 0.0f;
    if (i % 7 == 0) blocks[i % 5][i] *= 1e3f;  // outliers, clipped
    if (i % 11 == 0) blocks[5][i] *= 1e3f;     // 700 nonzero values among zeros
  }
  for (std::size_t k = 0; k < blocks.size(); ++k) {
    const std::vector<float>& v = blocks[k];
    std::vector<float> mags;
    for (float x : v)
      if (x != 0.0f) mags.push_back(std::fabs(x));
    std::vector<float> sorted = mags;
    std::sort(sorted.begin(), sorted.end());
    const float clip = 3.0f * sorted[sorted.size() / 2];
    double squares = 0;
    for (float a : mags) squares += double(std::min(a, clip)) * double(std::min(a, clip));
    const float want = static_cast<float>(std::sqrt(squares / double(mags.size())));
    std::vector<char> packet(parallel::detail::onebit_packet_bytes(v.size()));
    parallel::detail::onebit_pack(v.data(), nullptr, v.size(), packet.data());
    float scale;
    std::memcpy(&scale, packet.data(), sizeof scale);
    EXPECT_EQ(scale, want) << "block " << k;
  }
}

// Before its variance is frozen, 1-bit Adam is the rule's own Adam: a
// warm-up longer than the run gives uncompressed ddp's bits. After it,
// ddp, zero1 and zero2 give each other's bits (one rank order for the
// shares and the owners' sums), not Adam's, and train about as well; with
// Adam's L2 decay (in the local moments) too.
TEST(OneBit, WarmUpIsAdamAndThenTheStrategiesGiveEachOthersBits) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  for (const char* rule : {"adamw", "adam"})
    for (int world : {1, 2, 3, 4}) {
      SCOPED_TRACE(std::string(rule) + " world " + std::to_string(world));
      train::TrainConfig c = config("ddp", GradCompression::none, 100);
      c.optimizer.name = rule;
      if (std::string(rule) == "adam") c.optimizer.options["weight_decay"] = 0.01;
      const train::TrainResult none = test_support::run_ranks(world, d, c);
      c.parallel.grad_compression = GradCompression::onebit;
      c.parallel.onebit_warmup = 1000;
      EXPECT_EQ(test_support::run_ranks(world, d, c).param_hash, none.param_hash);
      c.parallel.onebit_warmup = 3;
      std::string first;
      for (const char* strategy : {"ddp", "zero1", "zero2"}) {
        c.strategy = strategy;
        const train::TrainResult r = test_support::run_ranks(world, d, c);
        if (first.empty()) first = r.param_hash;
        EXPECT_EQ(r.param_hash, first) << strategy;
        EXPECT_NE(r.param_hash, none.param_hash) << strategy;
        EXPECT_NEAR(r.test_accuracy, none.test_accuracy, 0.05) << strategy;
      }
    }
}

// The bytes by the ZeRO model: a frozen step sends, per rank, (n - 1) / n
// of the padded moment as packets to the owners and as much again in the
// owners' gather, 1/8 + 4/1024 bytes an element each, in place of ddp's
// all-reduce (twice (n - 1) / n of 4 bytes) or zero1/2's reduce-scatter
// (once); zero1/2 gather the whole first moment and the frozen step's
// denominators once, at the first frozen step. The warm-up step sends what
// uncompressed Adam sends.
TEST(OneBit, TheBytesAreTheTheorys) {
  const data::Split d = data::make_synthetic_classification(20, 5, 400, 40, 3);
  for (const char* strategy : {"ddp", "zero1", "zero2"})
    for (int world : {2, 4}) {
      SCOPED_TRACE(std::string(strategy) + " world " + std::to_string(world));
      train::TrainConfig c = config(strategy, GradCompression::none, 1);
      c.hidden = {256, 64};
      c.epochs = 1;
      c.parallel.bucket_elements = 1 << 20;
      const train::TrainResult plain = test_support::run_ranks(world, d, c);
      c.strategy = "ddp";
      const double padded = static_cast<double>(test_support::run_ranks(world, d, c).memory.grads) / 4;
      c.strategy = strategy;
      c.parallel.grad_compression = GradCompression::onebit;
      const train::TrainResult less = test_support::run_ranks(world, d, c);
      ASSERT_EQ(plain.steps, less.steps);
      const bool ddp = std::string(strategy) == "ddp";
      const double part = double(world - 1) / world * padded, packets = 1.0 / 8 + 4.0 / 1024;
      const double frozen = double(plain.steps - 1);
      const double saving = frozen * part * ((ddp ? 2 : 1) * 4.0 - 2 * packets) - (ddp ? 0 : 2 * part * 4.0);
      const double measured = static_cast<double>(plain.bytes_sent) - static_cast<double>(less.bytes_sent);
      EXPECT_NEAR(measured / saving, 1.0, 0.05) << plain.bytes_sent << " bytes against " << less.bytes_sent;
    }
}

// The ranks' and the owners' residuals are part of a checkpoint, and the
// first moment is the optimizer's own state: saved after 6 steps (3 of
// them frozen) and resumed, a run ends with the uninterrupted run's bits
// (ddp, zero2), and not without the residuals.
TEST(OneBit, ResumesToTheUninterruptedRunsBits) {
  namespace fs = std::filesystem;
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  const fs::path root = fs::temp_directory_path() / ("distopt-onebit-" + std::to_string(::getpid()));
  for (const char* strategy : {"ddp", "zero2"}) {
    SCOPED_TRACE(strategy);
    fs::remove_all(root);
    const train::TrainConfig c = config(strategy, GradCompression::onebit, 3);
    const std::string straight = test_support::run_ranks(3, d, c).param_hash;
    train::TrainConfig first = c;
    first.max_steps = 6;
    first.checkpoint_dir = (root / "a").string();
    (void)test_support::run_ranks(3, d, first);
    auto saved = std::make_shared<const checkpoint::Loaded>(checkpoint::load_latest(root / "a"));
    ASSERT_EQ(saved->step, 6u);
    const checkpoint::LoadedTensors t(*saved);
    EXPECT_FALSE(t.names_under("feedback.sums.").empty());
    EXPECT_FALSE(t.names_under("feedback.2.").empty());
    train::TrainConfig again = c;
    again.resume = saved;
    EXPECT_EQ(test_support::run_ranks(3, d, again).param_hash, straight);
    checkpoint::Loaded bare = *saved;
    for (const std::string& name : t.names())
      if (name.rfind("feedback.", 0) != 0) bare.wholes[name] = {*t.shape(name), t.whole(name)};
    bare.files = nullptr;
    again.resume = std::make_shared<const checkpoint::Loaded>(bare);
    EXPECT_NE(test_support::run_ranks(3, d, again).param_hash, straight);
  }
  fs::remove_all(root);
}

TEST(OneBit, WhatCannotRunIsRefusedInOneLine) {
  const data::Split d = data::make_synthetic_classification(20, 5, 64, 16, 3);
  auto refusal = [&](train::TrainConfig c) -> std::string {
    try {
      test_support::run_ranks(2, d, c);
    } catch (const InvalidInput& e) {
      return e.what();
    }
    return "accepted";
  };
  train::TrainConfig c = config("zero3", GradCompression::onebit, 2);
  EXPECT_EQ(refusal(c),
            "--grad-compression onebit runs with ddp, zero1 and zero2: each rank advances the whole first moment "
            "with its own gradient, which needs the parameters whole (strategy zero3 shards them)");
  for (const char* rule : {"lamb", "sgd"}) {
    c = config("zero1", GradCompression::onebit, 2);
    c.optimizer = {rule, {}};
    EXPECT_EQ(refusal(c), std::string("--grad-compression onebit is 1-bit Adam: it runs with --optimizer adam or "
                                      "adamw (") +
                              rule + " has no 1-bit form; 1-bit LAMB is not built)");
  }
  c = config("ddp", GradCompression::onebit, 0);
  EXPECT_EQ(refusal(c), "--onebit-warmup must be at least 1 step: the variance is frozen after the warm-up");
  c = config("ddp", GradCompression::onebit, 2);
  c.optimizer.options["state_dtype"] = "int8";
  EXPECT_EQ(refusal(c),
            "--grad-compression onebit keeps the optimizer state in f32 (its moments are averaged compressed "
            "already): drop the quantized state dtype");
  c = config("ddp", GradCompression::onebit, 2);
  c.clip_grad_norm = 1.0;
  EXPECT_EQ(refusal(c),
            "--clip-grad-norm/--clip-grad-value with --grad-compression onebit: after its warm-up the step takes the "
            "ranks' averaged moment, not a gradient that could be clipped");
  c = config("ddp", GradCompression::onebit, 2);
  c.loss_scale = GradScalerOptions{};
  EXPECT_EQ(refusal(c),
            "--loss-scale with --grad-compression onebit: its error feedback is kept in the gradient's units, which "
            "a loss scale changes; compressed gradients are f32 and need no loss scale");
  c = config("sgp", GradCompression::onebit, 2);
  EXPECT_EQ(refusal(c),
            "--grad-compression onebit: strategy sgp sends no gradients (compression is for ddp and zero1-3; diloco "
            "has --outer-dtype)");
  EXPECT_EQ(parallel::parse_grad_compression("onebit"), GradCompression::onebit);
}

}  // namespace
}  // namespace distopt
