// Sharding: the layout's arithmetic, the equivalence of ddp, zero1, zero2
// and zero3 (bitwise, for every pointwise optimizer, with and without
// clipping and loss scaling), memory per rank, and the setup checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/rule.hpp"
#include "distopt/parallel/layout.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "train_run.hpp"

using namespace distopt;
using parallel::ShardLayout;

namespace {

// Every registered strategy whose ranks hold one model (ddp, zero1-3): a new
// one joins every equivalence test below by registering.
const std::vector<const char*> kSharded = [] {
  std::vector<const char*> out;
  for (const parallel::StrategyInfo* s : parallel::all_strategies())
    if (!s->per_rank_models) out.push_back(s->name.data());  // string literals: null-terminated
  return out;
}();

// A buffer of parameters with the given sizes, each in a 16-aligned slot,
// grouped into units of `per_unit` parameters.
struct Flat {
  std::vector<ParamSlot> params;
  std::vector<parallel::UnitRange> units;
  std::size_t elements = 0;
};
Flat make_flat(const std::vector<std::size_t>& sizes, std::size_t per_unit) {
  Flat f;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i % per_unit == 0) f.units.push_back({str("u", i / per_unit), f.elements, f.elements});
    f.params.push_back({str("p", i), f.elements, {std::int64_t(sizes[i])}});
    f.elements += (sizes[i] + 15) / 16 * 16;
    f.units.back().end = f.elements;
  }
  return f;
}

}  // namespace

TEST(Layout, ShardsPartitionEveryParameterExactlyOnce) {
  const Flat f = make_flat({1, 7, 300, 16, 0, 1025, 64, 3}, 3);
  for (int world : {1, 2, 3, 4, 5, 8, 16}) {
    const ShardLayout l(f.params, f.elements, f.units, world, 100);
    std::size_t padded = 0;
    for (const auto& u : l.units()) {
      EXPECT_EQ(u.padded % (std::size_t(world) * ShardLayout::kAlign), 0u);
      EXPECT_GE(u.padded, u.size());
      EXPECT_LT(u.padded - u.size(), std::size_t(world) * ShardLayout::kAlign + (u.size() == 0 ? 1 : 0) * 0)
          << "no more padding than one quantum";
      EXPECT_EQ(u.padded_offset, padded);
      padded += u.padded;
    }
    EXPECT_EQ(l.padded_elements(), padded);
    EXPECT_EQ(l.shard_elements() * std::size_t(world), padded);
    // Every element of every parameter is held by exactly one rank, at the
    // place its shard and padded offsets say.
    std::vector<std::vector<int>> owner(f.params.size());
    for (std::size_t p = 0; p < f.params.size(); ++p) owner[p].assign(f.params[p].numel(), -1);
    for (int r = 0; r < world; ++r) {
      const auto pieces = l.pieces(r);
      ASSERT_EQ(pieces.size(), f.params.size());
      for (const auto& pc : pieces) {
        for (std::size_t k = 0; k < pc.count; ++k) {
          ASSERT_EQ(owner[pc.param][pc.param_begin + k], -1) << "element held twice";
          owner[pc.param][pc.param_begin + k] = r;
        }
        if (pc.count == 0) continue;
        const auto& u = l.units()[l.unit_of(pc.param)];
        EXPECT_EQ(pc.padded_offset, l.padded_offset(pc.param) + pc.param_begin);
        // The padded offset lies in rank r's shard of the unit, at the same
        // place as in the rank's shard buffer.
        const std::size_t local = pc.padded_offset - u.padded_offset;
        EXPECT_EQ(local / u.shard, std::size_t(r));
        EXPECT_EQ(pc.shard_offset, u.shard_offset + local % u.shard);
      }
    }
    for (std::size_t p = 0; p < f.params.size(); ++p)
      for (int o : owner[p]) ASSERT_NE(o, -1) << "an element nobody holds, world " << world;
  }
}

TEST(Layout, BucketsHoldWholeUnitsInBackwardOrder) {
  const Flat f = make_flat({100, 100, 100, 100, 100, 100}, 1);  // six units of 112 elements
  const ShardLayout l(f.params, f.elements, f.units, 2, 200);   // padded to 128 each
  ASSERT_EQ(l.buckets().size(), 3u);
  EXPECT_EQ(l.buckets()[0].first, 4u);
  EXPECT_EQ(l.buckets()[0].last, 6u);
  EXPECT_EQ(l.buckets()[2].first, 0u);
  EXPECT_EQ(l.bucket_ending_at(4), 0);
  EXPECT_EQ(l.bucket_ending_at(5), -1);
  EXPECT_EQ(l.bucket_ending_at(0), 2);
  // A bucket size below one unit: a bucket per unit. Above the model: one.
  EXPECT_EQ(ShardLayout(f.params, f.elements, f.units, 2, 1).buckets().size(), 6u);
  EXPECT_EQ(ShardLayout(f.params, f.elements, f.units, 2, 1 << 20).buckets().size(), 1u);
  EXPECT_THROW(ShardLayout(f.params, f.elements, f.units, 2, 0), InvalidInput);
  // No units: the whole buffer is one.
  EXPECT_EQ(ShardLayout(f.params, f.elements, {}, 3, 10).units().size(), 1u);
}

namespace {

// Options that exercise a rule's statistics (defaults elsewhere).
OptionMap test_options(const std::string& optimizer) {
  if (optimizer == "lars") return {{"lr", 0.1}, {"weight_decay", 1e-3}, {"momentum", 0.9}};
  if (optimizer == "muon") return {{"lr", 0.02}};
  if (optimizer == "lamb") return {{"lr", 3e-3}, {"max_grad_norm", 0.5}};
  if (optimizer == "shampoo") return {{"lr", 0.02}, {"momentum", 0.9}, {"weight_decay", 1e-4}, {"update_freq", 3}};
  // Blocks of 32 cross every shard boundary; roots every second step.
  if (optimizer == "adagrad_full")
    return {{"lr", 0.05}, {"block_size", 32}, {"update_freq", 2}, {"initial_accumulator_value", 0.01}};
  return {};
}

train::TrainConfig tiny_config(const std::string& optimizer, const std::string& strategy) {
  train::TrainConfig c;
  c.model = "mlp";
  c.hidden = {24, 40, 8};  // units straddle shard boundaries at every world size
  c.optimizer = {optimizer, test_options(optimizer)};
  c.optimizer.fallback = std::string(find_rule(optimizer)->companion);  // muon's biases: adamw
  c.epochs = 2;
  c.batch_size = 32;
  c.seed = 11;
  c.strategy = strategy;
  c.parallel.bucket_elements = 300;  // several buckets, one of two units
  return c;
}

struct RunResult {
  std::string hash;
  parallel::MemoryUse memory;
};

RunResult run(int world, const data::Split& d, const train::TrainConfig& c) {
  const train::TrainResult r = test_support::run_ranks(world, d, c);
  return {r.param_hash, r.memory};
}

}  // namespace

// The central promise: for a pointwise optimizer the strategy never changes
// a bit of the result, at any world size, clipped, loss-scaled or not; nor
// for a tensor_stats one, whose statistics every strategy takes over the
// same pieces and sums in rank order.
class Equivalence : public ::testing::TestWithParam<std::string> {};

TEST_P(Equivalence, EveryStrategyGivesTheSameBits) {
  const std::string optimizer = GetParam();
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);  // 7 steps an epoch, the last of 8
  for (bool extras : {false, true}) {
    for (int world : {1, 2, 3, 4, 5, 8}) {
      std::string first;
      for (const char* strategy : kSharded) {
        train::TrainConfig c = tiny_config(optimizer, strategy);
        // Non-pointwise rules: 56 steps (the 50 or more).
        if (find_rule(optimizer)->locality != Locality::pointwise) c.epochs = 8;
        if (extras) {
          c.clip_grad_norm = 0.05;  // clips most steps
          c.loss_scale = GradScalerOptions{};
          c.loss_scale->init_scale = 1024;
          c.loss_scale->growth_interval = 3;
        }
        const std::string h = run(world, d, c).hash;
        if (first.empty()) first = h;
        EXPECT_EQ(h, first) << optimizer << " " << strategy << " world " << world
                            << (extras ? " with clipping and loss scaling" : "");
      }
    }
  }
}

// The rules of one locality, by name.
std::vector<std::string> rules_of(Locality locality) {
  std::vector<std::string> names;
  for (const RuleInfo* r : all_rules())
    if (r->locality == locality) names.emplace_back(r->name);
  return names;
}
std::string rule_label(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

INSTANTIATE_TEST_SUITE_P(Pointwise, Equivalence, ::testing::ValuesIn(rules_of(Locality::pointwise)), rule_label);
INSTANTIATE_TEST_SUITE_P(TensorStats, Equivalence, ::testing::ValuesIn(rules_of(Locality::tensor_stats)), rule_label);
INSTANTIATE_TEST_SUITE_P(WholeTensor, Equivalence, ::testing::ValuesIn(rules_of(Locality::whole_tensor)), rule_label);

// Quantized optimizer state (docs/optimizers.md, "Quantized state"): the
// layout cuts shards on blocks, so every strategy gives ddp's bits, and the
// quantization really happens (the result differs from fp32 state's).
TEST(Equivalence, QuantizedStateGivesTheSameBitsUnderEveryStrategy) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 5);
  for (const char* optimizer : {"adamw", "sgd", "lion"})
    for (const char* dtype : {"f32", "bf16", "int8", "int4"})  // bf16: pieces cut anywhere
      for (int world : {1, 2, 3, 4, 8}) {
        std::string first;
        for (const char* strategy : kSharded) {
          train::TrainConfig c = tiny_config(optimizer, strategy);
          c.hidden = {256, 64};  // fc1.weight (5120) and fc2.weight (16384) keep quantized state, cut mid-tensor
          c.epochs = 1;
          c.optimizer.options["state_dtype"] = dtype;
          if (std::string(optimizer) == "sgd") c.optimizer.options["momentum"] = 0.9;
          const std::string h = run(world, d, c).hash;
          if (first.empty()) first = h;
          EXPECT_EQ(h, first) << optimizer << " " << dtype << " " << strategy << " world " << world;
        }
        static std::map<std::string, std::string> f32;
        if (std::string(dtype) == "f32") f32[str(optimizer, world)] = first;
        else EXPECT_NE(first, f32[str(optimizer, world)]) << optimizer << " " << dtype << " world " << world;
      }
}

TEST(Equivalence, ClippingReallyClipsAndTheBucketSizeChangesNothing) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 4);
  train::TrainConfig c = tiny_config("adam", "zero2");
  const std::string plain = run(4, d, c).hash;
  c.parallel.bucket_elements = 1;  // a bucket per unit
  EXPECT_EQ(run(4, d, c).hash, plain);
  c.parallel.bucket_elements = 1 << 20;  // one bucket
  EXPECT_EQ(run(4, d, c).hash, plain);
  c.clip_grad_norm = 0.05;
  EXPECT_NE(run(4, d, c).hash, plain) << "the clipped run must differ, or the equivalence test proves nothing";
  c.clip_norm_type = std::numeric_limits<double>::infinity();
  const std::string inf_zero2 = run(4, d, c).hash;
  c.strategy = "ddp";
  EXPECT_EQ(run(4, d, c).hash, inf_zero2);
}

TEST(Equivalence, SwaAndEmaAverageTheSameParametersUnderEveryStrategy) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 5);
  for (bool ema : {false, true}) {
    std::string first, first_avg;
    for (const char* strategy : kSharded) {
      train::TrainConfig c = tiny_config("sgd", strategy);
      c.optimizer.options = {{"lr", 0.05}, {"momentum", 0.9}};
      if (ema) c.ema_decay = 0.9;
      else c.swa_start = 1;
      train::TrainResult r0;
      spawn(3, [&](Communicator& comm) {
        auto r = train::train(comm, d, c);
        if (comm.rank() == 0) r0 = std::move(r);
      });
      ASSERT_TRUE(r0.averaged.has_value());
      if (first.empty()) first = r0.param_hash, first_avg = r0.averaged->param_hash;
      EXPECT_EQ(r0.param_hash, first) << strategy;
      EXPECT_EQ(r0.averaged->param_hash, first_avg) << strategy << (ema ? " ema" : " swa");
      EXPECT_NE(r0.averaged->param_hash, r0.param_hash);
    }
  }
}

// bf16/f16 parameters and gradients, communicated in that dtype, with fp32
// master weights of the own shard: still the same bits under every
// strategy, and loss scaling's skip decisions agree across shards.
TEST(MixedPrecision, EveryStrategyGivesTheSameBitsAndSkipsTogether) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 6);
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int world : {2, 3, 4}) {
      for (double init_scale : {1024.0, 1073741824.0}) {  // 2^30 overflows f16 gradients: skipped steps
        std::string first;
        std::size_t first_skipped = 0;
        for (const char* strategy : kSharded) {
          train::TrainConfig c = tiny_config("adam", strategy);
          c.parallel.param_dtype = dtype;
          c.clip_grad_norm = 0.05;
          c.loss_scale = GradScalerOptions{};
          c.loss_scale->init_scale = init_scale;
          c.loss_scale->growth_interval = 2;
          train::TrainResult r0;
          std::mutex m;
          std::vector<std::size_t> skipped(world);
          spawn(world, [&](Communicator& comm) {
            auto r = train::train(comm, d, c);
            std::lock_guard lock(m);
            skipped[comm.rank()] = r.skipped_steps;
            if (comm.rank() == 0) r0 = std::move(r);
          });
          SCOPED_TRACE(str(name_of(dtype), " ", strategy, " world ", world, " init_scale ", init_scale));
          for (int r = 1; r < world; ++r) EXPECT_EQ(skipped[r], skipped[0]) << "ranks disagree on skipping";
          if (first.empty()) first = r0.param_hash, first_skipped = r0.skipped_steps;
          EXPECT_EQ(r0.param_hash, first);
          EXPECT_EQ(r0.skipped_steps, first_skipped);
          if (dtype == DType::f16 && init_scale > 1e9) {
            EXPECT_GT(r0.skipped_steps, 0u);
          }
          EXPECT_LT(r0.skipped_steps, r0.steps);
        }
      }
    }
  }
}

namespace {

// A model that needs its whole buffer at once (one unit): linear regression
// written without unit hooks, the way a user's own model might be.
class WholeLinear final : public models::Model {
 public:
  explicit WholeLinear(std::size_t features) {
    features_ = features;
    outputs_ = 1;
    params_ = {{"w", 0, {std::int64_t(features)}}, {"b", (features + 15) / 16 * 16, {1}}};
    buffer_elements_ = params_[1].offset + 16;
    units_ = {{"all", 0, buffer_elements_, {0, 1}}};
  }
  std::string_view name() const override { return "whole_linear"; }
  void init(std::span<float> buffer, std::uint64_t seed) const override {
    Rng rng(seed, 1);
    std::fill(buffer.begin(), buffer.end(), 0.0f);
    for (std::size_t i = 0; i < features_; ++i) buffer[i] = static_cast<float>(rng.uniform(-0.1, 0.1));
  }

 protected:
  models::BatchStats do_forward_backward(models::UnitAccess& access, const float* x, const float* y, std::size_t n,
                                         float scale) override {
    const auto p = access.acquire(0, models::Pass::forward);
    std::vector<float> pred(n);
    for (std::size_t i = 0; i < n; ++i) {
      float z = p[params_[1].offset];
      for (std::size_t j = 0; j < features_; ++j) z += p[j] * x[i * features_ + j];
      pred[i] = z;
    }
    access.release(0, models::Pass::forward);
    const auto g = access.grads(0);
    std::fill(g.begin(), g.end(), 0.0f);
    models::BatchStats s;
    s.count = double(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float diff = pred[i] - y[i];
      s.loss_sum += 0.5 * double(diff) * diff;
      for (std::size_t j = 0; j < features_; ++j) g[j] += diff * scale * x[i * features_ + j];
      g[params_[1].offset] += diff * scale;
    }
    access.grads_done(0);
    return s;
  }
  models::BatchStats do_evaluate(models::UnitAccess&, const float*, const float*, std::size_t) override { return {}; }
};

}  // namespace

TEST(Strategies, AModelWithoutUnitHooksRunsUnderEveryStrategy) {
  const data::Split d = data::make_synthetic_regression(37, 64, 8, 0.1, 2);
  for (int world : {1, 3, 4}) {
    std::vector<std::vector<float>> results;
    for (const char* name : kSharded) {
      std::vector<float> out;
      spawn(world, [&](Communicator& comm) {
        WholeLinear model(37);
        const parallel::FlatLayout layout = parallel::flat_layout(model);
        std::vector<float> init(layout.elements);
        model.init(init, 3);
        auto s = parallel::make_strategy(name, comm, layout, init, {"adam", {{"lr", 0.01}}});
        const Piece piece = piece_of(16, comm.size(), comm.rank());
        for (std::size_t step = 0; step < 4; ++step) {
          const std::size_t at = step * 16 + piece.offset;
          model.forward_backward(s->access(), d.train.sample(at), d.train.y.data() + at, piece.count, 1.0f / 16);
          s->step();
        }
        auto p = s->gather_params();
        if (comm.rank() == 0) out = std::move(p);
      });
      results.push_back(std::move(out));
    }
    ASSERT_EQ(results[0].size(), 38u);
    for (std::size_t k = 1; k < results.size(); ++k)
      EXPECT_EQ(std::memcmp(results[k].data(), results[0].data(), 38 * sizeof(float)), 0)
          << kSharded[k] << " world " << world;
    // The model moved.
    WholeLinear model(37);
    std::vector<float> init(model.buffer_elements());
    model.init(init, 3);
    EXPECT_NE(results[0][0], init[0]);
  }
}

// Memory per rank, from the buffers each strategy allocates, against the
// unsharded amounts (ZeRO paper, Fig. 1): Adam keeps 8 bytes of state per
// parameter; zero1-3 keep 1/world of it, zero2-3 also 1/world of the
// gradient plus the buckets in flight, zero3 1/world of the parameters plus
// the units in flight.
TEST(Memory, ShardedStrategiesHoldTheirShareOfEachBuffer) {
  const data::Split d = data::make_synthetic_classification(64, 4, 128, 16, 1);
  train::TrainConfig base = tiny_config("adam", "ddp");
  base.hidden = {96, 96, 96, 96, 96, 96};  // seven units of similar size
  base.epochs = 1;
  base.parallel.bucket_elements = 1;  // a bucket per unit
  const std::size_t world = 4;
  // Unsharded amounts, counted from the model's shapes.
  std::size_t psi = 0, max_unit = 0;
  {
    std::vector<std::size_t> widths{64, 96, 96, 96, 96, 96, 96, 4};
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      const std::size_t unit = widths[l] * widths[l + 1] + widths[l + 1];
      psi += unit;
      max_unit = std::max(max_unit, unit);
    }
  }
  const std::size_t units = 7;
  // Padding: each parameter slot rounds up to 16 elements, each unit to a
  // multiple of world * 16.
  const std::size_t pad = units * (2 * 16 + world * 16);
  auto near = [&](std::size_t bytes, std::size_t want, std::size_t slack) {
    return bytes + slack >= want && bytes <= want + slack;
  };
  const RunResult ddp = run(int(world), d, base);
  EXPECT_TRUE(near(ddp.memory.optimizer_state, 8 * psi, 0)) << ddp.memory.optimizer_state << " vs " << 8 * psi;
  EXPECT_TRUE(near(ddp.memory.params, 4 * psi, 4 * pad));
  EXPECT_TRUE(near(ddp.memory.grads, 4 * psi, 4 * pad));
  EXPECT_EQ(ddp.memory.master_params, 0u);
  for (const char* name : {"zero1", "zero2", "zero3"}) {
    train::TrainConfig c = base;
    c.strategy = name;
    const RunResult r = run(int(world), d, c);
    SCOPED_TRACE(name);
    EXPECT_EQ(r.hash, ddp.hash);
    EXPECT_TRUE(near(r.memory.optimizer_state, 8 * psi / world, 8 * pad / world))
        << r.memory.optimizer_state << " vs " << 8 * psi / world;
    EXPECT_EQ(r.memory.master_params, 0u) << "fp32 parameters need no master copy";
    const std::size_t in_flight_grads = 2 * 4 * (max_unit + pad / units);  // two buckets of one unit
    const std::size_t in_flight_params = 2 * 4 * (max_unit + pad / units);  // the unit in use and the next
    if (std::string(name) == "zero1") {
      EXPECT_EQ(r.memory.grads, ddp.memory.grads);
      EXPECT_EQ(r.memory.params, ddp.memory.params);
    } else {
      EXPECT_GE(r.memory.grads, 4 * psi / world);
      EXPECT_LE(r.memory.grads, 4 * (psi + pad) / world + in_flight_grads);
      EXPECT_LT(r.memory.grads, ddp.memory.grads * 3 / 5);
    }
    if (std::string(name) == "zero3") {
      EXPECT_GE(r.memory.params, 4 * psi / world);
      EXPECT_LE(r.memory.params, 4 * (psi + pad) / world + in_flight_params);
      EXPECT_LT(r.memory.params, ddp.memory.params * 3 / 5);
    } else {
      EXPECT_EQ(r.memory.params, ddp.memory.params);
    }
  }
}

// The live limits (StrategyOptions::prefetch_units, max_live_params,
// max_buckets_in_flight) bound what zero2/zero3 hold in flight and change
// no bit. A model whose first unit is four times the others shows the
// difference: with the next unit prefetched, the first and second are live
// at once; with no prefetch one unit is.
TEST(Memory, LiveLimitsBoundWhatIsInFlightAndKeepTheBits) {
  const data::Split d = data::make_synthetic_classification(64, 4, 128, 16, 1);
  train::TrainConfig base = tiny_config("adam", "ddp");
  base.hidden = {512, 16, 512, 16};
  base.epochs = 1;
  const int world = 4;
  // The padded units and buckets the strategies lay out.
  const auto model = models::make_model("mlp", 64, 4, base.hidden);
  const parallel::FlatLayout flat = parallel::flat_layout(*model);
  const parallel::ShardLayout layout(flat.params, flat.elements, flat.units, world, base.parallel.bucket_elements);
  std::vector<std::size_t> units;
  for (const auto& u : layout.units()) units.push_back(u.padded);
  std::size_t largest_bucket = 0;
  for (const auto& b : layout.buckets()) largest_bucket = std::max(largest_bucket, b.padded);
  const std::size_t largest = *std::max_element(units.begin(), units.end());
  const std::size_t shard = layout.shard_elements();
  ASSERT_EQ(largest, units[0]);
  ASSERT_GT(units[0], 3 * units[1]);

  const RunResult ddp = run(world, d, base);
  auto run_with = [&](const char* strategy, int prefetch, std::size_t max_live, int buckets) {
    train::TrainConfig c = base;
    c.strategy = strategy;
    c.parallel.prefetch_units = prefetch;
    c.parallel.max_live_params = max_live;
    c.parallel.max_buckets_in_flight = buckets;
    const RunResult r = run(world, d, c);
    EXPECT_EQ(r.hash, ddp.hash) << strategy << " prefetch " << prefetch << " max_live " << max_live << " buckets "
                                << buckets;
    return r.memory;
  };
  const parallel::MemoryUse prefetched = run_with("zero3", 1, 0, 2);
  EXPECT_GE(prefetched.params, 4 * (shard + units[0] + units[1])) << "the first unit and the prefetched second";
  // No prefetch: one unit and the shard.
  const parallel::MemoryUse one = run_with("zero3", 0, 0, 2);
  EXPECT_EQ(one.params, 4 * (shard + largest));
  // A limit of one unit: the same, whatever the prefetch depth asks for.
  EXPECT_EQ(run_with("zero3", 3, largest, 2).params, 4 * (shard + largest));
  // A limit of the two largest units with three units prefetched: never
  // more than the limit.
  const std::size_t two = units[0] + units[1];
  const parallel::MemoryUse deep = run_with("zero3", 3, two, 2);
  EXPECT_LE(deep.params, 4 * (shard + two));
  EXPECT_GT(deep.params, 4 * (shard + largest)) << "the limit leaves room to prefetch the smaller units";
  // One gradient bucket in flight: the shard and the largest bucket.
  for (const char* s : {"zero2", "zero3"}) {
    const parallel::MemoryUse b1 = run_with(s, 1, 0, 1), b2 = run_with(s, 1, 0, 2);
    EXPECT_LE(b1.grads, 4 * (shard + largest_bucket)) << s;
    EXPECT_LT(b1.grads, b2.grads) << s;
  }
  // Bad limits: one line each, saying what would fit.
  auto expect_error = [&](auto change, const std::string& what) {
    train::TrainConfig c = base;
    c.strategy = "zero3";
    change(c);
    try {
      run(world, d, c);
      ADD_FAILURE() << "no error for " << what;
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error([&](train::TrainConfig& c) { c.parallel.max_live_params = largest - 1; },
               "max live parameters " + std::to_string(largest - 1) + " is below the largest unit, " +
                   layout.units()[0].name + " (" + std::to_string(largest) + " elements gathered at once at world 4): at least " +
                   std::to_string(largest) + " would fit");
  expect_error([](train::TrainConfig& c) { c.parallel.prefetch_units = -1; }, "prefetch units must be at least 0 (got -1)");
  expect_error([](train::TrainConfig& c) { c.parallel.max_buckets_in_flight = 0; },
               "buckets in flight must be at least 1 (got 0)");
}

// Tiles (models::Unit::tile): layers of more outputs than tile_rows are
// computed in row blocks and used a block at a time. Every strategy gives
// the same bits at the same tile size (the layout, and so each rank's
// pieces, do not change); zero3 with no prefetch holds its shard and one
// tile, never a whole tiled layer; a limit below one tile is one line.
TEST(Memory, TilesKeepTheBitsAndZero3HoldsOneTilePlusItsShard) {
  const data::Split d = data::make_synthetic_classification(64, 4, 128, 16, 1);
  const int world = 4;
  for (const char* rule : {"adam", "lamb"}) {
    SCOPED_TRACE(rule);
    train::TrainConfig base = tiny_config(rule, "ddp");
    base.hidden = {256, 256};
    base.tile_rows = 64;
    base.epochs = 1;
    models::ModelOptions mo;
    mo.hidden = base.hidden;
    mo.tile_rows = base.tile_rows;
    const auto model = models::make_model("mlp", 64, 4, mo);
    ASSERT_EQ(model->units().size(), 3u);
    EXPECT_EQ(model->units()[0].tile, 64u * 64);  // 64 rows of 64 inputs
    EXPECT_EQ(model->units()[1].tile, 64u * 256);
    EXPECT_EQ(model->units()[2].tile, 0u);  // 4 outputs: whole
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    const parallel::ShardLayout layout(flat.params, flat.elements, flat.units, world, base.parallel.bucket_elements);
    const std::size_t tile = 64 * 256, shard = layout.shard_elements();
    ASSERT_LT(layout.units()[2].padded, tile);
    ASSERT_GT(layout.units()[1].padded, 3 * tile) << "a tiled layer is several tiles";

    const RunResult ddp = run(world, d, base);
    train::TrainConfig whole = base;
    whole.tile_rows = 0;
    EXPECT_NE(run(world, d, whole).hash, ddp.hash) << "the tile is part of the arithmetic";
    for (const char* name : {"zero1", "zero2", "zero3"}) {
      train::TrainConfig c = base;
      c.strategy = name;
      EXPECT_EQ(run(world, d, c).hash, ddp.hash) << name;
    }
    train::TrainConfig lean = base;
    lean.strategy = "zero3";
    lean.parallel.prefetch_units = 0;
    lean.parallel.max_buckets_in_flight = 1;
    const RunResult z3 = run(world, d, lean);
    EXPECT_EQ(z3.hash, ddp.hash);
    EXPECT_EQ(z3.memory.params, 4 * (shard + tile)) << "the shard and one tile";
    EXPECT_LE(z3.memory.grads, 4 * (shard + tile));
    lean.parallel.max_live_params = tile;
    lean.parallel.prefetch_units = 2;
    EXPECT_EQ(run(world, d, lean).memory.params, 4 * (shard + tile)) << "a limit of one tile";
    lean.parallel.max_live_params = tile - 1;
    try {
      run(world, d, lean);
      ADD_FAILURE() << "no error for a limit below one tile";
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find(str("max live parameters ", tile - 1, " is below one tile of fc2 (", tile,
                                               " elements gathered at once at world 4): at least ", tile,
                                               " would fit")),
                std::string::npos)
          << e.what();
    }
  }
  // bf16 parameters: each range converted alone (ddp, zero2), gathered and
  // reduced in bf16 (zero3); the same bits.
  train::TrainConfig low = tiny_config("adamw", "ddp");
  low.hidden = {256, 256};
  low.tile_rows = 64;
  low.epochs = 1;
  low.parallel.param_dtype = DType::bf16;
  const RunResult ddp = run(world, d, low);
  for (const char* name : {"zero2", "zero3"}) {
    low.strategy = name;
    EXPECT_EQ(run(world, d, low).hash, ddp.hash) << name << " bf16";
  }
}

TEST(Memory, MixedPrecisionKeepsMasterWeightsForTheOwnShardOnly) {
  const data::Split d = data::make_synthetic_classification(64, 4, 128, 16, 1);
  train::TrainConfig c = tiny_config("adamw", "ddp");
  c.hidden = {96, 96, 96};
  c.epochs = 1;
  c.parallel.param_dtype = DType::bf16;
  const RunResult ddp = run(4, d, c);
  c.strategy = "zero1";
  const RunResult z1 = run(4, d, c);
  std::size_t psi = 64 * 96 + 96 + 2 * (96 * 96 + 96) + 96 * 4 + 4;
  EXPECT_EQ(ddp.memory.master_params, 4 * psi);
  EXPECT_GE(z1.memory.master_params, 4 * psi / 4 - 4 * 64);
  EXPECT_LE(z1.memory.master_params, 4 * psi / 4 + 4 * 4 * 64);
  EXPECT_EQ(z1.memory.optimizer_state, 2 * z1.memory.master_params);
  EXPECT_EQ(z1.hash, ddp.hash);
}

TEST(Setup, RanksThatDisagreeAreNamedBeforeTraining) {
  const data::Split d = data::make_synthetic_classification(20, 5, 64, 8, 1);
  auto expect_named = [&](auto change, const std::string& what) {
    try {
      spawn(3, [&](Communicator& comm) {
        train::TrainConfig c = tiny_config("adam", "zero2");
        if (comm.rank() == 2) change(c);
        train::train(comm, d, c);
      });
      ADD_FAILURE() << "no error for a rank that disagrees on " << what;
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2 disagrees with rank 0 on the " + what), std::string::npos)
          << e.what();
    }
  };
  expect_named([](train::TrainConfig& c) { c.optimizer.options["lr"] = 0.5; }, "optimizer or its options");
  expect_named([](train::TrainConfig& c) { c.strategy = "zero3"; }, "strategy");
  expect_named([](train::TrainConfig& c) { c.hidden = {24, 41, 8}; }, "model shapes");
  expect_named([](train::TrainConfig& c) { c.parallel.param_dtype = DType::bf16; }, "parameter dtype (bf16 vs f32)");
  expect_named([](train::TrainConfig& c) { c.parallel.grad_compression = parallel::GradCompression::fp16; },
               "gradient compression (fp16 vs none)");
  expect_named([](train::TrainConfig& c) { c.parallel.bucket_elements = 7; }, "bucket size (7 vs 300)");
  expect_named([](train::TrainConfig& c) { c.parallel.max_buckets_in_flight = 3; }, "live limits");
}

// What each strategy declares, against what it is (strategy.hpp's list):
// the properties every caller reads instead of comparing names.
TEST(Setup, StrategiesDeclareWhatTheyAre) {
  struct Expected {
    const char* name;
    bool replicated, per_rank, gathers, gossip_flags;
    double volume;
  };
  const Expected expected[] = {
      {"ddp", true, false, false, false, 2},     {"zero1", false, false, true, false, 2},
      {"zero2", false, false, true, false, 2},   {"zero3", false, false, true, false, 3},
      {"sgp", true, true, false, true, 0},       {"osgp", true, true, false, true, 0},
      {"dpsgd", true, true, false, true, 0},     {"adpsgd", true, true, false, true, 0},
      {"slowmo", true, true, false, true, 0},    {"diloco", true, true, false, true, 0},
  };
  // The built-in ones, first; after them only what a test registers
  // (Setup.AThrowawayStrategyNeedsOnlyItsEntry's "throwaway").
  const auto all = parallel::all_strategies();
  ASSERT_EQ(std::count_if(all.begin(), all.end(), [](const auto* s) { return s->name != "throwaway"; }),
            static_cast<std::ptrdiff_t>(std::size(expected)));
  for (std::size_t k = 0; k < std::size(expected); ++k) {
    const parallel::StrategyInfo& s = *parallel::all_strategies()[k];
    const Expected& e = expected[k];
    EXPECT_EQ(s.name, e.name);
    EXPECT_EQ(&parallel::strategy_or_throw(e.name), &s);
    EXPECT_EQ(s.replicated_params, e.replicated) << e.name;
    EXPECT_EQ(s.per_rank_models, e.per_rank) << e.name;
    EXPECT_EQ(s.whole_tensor_needs_gather, e.gathers) << e.name;
    EXPECT_EQ(s.option_misfit != nullptr, e.gossip_flags) << e.name;
    EXPECT_EQ(s.volume_psi, e.volume) << e.name;
    EXPECT_EQ(s.sharded_grads, e.name == std::string("zero2") || e.name == std::string("zero3")) << e.name;
    EXPECT_EQ(s.sharded_params, e.name == std::string("zero3")) << e.name;
    EXPECT_FALSE(s.help.empty()) << e.name;
    ASSERT_NE(s.make, nullptr) << e.name;
  }
  // Which gossip flags apply where (the messages distopt train prints).
  const parallel::GossipOptions local;  // slowmo_base localsgd
  parallel::GossipOptions sgp_base;
  sgp_base.slowmo_base = "sgp";
  auto misfit = [](const char* s, const char* flag, const parallel::GossipOptions& o) {
    const parallel::StrategyInfo& info = parallel::strategy_or_throw(s);
    return info.option_misfit(info, flag, o);
  };
  EXPECT_EQ(misfit("osgp", "synch-freq", local), "");
  EXPECT_EQ(misfit("adpsgd", "synch-freq", local), "");
  EXPECT_EQ(misfit("sgp", "synch-freq", local), "--synch-freq applies to --strategy osgp and adpsgd, not sgp");
  EXPECT_EQ(misfit("dpsgd", "slowmo-lr", local), "--slowmo-lr applies to --strategy slowmo, not dpsgd");
  EXPECT_EQ(misfit("slowmo", "topology", local),
            "--topology applies to slowmo with --slowmo-base sgp (local SGD averages exactly)");
  EXPECT_EQ(misfit("slowmo", "topology", sgp_base), "");
  EXPECT_EQ(misfit("slowmo", "localsgd-frequency", sgp_base), "--localsgd-frequency applies to --slowmo-base localsgd");
  EXPECT_EQ(misfit("sgp", "topology", local), "");
  EXPECT_EQ(misfit("diloco", "sync-every", local), "");
  EXPECT_EQ(misfit("diloco", "outer-lr", local), "");
  EXPECT_EQ(misfit("slowmo", "sync-every", local), "--sync-every applies to --strategy diloco, not slowmo");
  EXPECT_EQ(misfit("sgp", "outer-optimizer", local), "--outer-optimizer applies to --strategy diloco, not sgp");
  EXPECT_EQ(misfit("diloco", "topology", local),
            "--topology applies to the strategies that gossip on a graph, not diloco (it averages exactly)");
  EXPECT_EQ(misfit("diloco", "outer-momentum", local), "");
  parallel::GossipOptions adam_outer;
  adam_outer.outer_optimizer = "adam";
  EXPECT_EQ(misfit("diloco", "outer-momentum", adam_outer),
            "--outer-momentum applies to --outer-optimizer sgd (adam keeps its own defaults)");
  EXPECT_EQ(misfit("diloco", "slowmo-lr", local), "--slowmo-lr applies to --strategy slowmo, not diloco");
}

// A new strategy is one file and one registry entry: registered here at
// run time, a throwaway (ddp's code under another name and memory model)
// is found by name, reaches the memory model the CLI's preflight and the
// Python front end read, and trains with ddp's bits. Nothing else names it.
TEST(Setup, AThrowawayStrategyNeedsOnlyItsEntry) {
  static const parallel::StrategyInfo kThrowaway = [] {
    parallel::StrategyInfo s = parallel::strategy_or_throw("ddp");
    s.name = "throwaway";
    s.help = "a test's strategy: ddp's code";
    s.memory = {.whole = 3, .divided = 2, .units_in_flight = 1};
    return s;
  }();
  if (parallel::find_strategy("throwaway") == nullptr) parallel::register_strategy(kThrowaway);
  EXPECT_EQ(&parallel::strategy_or_throw("throwaway"), &kThrowaway);
  EXPECT_EQ(parallel::all_strategies().back(), &kThrowaway);
  const parallel::MemoryPerRank m = parallel::memory_per_rank(kThrowaway, 4);
  EXPECT_EQ(m.floats_per_param, 3.5);
  EXPECT_EQ(m.largest_units, 1.0);
  EXPECT_EQ(parallel::memory_per_rank(parallel::strategy_or_throw("zero3"), 4).floats_per_param, 1.25);
  EXPECT_THROW(parallel::register_strategy(kThrowaway), InvalidInput);  // one entry per name

  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 7);
  train::TrainConfig c = tiny_config("adamw", "ddp");
  c.max_steps = 4;
  const std::string want = test_support::run_ranks(2, d, c).param_hash;
  c.strategy = "throwaway";
  EXPECT_EQ(test_support::run_ranks(2, d, c).param_hash, want);
}

TEST(Setup, UnknownOrInexactStrategiesAreRefused) {
  EXPECT_THROW(parallel::require_strategy("zero4"), InvalidInput);
  for (const char* s : {"sgp", "osgp", "dpsgd", "adpsgd", "slowmo", "diloco"})
    EXPECT_NO_THROW(parallel::require_strategy(s));
  for (const char* s : kSharded) EXPECT_NO_THROW(parallel::require_strategy(s));
  // tensor_stats rules run under every strategy; whole_tensor ones (not
  // built yet) only where each rank has whole tensors.
  EXPECT_NO_THROW(parallel::require_exact("zero3", *find_rule("lamb")));
  EXPECT_NO_THROW(parallel::require_exact("zero2", *find_rule("muon")));  // gathers its matrices
  RuleInfo muon_like = *find_rule("adam");
  muon_like.name = "muon_like";
  muon_like.locality = Locality::whole_tensor;
  EXPECT_NO_THROW(parallel::require_exact("ddp", muon_like));
  EXPECT_NO_THROW(parallel::require_exact("sgp", muon_like));
  try {
    parallel::require_exact("zero2", muon_like);
    ADD_FAILURE() << "a whole_tensor rule under zero2 must be refused";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("needs whole tensors (whole_tensor)"), std::string::npos) << e.what();
  }
}

TEST(Setup, AFailingRankEndsEveryRankWithAnError) {
  const data::Split d = data::make_synthetic_regression(37, 64, 8, 0.1, 2);
  for (const char* strategy : kSharded) {
    const auto start = std::chrono::steady_clock::now();
    try {
      spawn(3, [&](Communicator& comm) {
        comm.set_timeout(std::chrono::seconds(30));
        WholeLinear model(37);
        const parallel::FlatLayout layout = parallel::flat_layout(model);
        std::vector<float> init(layout.elements);
        auto s = parallel::make_strategy(strategy, comm, layout, init, {"adam", {}});
        for (int step = 0; step < 3; ++step) {
          model.forward_backward(s->access(), d.train.sample(0), d.train.y.data(), 4, 0.1f);
          // Rank 1 fails in the middle of the second step, after backward has
          // started the gradient reductions on the other ranks.
          if (step == 1 && comm.rank() == 1) throw IoError("rank 1 lost its disk");
          s->step();
        }
      });
      ADD_FAILURE() << "no error under " << strategy;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 lost its disk"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << strategy << ": no hang";
  }
}
