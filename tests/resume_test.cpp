// Checkpoint content across strategies and world sizes
// (checkpoint/state.hpp): a run saved and resumed at the same world size
// ends with the uninterrupted run's bits under every strategy; one
// checkpoint resumed at another world size under different strategies ends
// with the same bits under each; and saving right after a load gives back
// every tensor bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/checkpoint/survival.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/quant.hpp"
#include "resume_support.hpp"

using namespace distopt;
using namespace distopt::checkpoint;
using namespace distopt::resume_support;

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

TEST(Resume, FromFilesEachRankReadsItsRangesWithTheSameBits) {
  // The pieces of a zero2@4 run written as rank files (a tensor's small
  // state in every file that holds a piece of it, as save() writes them)
  // and read a range at a time (PieceFiles): the same bits as from the
  // assembled tensors, at the same world and at others.
  std::string tmp = (std::filesystem::temp_directory_path() / "distopt-resume-XXXXXX").string();
  ASSERT_NE(::mkdtemp(tmp.data()), nullptr);
  for (const std::string rule : {"adam", "adafactor", "shampoo"}) {
    SCOPED_TRACE(rule);
    const RunResult first = run(4, "zero2", spec_of(rule), 0, 8, nullptr);
    const auto saved = assemble(first.pieces);
    // Each piece into the first file that has none of its tensor.
    std::vector<PieceSet> sets;
    std::vector<std::set<std::string>> held;
    for (const checkpoint::Piece& p : first.pieces) {
      std::size_t f = 0;
      while (f < sets.size() && held[f].count(p.name)) ++f;
      if (f == sets.size()) sets.emplace_back(), held.emplace_back();
      sets[f].view(p.name, p.shape, p.begin, p.values);
      held[f].insert(p.name);
    }
    ASSERT_GT(sets.size(), 1u);
    std::vector<std::string> paths;
    for (const PieceSet& set : sets) {
      paths.push_back(str(tmp, "/", rule, paths.size(), ".safetensors"));
      const std::vector<std::byte> bytes = pieces_bytes(set);
      std::FILE* f = std::fopen(paths.back().c_str(), "wb");
      ASSERT_NE(f, nullptr);
      ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
      std::fclose(f);
    }
    const PieceFiles files(paths);
    EXPECT_TRUE(same_bits(run_from(4, "zero2", spec_of(rule), 8, 6, &files).params,
                          run(4, "zero2", spec_of(rule), 0, 14, nullptr).params));
    for (const auto& [world, strategy] :
         std::vector<std::pair<int, std::string>>{{3, "zero3"}, {1, "ddp"}, {2, "zero1"}}) {
      EXPECT_TRUE(same_bits(run_from(world, strategy, spec_of(rule), 8, 4, &files).params,
                            run(world, strategy, spec_of(rule), 8, 4, &saved).params))
          << strategy << "@" << world;
      const auto again = assemble(run_from(world, strategy, spec_of(rule), 8, 0, &files).pieces);
      ASSERT_EQ(again.size(), saved.size()) << strategy << "@" << world;
      for (const auto& [name, whole] : saved)
        EXPECT_TRUE(same_bits(again.at(name).values, whole.values)) << name << " after " << strategy << "@" << world;
    }
  }
  std::filesystem::remove_all(tmp);
}

TEST(Resume, Bf16ParametersResumeWithTheirFp32MasterWeights) {
  const RunResult straight = run(2, "zero2", spec_of("adam"), 0, 12, nullptr, DType::bf16);
  const auto saved = assemble(run(2, "zero2", spec_of("adam"), 0, 5, nullptr, DType::bf16).pieces);
  ASSERT_TRUE(saved.count("state.0.master_param"));
  EXPECT_TRUE(same_bits(run(2, "zero2", spec_of("adam"), 5, 7, &saved, DType::bf16).params, straight.params));
  EXPECT_TRUE(same_bits(run(3, "ddp", spec_of("adam"), 5, 7, &saved, DType::bf16).params,
                        run(3, "zero3", spec_of("adam"), 5, 7, &saved, DType::bf16).params));
}

// Quantized state (docs/optimizers.md, "Quantized state") is checkpointed
// as state_dict() gives it, the values its codes stand for and the block
// scales: a resume rebuilds the same codes at any world and strategy.
TEST(Resume, QuantizedStateReshardsWithItsCodesAndScales) {
  const std::vector<std::size_t> hidden = {256, 64};  // fc1.weight 5120, fc2.weight 16384 elements: quantized
  for (const char* dtype : {"int8", "int4"}) {
    for (const std::string rule : {"adamw", "sgd"}) {
      SCOPED_TRACE(rule + " " + dtype);
      parallel::OptimizerSpec spec = spec_of(rule);
      spec.options[std::string(kStateDTypeOption)] = dtype;
      const RunResult straight = run(4, "zero2", spec, 0, 14, nullptr, DType::f32, hidden);
      const RunResult first = run(4, "zero2", spec, 0, 8, nullptr, DType::f32, hidden);
      const auto saved = assemble(first.pieces);
      const std::string key = rule == "sgd" ? "momentum_buffer" : "exp_avg";
      ASSERT_TRUE(saved.count("state.0." + key + ".absmax"));
      EXPECT_EQ(saved.at("state.0." + key + ".absmax").values.size(),
                5120u / (std::string(dtype) == "int8" ? 256 : 128));
      EXPECT_FALSE(saved.count("state.1." + key + ".absmax")) << "fc1.bias (256 elements) keeps fp32 state";
      EXPECT_TRUE(same_bits(run(4, "zero2", spec, 8, 6, &saved, DType::f32, hidden).params, straight.params));
      for (const auto& [world, strategy] :
           std::vector<std::pair<int, std::string>>{{3, "zero3"}, {1, "ddp"}, {5, "zero1"}, {8, "zero3"}, {2, "ddp"}}) {
        const auto again = assemble(run(world, strategy, spec, 8, 0, &saved, DType::f32, hidden).pieces);
        ASSERT_EQ(again.size(), saved.size()) << strategy << "@" << world;
        for (const auto& [name, whole] : saved)
          EXPECT_TRUE(same_bits(again.at(name).values, whole.values)) << name << " after " << strategy << "@" << world;
      }
      EXPECT_TRUE(same_bits(run(3, "zero3", spec, 8, 6, &saved, DType::f32, hidden).params,
                            run(3, "ddp", spec, 8, 6, &saved, DType::f32, hidden).params));
      // Into fp32 state: the values as they were, the scales left behind.
      parallel::OptimizerSpec f32 = spec_of(rule);
      const auto plain = assemble(run(2, "zero1", f32, 8, 0, &saved, DType::f32, hidden).pieces);
      EXPECT_FALSE(plain.count("state.0." + key + ".absmax"));
      EXPECT_TRUE(same_bits(plain.at("state.0." + key).values, saved.at("state.0." + key).values));
      // An fp32 checkpoint into quantized state: quantized afresh (each block
      // scaled by its largest value, which may be a code below 1: not the
      // saved codes, but within half a code's step of the values).
      const auto requantized = assemble(run(2, "zero1", spec, 8, 0, &plain, DType::f32, hidden).pieces);
      ASSERT_TRUE(requantized.count("state.0." + key + ".absmax"));
      const auto& was = saved.at("state.0." + key).values;
      const auto& now = requantized.at("state.0." + key).values;
      const auto& scales = saved.at("state.0." + key + ".absmax").values;
      const std::size_t block = std::string(dtype) == "int8" ? 256 : 128;
      for (std::size_t k = 0; k < was.size(); ++k)
        ASSERT_LE(std::abs(now[k] - was[k]), 0.125f * scales[k / block]) << "element " << k;
      // A value that is no code times its block's scale: one line, nothing loaded.
      auto bad = saved;
      bad.at("state.0." + key).values[300] = std::nextafter(bad.at("state.0." + key).values[300], 1.0f);
      try {
        run(2, "zero3", spec, 8, 0, &bad, DType::f32, hidden);
        ADD_FAILURE() << "a value off the codes was loaded";
      } catch (const Error& e) {  // the first failing rank's error, as spawn reports it
        EXPECT_NE(std::string(e.what()).find("state.0." + key + " is not " + dtype + " codes times state.0." + key +
                                             ".absmax (block "),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

// bf16 state: no scales, shards cut anywhere; it reshards to the same bits,
// and any other storage's checkpoint loads into it rounded as torch rounds.
TEST(Resume, Bf16StateReshardsAndTakesOtherStoragesRounded) {
  const std::vector<std::size_t> hidden = {256, 64};
  parallel::OptimizerSpec spec = spec_of("adamw");
  spec.options[std::string(kStateDTypeOption)] = "bf16";
  const RunResult straight = run(4, "zero2", spec, 0, 14, nullptr, DType::f32, hidden);
  const auto saved = assemble(run(4, "zero2", spec, 0, 8, nullptr, DType::f32, hidden).pieces);
  for (const auto& [name, whole] : saved) {
    EXPECT_EQ(name.find(".absmax"), std::string::npos) << name;
    if (name.find("exp_avg") == std::string::npos) continue;
    for (float v : whole.values)  // every tensor's moments, fc1.bias's too, are bfloat16s
      ASSERT_EQ(std::bit_cast<std::uint32_t>(v) & 0xFFFFu, 0u) << name;
  }
  EXPECT_TRUE(same_bits(run(4, "zero2", spec, 8, 6, &saved, DType::f32, hidden).params, straight.params));
  for (const auto& [world, strategy] :
       std::vector<std::pair<int, std::string>>{{3, "zero3"}, {1, "ddp"}, {5, "zero1"}}) {
    const auto again = assemble(run(world, strategy, spec, 8, 0, &saved, DType::f32, hidden).pieces);
    ASSERT_EQ(again.size(), saved.size()) << strategy << "@" << world;
    for (const auto& [name, whole] : saved)
      EXPECT_TRUE(same_bits(again.at(name).values, whole.values)) << name << " after " << strategy << "@" << world;
  }
  for (const char* from : {"f32", "int8"}) {
    parallel::OptimizerSpec other = spec_of("adamw");
    other.options[std::string(kStateDTypeOption)] = from;
    const auto theirs = assemble(run(2, "zero1", other, 0, 8, nullptr, DType::f32, hidden).pieces);
    const auto mine = assemble(run(3, "zero3", spec, 8, 0, &theirs, DType::f32, hidden).pieces);
    EXPECT_FALSE(mine.count("state.0.exp_avg.absmax")) << from;
    const auto& was = theirs.at("state.0.exp_avg").values;
    const auto& now = mine.at("state.0.exp_avg").values;
    ASSERT_EQ(was.size(), now.size());
    for (std::size_t k = 0; k < was.size(); ++k)
      ASSERT_TRUE(same_bits({now[k]}, {quant::from_bf16(quant::to_bf16(was[k]))})) << from << " element " << k;
  }
}

// A quantized tensor off the blocks of its unit (fc1.bias: 5000 elements
// after a weight of 100000): ddp holds it whole and runs it, its ranks'
// checkpoint pieces start mid-block, and every world reads back the same
// state; zero1-3 refuse it in one line. Scales that fit no storage, or of
// a tensor no rule quantizes, are refused.
TEST(Resume, QuantizedStateOffTheBlocksUnderDdpAndScalesThatDoNotFit) {
  const std::vector<std::size_t> hidden = {5000};
  parallel::OptimizerSpec spec = spec_of("adamw");
  spec.options[std::string(kStateDTypeOption)] = "int4";
  const RunResult straight = run(3, "ddp", spec, 0, 7, nullptr, DType::f32, hidden);
  const auto saved = assemble(run(3, "ddp", spec, 0, 4, nullptr, DType::f32, hidden).pieces);
  ASSERT_EQ(saved.at("state.1.exp_avg.absmax").values.size(), 40u);  // fc1.bias: 5000 / 128, rounded up
  EXPECT_TRUE(same_bits(run(3, "ddp", spec, 4, 3, &saved, DType::f32, hidden).params, straight.params));
  for (int world : {1, 2, 4}) {
    const auto again = assemble(run(world, "ddp", spec, 4, 0, &saved, DType::f32, hidden).pieces);
    for (const auto& [name, whole] : saved)
      EXPECT_TRUE(same_bits(again.at(name).values, whole.values)) << name << " at ddp@" << world;
  }
  try {
    run(2, "zero1", spec, 0, 1, nullptr, DType::f32, hidden);
    ADD_FAILURE() << "zero1 took a quantized tensor off its blocks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter fc1.bias starts at element 100000 of its unit: zero1 with "
                                         "state_dtype int4 needs every tensor of 4096 or more elements"),
              std::string::npos)
        << e.what();
  }
  auto error_of = [&](const std::map<std::string, Whole>& wholes, const parallel::OptimizerSpec& s) -> std::string {
    try {
      (void)run(2, "zero1", s, 4, 0, &wholes, DType::f32, {256, 64});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  parallel::OptimizerSpec aligned = spec_of("adamw");
  aligned.options[std::string(kStateDTypeOption)] = "int8";
  auto ok = assemble(run(2, "zero1", aligned, 0, 2, nullptr, DType::f32, {256, 64}).pieces);
  auto bad = ok;
  bad.at("state.0.exp_avg.absmax") = Whole{{7}, std::vector<float>(7, 1.0f)};
  EXPECT_NE(error_of(bad, aligned)
                .find("the checkpoint's state.0.exp_avg.absmax is [7]; 5120 elements have 20 blocks "
                      "of 256 (int8)"),
            std::string::npos)
      << error_of(bad, aligned);
  bad = ok;
  bad["state.0.step.absmax"] = Whole{{20}, std::vector<float>(20, 1.0f)};
  EXPECT_NE(error_of(bad, aligned).find("state.0.step.absmax is not a state this run's optimizer keeps"),
            std::string::npos)
      << error_of(bad, aligned);
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
