// Gradient compression (StrategyOptions::grad_compression; docs/sharding.md,
// "Gradient compression"): the gradients of ddp, zero1, zero2 and zero3 go
// on the wire as bf16 or fp16, so the strategies still give each other's
// bits (not uncompressed ddp's), or as int8 packets with error feedback
// (zero1-3 alike, ddp its own); the reduction's bytes shrink as the theory
// says, and what cannot be compressed is refused in one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "../src/parallel/int8_wire.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/models/model.hpp"
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

// int8 packets (src/parallel/int8_wire.hpp): what arrives and what stays
// behind add up to g + e bit for bit, every block's scale is its max |v| /
// 127, codes stay in [-127, 127], a non-finite value arrives as NaN and
// leaves no residual while the rest of its block arrives as it would have,
// and an all-zero block sends zeros.
TEST(Compression, Int8PacketsKeepWhatTheyLoseExactly) {
  using parallel::detail::int8_pack;
  using parallel::detail::int8_packet_bytes;
  using parallel::detail::int8_unpack;
  using parallel::detail::kInt8Block;
  EXPECT_EQ(int8_packet_bytes(0), 0u);
  EXPECT_EQ(int8_packet_bytes(1), 4u + 4u);
  EXPECT_EQ(int8_packet_bytes(256), 4u + 256u);
  EXPECT_EQ(int8_packet_bytes(257), 8u + 260u);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, kInt8Block, std::size_t{1000}, std::size_t{4099}}) {
    std::vector<float> g(n), e(n);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = normal(gen) * std::exp2(static_cast<float>(i % 40) - 20.0f);  // blocks spanning 2^40
      e[i] = normal(gen) * 1e-3f;
    }
    if (n > kInt8Block) std::fill_n(g.begin(), kInt8Block, 0.0f), std::fill_n(e.begin(), kInt8Block, 0.0f);
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = g[i] + e[i];
    std::vector<char> packet(int8_packet_bytes(n) + 1, '\x5a');
    int8_pack(g.data(), e.data(), n, packet.data());
    EXPECT_EQ(packet.back(), '\x5a') << "wrote past the packet, n " << n;
    std::vector<float> got(n, 0.0f);
    int8_unpack(packet.data(), n, got.data(), false);
    for (std::size_t b = 0; b * kInt8Block < n; ++b) {
      float amax = 0.0f, scale;
      for (std::size_t i = b * kInt8Block; i < std::min(n, (b + 1) * kInt8Block); ++i)
        amax = std::max(amax, std::fabs(v[i]));
      std::memcpy(&scale, packet.data() + b * sizeof(float), sizeof scale);
      EXPECT_EQ(scale, amax / 127.0f) << "n " << n << " block " << b;
    }
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(static_cast<double>(got[i]) + static_cast<double>(e[i]), static_cast<double>(v[i]))
          << "n " << n << " element " << i;
      const auto code = static_cast<std::int8_t>(packet[(n + kInt8Block - 1) / kInt8Block * 4 + i]);
      ASSERT_GE(code, -127);
      if (n > kInt8Block && i < kInt8Block) {
        ASSERT_EQ(got[i], 0.0f);
      }
    }
    // Adding: a second packet on top of the first's values.
    std::vector<float> twice = got;
    int8_unpack(packet.data(), n, twice.data(), true);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(twice[i], got[i] + got[i]);
  }
  // Non-finite values arrive as NaN and keep no residual; their blocks'
  // other values (the scale is the finite ones') arrive as without them,
  // and an all-non-finite block sends NaN alone.
  std::vector<float> g(3 * kInt8Block, 1.0f), e(3 * kInt8Block, 0.5f);
  g[3] = std::numeric_limits<float>::infinity();
  g[kInt8Block + 9] = std::numeric_limits<float>::quiet_NaN();
  g[kInt8Block + 10] = -std::numeric_limits<float>::infinity();
  std::fill(g.begin() + 2 * kInt8Block, g.end(), std::numeric_limits<float>::quiet_NaN());
  std::vector<char> packet(int8_packet_bytes(g.size()));
  int8_pack(g.data(), e.data(), g.size(), packet.data());
  std::vector<float> got(g.size(), 7.0f);
  int8_unpack(packet.data(), g.size(), got.data(), false);
  for (std::size_t i = 0; i < g.size(); ++i) {
    const bool bad = !std::isfinite(g[i]);
    EXPECT_EQ(std::isnan(got[i]), bad) << i;
    EXPECT_EQ(e[i], 0.0f) << i;  // 1.5 sent exactly (127 * (1.5 / 127)), or dropped
    if (!bad) {
      EXPECT_EQ(got[i], 1.5f) << i;
    }
  }
  std::vector<float> sum(g.size(), 1.0f);  // added: NaN where one was sent, the sum elsewhere
  int8_unpack(packet.data(), g.size(), sum.data(), true);
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (std::isfinite(g[i])) {
      EXPECT_EQ(sum[i], 2.5f) << i;
    } else {
      EXPECT_TRUE(std::isnan(sum[i])) << i;
    }
  }
  // Without feedback nothing is written back.
  std::vector<float> h(10, 0.25f);
  int8_pack(h.data(), nullptr, h.size(), packet.data());
  int8_unpack(packet.data(), h.size(), got.data(), false);
  EXPECT_EQ(got[0], 0.25f);
}

// The packer, vectorized, gives bit for bit the packets and residuals of
// the format written out the plain way (docs/sharding.md): a scale of max
// |v| / 127 over the finite values, std::nearbyint's codes clamped to
// [-127, 127], -128 for a non-finite value, e = v - code * scale -- on
// values that probe the corners: exact halves (ties to even), ±0,
// subnormal blocks, quotients just past 127, tails of every length.
TEST(Compression, Int8PackingIsThePlainFormatBitForBit) {
  using parallel::detail::int8_pack;
  using parallel::detail::int8_packet_bytes;
  using parallel::detail::kInt8Block;
  auto plain = [](const std::vector<float>& g, std::vector<float>& e, std::vector<char>& out) {
    const std::size_t n = g.size(), blocks = (n + kInt8Block - 1) / kInt8Block;
    out.assign(int8_packet_bytes(n), 0);
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::size_t at = b * kInt8Block, m = std::min(kInt8Block, n - at);
      std::vector<float> v(m);
      float amax = 0.0f;
      for (std::size_t i = 0; i < m; ++i) {
        v[i] = g[at + i] + e[at + i];
        if (std::isfinite(v[i])) amax = std::max(amax, std::fabs(v[i]));
      }
      const float scale = amax / 127.0f;
      std::memcpy(out.data() + b * 4, &scale, 4);
      for (std::size_t i = 0; i < m; ++i) {
        auto& code = reinterpret_cast<std::int8_t&>(out[blocks * 4 + at + i]);
        if (!std::isfinite(v[i])) {
          code = -128;
          e[at + i] = 0.0f;
        } else if (scale > 0.0f) {
          const float q = std::clamp(std::nearbyint(v[i] / scale), -127.0f, 127.0f);
          code = static_cast<std::int8_t>(q);
          e[at + i] = v[i] - q * scale;
        } else {
          code = 0;
          e[at + i] = v[i];
        }
      }
    }
  };
  std::mt19937 gen(9);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> kind(0, 9);
  for (int round = 0; round < 40; ++round) {
    const std::size_t n = 1 + static_cast<std::size_t>(gen() % 1100);
    std::vector<float> g(n), e(n);
    const float unit = round % 5 == 0 ? 1e-41f : std::exp2(static_cast<float>(round % 30) - 15.0f);
    for (std::size_t i = 0; i < n; ++i) {
      switch (kind(gen)) {
        case 0:
          g[i] = 0.0f, e[i] = 0.0f;
          break;
        case 1:
          g[i] = -0.0f, e[i] = -0.0f;
          break;
        case 2:
          g[i] = unit * (static_cast<float>(gen() % 255) - 127.0f) / 2.0f, e[i] = 0.0f;
          break;  // halves
        case 3:
          g[i] = unit * 127.0f * (gen() % 2 ? 1.0f : -1.0f), e[i] = 0.0f;
          break;  // the block's max
        case 4:
          g[i] = std::nextafter(unit * 127.0f, 0.0f), e[i] = 0.0f;
          break;
        default:
          g[i] = unit * normal(gen), e[i] = unit * 1e-3f * normal(gen);
      }
    }
    if (round % 7 == 3) g[n / 2] = std::numeric_limits<float>::infinity();
    std::vector<float> e_plain = e;
    std::vector<char> want, got(int8_packet_bytes(n));
    plain(g, e_plain, want);
    int8_pack(g.data(), e.data(), n, got.data());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0) << "round " << round << ", n " << n;
    ASSERT_EQ(std::memcmp(e.data(), e_plain.data(), n * sizeof(float)), 0) << "round " << round << ", n " << n;
  }
}

// int8: zero1, zero2 and zero3 send the same packets and sum them in the
// same order, so they give each other's bits at every world size; ddp
// packs its sums once more, so it differs from them beyond world 1 (at
// world 1 a packet's values pack into the same packet) and from none; all
// train as well as uncompressed ddp within a percent of accuracy.
TEST(Compression, Int8GivesTheShardedStrategiesEachOthersBits) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  for (const char* optimizer : {"adamw", "sgd"})
    for (int world : {1, 2, 3, 4}) {
      const train::TrainResult none =
          test_support::run_ranks(world, d, config(optimizer, "ddp", GradCompression::none));
      const train::TrainResult ddp = test_support::run_ranks(world, d, config(optimizer, "ddp", GradCompression::int8));
      std::string zero;
      for (const char* strategy : {"zero1", "zero2", "zero3"}) {
        const train::TrainResult r =
            test_support::run_ranks(world, d, config(optimizer, strategy, GradCompression::int8));
        if (zero.empty()) zero = r.param_hash;
        EXPECT_EQ(r.param_hash, zero) << optimizer << " " << strategy << " world " << world;
        EXPECT_NEAR(r.test_accuracy, none.test_accuracy, 0.01) << optimizer << " " << strategy << " world " << world;
      }
      EXPECT_NE(ddp.param_hash, none.param_hash) << optimizer << " world " << world;
      // At world 1 packing a sum again gives the same packet (its values are codes times the scale).
      if (world > 1) {
        EXPECT_NE(ddp.param_hash, zero) << optimizer << " world " << world;
      }
      EXPECT_NEAR(ddp.test_accuracy, none.test_accuracy, 0.01) << optimizer << " world " << world;
    }
}

// The reduction's bytes by the ZeRO model (StrategyInfo::volume_psi): per
// step a rank sends (n - 1) / n of the padded gradient in a reduce-scatter,
// and ddp as much again in its all-gather. Compressed, the gradients' share
// takes 2 bytes an element instead of 4; everything else a run sends (the
// parameters' all-gathers of zero1-3, setup, evaluation) is unchanged, so
// the difference is the theory's saving, within 5%.
// int8 sends a byte an element and an fp32 scale per 256 (its two phases
// under ddp, the all-to-all alone under zero1-3), 4 - (1 + 4/256) bytes an
// element less.
TEST(Compression, TheReductionsBytesShrinkAsTheTheorySays) {
  const data::Split d = data::make_synthetic_classification(20, 5, 400, 40, 3);
  for (const char* strategy : kStrategies)
    for (int world : {2, 4}) {
      train::TrainConfig c = config("adamw", strategy, GradCompression::none);
      c.hidden = {256, 64};
      c.epochs = 1;
      c.parallel.bucket_elements = 1 << 20;
      const train::TrainResult plain = test_support::run_ranks(world, d, c);
      // The padded gradient: what ddp's gradient buffer holds (zero2/3 hold a shard).
      c.strategy = "ddp";
      const double padded = static_cast<double>(test_support::run_ranks(world, d, c).memory.grads) / 4;
      c.strategy = strategy;
      const double reductions = std::string(strategy) == "ddp" ? 2 : 1;
      for (auto [compression, bytes] :
           {std::pair{GradCompression::bf16, 2.0}, {GradCompression::int8, 1 + 4.0 / 256}}) {
        c.parallel.grad_compression = compression;
        const train::TrainResult less = test_support::run_ranks(world, d, c);
        const double saving =
            static_cast<double>(plain.steps) * reductions * (world - 1) / world * padded * (4 - bytes);
        const double measured = static_cast<double>(plain.bytes_sent) - static_cast<double>(less.bytes_sent);
        EXPECT_NEAR(measured / saving, 1.0, 0.05)
            << strategy << " " << parallel::name_of(compression) << " world " << world << ": " << plain.bytes_sent
            << " bytes against " << less.bytes_sent;
        EXPECT_EQ(plain.steps, less.steps);
      }
    }
}

// What every rank's int8 feedback owes in total, element by element:
// the ranks' residuals and ddp's residual of its sums (whole tensors).
std::map<std::string, std::vector<double>> owed(const checkpoint::TensorSource& t) {
  std::map<std::string, std::vector<double>> out;
  for (const std::string& name : t.names_under("feedback.")) {
    if (name.rfind("feedback.q.", 0) == 0) continue;  // PowerSGD's factors owe nothing
    const std::string param = name.substr(name.find('.', 9) + 1);
    const std::vector<float> v = t.whole(name);
    auto& sum = out[param];
    sum.resize(v.size(), 0.0);
    for (std::size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  return out;
}

// int8's and PowerSGD's error feedback is part of a checkpoint (PowerSGD's
// warm-start factors too): saved after 6 steps and resumed, a run ends with
// the uninterrupted run's bits (ddp, with int8's sums' feedback; zero2), and
// not without the feedback; resumed at another world and strategy, what the
// ranks owe in total is kept.
TEST(Compression, Int8AndPowerSgdResumeWithTheirErrorFeedback) {
  namespace fs = std::filesystem;
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  const fs::path root = fs::temp_directory_path() / ("distopt-compression-" + std::to_string(::getpid()));
  for (const GradCompression compression : {GradCompression::int8, GradCompression::powersgd})
    for (const char* strategy : {"ddp", "zero2"}) {
      SCOPED_TRACE(std::string(strategy) + " " + std::string(parallel::name_of(compression)));
      fs::remove_all(root);
      train::TrainConfig c = config("adamw", strategy, compression);
      c.parallel.powersgd_rank = 2;
      c.parallel.powersgd_warmup = 2;  // compressed from step 3 on, warm-started from step 4
      const std::string straight = test_support::run_ranks(3, d, c).param_hash;
      train::TrainConfig first = c;
      first.max_steps = 6;
      first.checkpoint_dir = (root / "a").string();
      (void)test_support::run_ranks(3, d, first);
      auto saved = std::make_shared<const checkpoint::Loaded>(checkpoint::load_latest(root / "a"));
      ASSERT_EQ(saved->step, 6u);
      const checkpoint::LoadedTensors tensors(*saved);
      const auto total = owed(tensors);
      ASSERT_FALSE(total.empty());
      train::TrainConfig again = c;
      again.resume = saved;
      EXPECT_EQ(test_support::run_ranks(3, d, again).param_hash, straight);
      // Without the feedback (the checkpoint's other tensors in memory): other bits.
      checkpoint::Loaded bare = *saved;
      const checkpoint::LoadedTensors t(*saved);
      for (const std::string& name : t.names())
        if (name.rfind("feedback.", 0) != 0) bare.wholes[name] = {*t.shape(name), t.whole(name)};
      bare.files = nullptr;
      again.resume = std::make_shared<const checkpoint::Loaded>(bare);
      EXPECT_NE(test_support::run_ranks(3, d, again).param_hash, straight);
      // One rank's feedback missing, before the last rank's: refused, not dropped.
      checkpoint::Loaded holed = *saved;
      for (const std::string& name : t.names())
        if (name.rfind("feedback.1.", 0) != 0) holed.wholes[name] = {*t.shape(name), t.whole(name)};
      holed.files = nullptr;
      again.resume = std::make_shared<const checkpoint::Loaded>(holed);
      try {
        (void)test_support::run_ranks(3, d, again);
        ADD_FAILURE() << "a checkpoint without rank 1's error feedback was resumed";
      } catch (const InvalidInput& e) {
        EXPECT_STREQ(e.what(), "the checkpoint has error feedback for rank 2 but none for rank 1");
      }
      // Loaded at 2 ranks under the other strategy and saved again at once: the same total.
      std::vector<checkpoint::Piece> pieces;
      std::mutex m;
      spawn(2, [&](Communicator& comm) {
        train::TrainConfig other = config("adamw", std::string(strategy) == "ddp" ? "zero1" : "ddp", compression);
        other.parallel.powersgd_rank = 2;
        auto model = models::make_model("mlp", d.train.features, d.train.classes, other.hidden);
        const parallel::FlatLayout flat = parallel::flat_layout(*model);
        auto s = parallel::make_strategy(other.strategy, comm, flat, checkpoint::initial_params(flat, tensors),
                                         other.optimizer, other.parallel);
        EXPECT_EQ(checkpoint::load_feedback(*s, tensors, comm.rank(), comm.size()), "");
        std::vector<checkpoint::Piece> mine = checkpoint::feedback_pieces(*s, comm.rank()).copies();
        std::lock_guard lock(m);
        pieces.insert(pieces.end(), mine.begin(), mine.end());
      });
      const auto wholes = checkpoint::assemble(pieces);
      const auto kept = owed(checkpoint::WholeTensors(wholes));
      ASSERT_EQ(kept.size(), total.size());
      for (const auto& [param, sum] : total)
        for (std::size_t i = 0; i < sum.size(); ++i)
          ASSERT_NEAR(kept.at(param)[i], sum[i], 1e-6 * (1 + std::abs(sum[i]))) << param << " element " << i;
    }
  fs::remove_all(root);
}

// zero3's int8 parameter gathers (ZeRO++'s qwZ): every unit's gather
// before forward and before backward (the last unit's once) moves 1 +
// 4/256 bytes an element instead of 4, the model trains on the unpacked
// values about as well, and the result is not uncompressed zero3's.
TEST(Compression, Int8GathersSendAQuarterOfZero3sParameterBytes) {
  const data::Split d = data::make_synthetic_classification(20, 5, 400, 40, 3);
  for (int world : {2, 4}) {
    train::TrainConfig c = config("adamw", "zero3", GradCompression::none);
    c.hidden = {256, 64};
    c.epochs = 2;
    c.parallel.bucket_elements = 1 << 20;
    const train::TrainResult plain = test_support::run_ranks(world, d, c);
    c.parallel.int8_gather = true;
    const train::TrainResult packed = test_support::run_ranks(world, d, c);
    c.strategy = "ddp";
    c.parallel.int8_gather = false;
    const double padded = static_cast<double>(test_support::run_ranks(world, d, c).memory.grads) / 4;
    const double last = 64 * 5 + 5;  // the last unit, fc3: gathered once a step (its padding neglected)
    // Each step's gathers, and unit 0's prefetch after the last step.
    const double gathered = double(plain.steps) * (2 * padded - last) + (20 * 256 + 256);
    const double saving = gathered * (world - 1) / world * (4 - (1 + 4.0 / 256));
    const double measured = static_cast<double>(plain.bytes_sent) - static_cast<double>(packed.bytes_sent);
    EXPECT_NEAR(measured / saving, 1.0, 0.05)
        << "world " << world << ": " << plain.bytes_sent << " against " << packed.bytes_sent;
    EXPECT_NE(packed.param_hash, plain.param_hash) << "world " << world;
    EXPECT_NEAR(packed.test_accuracy, plain.test_accuracy, 0.02) << "world " << world;
  }
}

// A non-finite gradient (a step that cannot be taken) stays in its step:
// with int8 and PowerSGD, under ddp, zero1 and zero2, the steps after it
// reduce finite gradients again -- no NaN stays in the padding that
// backward never writes, in a residual or in PowerSGD's warm start. The
// NaN sits at the end of a unit, in the block that holds its padding.
TEST(Compression, ANonFiniteGradientStaysInItsStep) {
  auto model = models::make_model("mlp", 20, 5, {24, 40, 8});
  const parallel::FlatLayout flat = parallel::flat_layout(*model);
  const std::vector<float> initial(flat.elements, 0.25f);
  for (const GradCompression c : {GradCompression::int8, GradCompression::powersgd})
    for (const char* strategy : {"ddp", "zero1", "zero2"}) {
      SCOPED_TRACE(testing::Message() << strategy << " " << parallel::name_of(c));
      parallel::StrategyOptions o;
      o.bucket_elements = 300;
      o.grad_compression = c;
      o.powersgd_warmup = 0;
      std::vector<int> bad_steps[2], bad_feedback[2];  // per rank: the steps with a non-finite gradient, feedback
      spawn(2, [&](Communicator& comm) {
        auto s = parallel::make_strategy(strategy, comm, flat, initial, {"sgd", {{"lr", 0.01}}}, o);
        const auto& layout = s->layout();
        std::mt19937 gen(static_cast<unsigned>(comm.rank()));
        std::normal_distribution<float> normal;
        for (int step = 0; step < 4; ++step) {
          for (std::size_t u = layout.units().size(); u-- > 0;) {  // backward's order
            std::span<float> g = s->access().grads(u);
            std::fill(g.begin(), g.end(), 0.0f);
            std::size_t first = g.size(), last = 0;
            for (std::size_t p = 0; p < layout.params().size(); ++p) {
              if (layout.unit_of(p) != u) continue;
              const std::size_t at = layout.padded_offset(p) - layout.units()[u].padded_offset;
              for (std::size_t i = 0; i < layout.params()[p].numel(); ++i) g[at + i] = normal(gen);
              first = std::min(first, at);
              last = at + layout.params()[p].numel() - 1;
            }
            if (step == 1 && comm.rank() == 1)  // in a weight (PowerSGD's factors) and in a bias
              g[first] = g[last] = std::numeric_limits<float>::quiet_NaN();
            s->access().grads_done(u);
          }
          bool bad = false;
          s->step([&](Optimizer& opt, const parallel::GradShard&) {
            for (std::size_t i = 0; i < opt.num_params(); ++i) {
              const TensorView& t = opt.param(i).grad;
              for (std::int64_t k = 0; k < t.numel(); ++k) bad = bad || !std::isfinite(t.as<float>()[k]);
            }
          });
          if (bad) bad_steps[comm.rank()].push_back(step);
          const parallel::Strategy::Feedback f = s->feedback();
          auto finite = [](std::span<const float> v) {
            return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
          };
          bool fed = finite(f.residual) && finite(f.sums);
          for (const auto& q : f.factors) fed = fed && finite(q.q);
          if (!fed) bad_feedback[comm.rank()].push_back(step);
        }
      });
      // Each rank owns a NaN (the first elements are rank 0's, the last rank 1's).
      for (int r : {0, 1}) {
        EXPECT_EQ(bad_steps[r], std::vector<int>{1}) << "rank " << r;
        EXPECT_EQ(bad_feedback[r], std::vector<int>{}) << "rank " << r;
      }
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
  c = config("adamw", "zero2", GradCompression::none);
  c.parallel.int8_gather = true;
  EXPECT_EQ(refusal(c),
            "--gather-compression int8 applies to zero3, which gathers its parameters before use; strategy "
            "zero2 holds them whole");
  c.strategy = "sgp";
  EXPECT_EQ(refusal(c), "--gather-compression int8: strategy sgp gathers no parameters (it is for zero3)");
  c = config("adamw", "zero3", GradCompression::none);
  c.parallel.int8_gather = true;
  c.parallel.param_dtype = DType::bf16;
  EXPECT_EQ(refusal(c),
            "--gather-compression int8 with --param-dtype bf16: the packets are made from fp32 shards "
            "(compression is for f32 parameters)");
  c = config("adamw", "zero3", GradCompression::int8);
  c.tile_rows = 8;
  const std::string tiled = refusal(c);
  EXPECT_EQ(tiled.rfind("--grad-compression int8 with zero3's tiled unit ", 0), 0u) << tiled;
  EXPECT_NE(tiled.find(": a tiled unit's gradient is reduced a range at a time, uncompressed (drop --tile-rows or the "
                       "compression)"),
            std::string::npos)
      << tiled;
  for (const GradCompression fed : {GradCompression::int8, GradCompression::powersgd}) {
    c = config("adamw", "ddp", fed);
    c.loss_scale = GradScalerOptions{};
    EXPECT_EQ(refusal(c), std::string("--loss-scale with --grad-compression ") + parallel::name_of(fed).data() +
                              ": its error feedback is kept in the gradient's units, which a loss scale changes; "
                              "compressed gradients are f32 and need no loss scale");
  }
  EXPECT_EQ(parallel::parse_grad_compression("int2"), std::nullopt);
  EXPECT_EQ(parallel::grad_compression_names(), "none, bf16, fp16, int8, powersgd, onebit");
}

}  // namespace
}  // namespace distopt
