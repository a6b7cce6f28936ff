// Checkpoint content across strategies and world sizes
// (checkpoint/state.hpp): a run saved and resumed at the same world size
// ends with the uninterrupted run's bits under every strategy; one
// checkpoint resumed at another world size under different strategies ends
// with the same bits under each; and saving right after a load gives back
// every tensor bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"

using namespace distopt;
using namespace distopt::checkpoint;

namespace {

const data::Split& data_set() {
  static const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  return d;
}

struct RunResult {
  std::vector<float> params;  // gathered, slot order
  std::vector<checkpoint::Piece> pieces;  // every rank's, at the end
};

// `steps` steps from global step `from` at `world` ranks, from a
// checkpoint's whole tensors or from the model's initialization.
RunResult run(int world, const std::string& strategy, const parallel::OptimizerSpec& spec, std::size_t from,
        std::size_t steps, const std::map<std::string, Whole>* resume, DType dtype = DType::f32) {
  const data::Split& d = data_set();
  RunResult out;
  std::mutex m;
  spawn(world, [&](Communicator& comm) {
    auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 40, 8});
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    std::vector<float> initial(flat.elements);
    if (resume != nullptr) initial = initial_params(flat, *resume);
    else model->init(initial, 5);
    parallel::StrategyOptions options;
    options.bucket_elements = 300;
    options.param_dtype = dtype;
    auto s = parallel::make_strategy(strategy, comm, flat, initial, spec, options);
    if (resume != nullptr) load_optimizer_state(*s, *resume);
    data::BatchSampler sampler(d.train.size(), 32, 5, false);
    const std::size_t per_epoch = sampler.batches_per_epoch();
    std::vector<float> x, y;
    for (std::size_t k = from; k < from + steps; ++k) {
      sampler.set_epoch(k / per_epoch);
      const auto global = sampler.global_batch(k % per_epoch);
      const auto local = sampler.local_batch(k % per_epoch, comm.rank(), comm.size());
      x.clear();
      y.clear();
      for (std::uint32_t i : local) {
        x.insert(x.end(), d.train.sample(i), d.train.sample(i) + d.train.features);
        y.push_back(d.train.y[i]);
      }
      model->forward_backward(s->access(), x.data(), y.data(), local.size(), 1.0f / float(global.size()));
      s->step();
    }
    std::vector<float> params = s->gather_params();
    std::vector<checkpoint::Piece> mine = strategy_pieces(*s, comm.rank());
    std::lock_guard lock(m);
    if (comm.rank() == 0) out.params = std::move(params);
    out.pieces.insert(out.pieces.end(), mine.begin(), mine.end());
  });
  return out;
}

parallel::OptimizerSpec spec_of(const std::string& rule) {
  parallel::OptimizerSpec spec{rule, {}};
  if (rule == "lamb") spec.options = {{"lr", 3e-3}};
  if (rule == "muon") spec.options = {{"lr", 0.02}};
  if (rule == "shampoo") spec.options = {{"lr", 0.02}, {"momentum", 0.9}, {"update_freq", 3}};
  if (rule == "sgd") spec.options = {{"lr", 0.05}, {"momentum", 0.9}};
  spec.fallback = std::string(find_rule(rule)->companion);
  return spec;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(Resume, SavedAndResumedAtTheSameWorldIsTheUninterruptedRun) {
  // Pointwise, tensor_stats (Adafactor's row and column state) and
  // whole_tensor (Muon beside adamw; Shampoo's preconditioners) rules.
  for (const std::string rule : {"adam", "sgd", "lamb", "adafactor", "muon", "shampoo"}) {
    for (const std::string strategy : {"ddp", "zero1", "zero2", "zero3"}) {
      const int world = 3;
      SCOPED_TRACE(rule + " " + strategy);
      const RunResult straight = run(world, strategy, spec_of(rule), 0, 14, nullptr);
      const RunResult first = run(world, strategy, spec_of(rule), 0, 8, nullptr);
      const auto saved = assemble(first.pieces);
      const RunResult resumed = run(world, strategy, spec_of(rule), 8, 6, &saved);
      EXPECT_TRUE(same_bits(resumed.params, straight.params));
      EXPECT_FALSE(same_bits(first.params, straight.params)) << "the last 6 steps must change something";
    }
  }
}

TEST(Resume, OneCheckpointAtAnotherWorldGivesTheSameBitsUnderEveryStrategy) {
  for (const std::string rule : {"adam", "adafactor", "shampoo"}) {
    SCOPED_TRACE(rule);
    const RunResult saved_run = run(4, "zero2", spec_of(rule), 0, 8, nullptr);
    const auto saved = assemble(saved_run.pieces);
    // Saving right after loading gives back every tensor, at another world
    // and under another strategy.
    for (const auto& [world, strategy] : std::vector<std::pair<int, std::string>>{{3, "zero3"}, {1, "ddp"}, {5, "zero1"}}) {
      const auto again = assemble(run(world, strategy, spec_of(rule), 8, 0, &saved).pieces);
      ASSERT_EQ(again.size(), saved.size()) << strategy << "@" << world;
      for (const auto& [name, whole] : saved)
        EXPECT_TRUE(same_bits(again.at(name).values, whole.values)) << name << " after " << strategy << "@" << world;
    }
    const RunResult z3 = run(3, "zero3", spec_of(rule), 8, 6, &saved);
    const RunResult dd = run(3, "ddp", spec_of(rule), 8, 6, &saved);
    EXPECT_TRUE(same_bits(z3.params, dd.params));
    // Against the uninterrupted run at 4 ranks: only the gradient's summation
    // order over 3 ranks instead of 4 differs.
    const RunResult straight4 = run(4, "zero2", spec_of(rule), 0, 14, nullptr);
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < z3.params.size(); ++i) {
      diff = std::max(diff, double(std::abs(z3.params[i] - straight4.params[i])));
      scale = std::max(scale, double(std::abs(straight4.params[i])));
    }
    std::printf("%s: zero2@4 saved at step 8, resumed at zero3@3 to step 14: max |diff| / max |p| = %.2e against the "
                "uninterrupted zero2@4 run\n",
                rule.c_str(), diff / scale);
    EXPECT_LT(diff / scale, 1e-3);
  }
}

TEST(Resume, Bf16ParametersResumeWithTheirFp32MasterWeights) {
  const RunResult straight = run(2, "zero2", spec_of("adam"), 0, 12, nullptr, DType::bf16);
  const auto saved = assemble(run(2, "zero2", spec_of("adam"), 0, 5, nullptr, DType::bf16).pieces);
  ASSERT_TRUE(saved.count("state.0.master_param"));
  EXPECT_TRUE(same_bits(run(2, "zero2", spec_of("adam"), 5, 7, &saved, DType::bf16).params, straight.params));
  EXPECT_TRUE(same_bits(run(3, "ddp", spec_of("adam"), 5, 7, &saved, DType::bf16).params,
                        run(3, "zero3", spec_of("adam"), 5, 7, &saved, DType::bf16).params));
}

TEST(Resume, AForeignTensorIsOneLineAndNothingIsLoaded) {
  const auto saved = assemble(run(2, "zero1", spec_of("adam"), 0, 3, nullptr).pieces);
  auto error_of = [&](const std::map<std::string, Whole>& wholes, const std::string& strategy,
                      const parallel::OptimizerSpec& spec) -> std::string {
    try {
      (void)run(2, strategy, spec, 3, 1, &wholes);
    } catch (const Error& e) {  // the first failing rank's error, as spawn reports it
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      return m;
    }
    return "";
  };
  auto bogus = saved;
  bogus["state.0.bogus"] = {{1}, {1.0f}};
  EXPECT_NE(error_of(bogus, "zero2", spec_of("adam")).find("the checkpoint's state.0.bogus is not a state this run's optimizer keeps"),
            std::string::npos);
  // adam's state under sgd with momentum: exp_avg is not sgd's.
  EXPECT_NE(error_of(saved, "zero2", spec_of("sgd")).find("is not a state this run's optimizer keeps (sgd"), std::string::npos);
  auto extra = saved;
  extra["param.fc9.weight"] = {{1}, {1.0f}};
  EXPECT_NE(error_of(extra, "ddp", spec_of("adam")).find("the checkpoint has a parameter fc9.weight that the model lacks"),
            std::string::npos);
  auto missing = saved;
  missing.erase("param.fc2.bias");
  EXPECT_NE(error_of(missing, "ddp", spec_of("adam")).find("the checkpoint has no parameter fc2.bias"), std::string::npos);
  auto reshaped = saved;
  reshaped["param.fc1.bias"].shape = {2, 12};
  EXPECT_NE(error_of(reshaped, "zero3", spec_of("adam")).find("parameter fc1.bias is [2, 12] in the checkpoint, [24] in the model"),
            std::string::npos);
}
