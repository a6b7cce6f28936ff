// Replay cases: the golden files from PyTorch, and malformed input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <fstream>

#include "distopt/core/error.hpp"
#include "distopt/replay/replay.hpp"

namespace distopt::replay {
namespace {

const std::string kGolden = std::string(DISTOPT_SOURCE_DIR) + "/tests/golden/optim";

TEST(Golden, EveryTorchCasePasses) {
  std::size_t files = 0;
  std::set<std::string> optimizers;
  for (const auto& entry : std::filesystem::directory_iterator(kGolden)) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    const Case c = load_case(entry.path().string());
    ASSERT_TRUE(c.expected.has_value()) << entry.path();
    optimizers.insert(c.optimizer);
    const Comparison cmp = compare(run(c), *c.expected);
    EXPECT_TRUE(cmp.ok()) << entry.path().filename() << ": " << cmp.first_mismatch;
  }
  EXPECT_GE(files, 100u);
  EXPECT_EQ(optimizers.size(), 11u);  // every torch optimizer distopt has (lion is not in torch)
}

TEST(Golden, NonPointwiseReferencesPassWithAndWithoutThreads) {
  // LARS, LAMB and Adafactor against scripts/gen_golden_nonpointwise.py's torch
  // references; on threads, the same bits as on one (the statistics are
  // summed per tensor, not per chunk).
  ThreadPool pool(3);
  std::map<std::string, int> cases;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(DISTOPT_SOURCE_DIR) +
                                                               "/tests/golden/nonpointwise")) {
    if (entry.path().extension() != ".json") continue;
    const Case c = load_case(entry.path().string());
    ASSERT_TRUE(c.expected.has_value()) << entry.path();
    ++cases[c.optimizer];
    const Result a = run(c);
    const Comparison cmp = compare(a, *c.expected);
    EXPECT_TRUE(cmp.ok()) << entry.path().filename() << ": " << cmp.first_mismatch;
    EXPECT_EQ(run(c, &pool).params, a.params) << entry.path().filename();
  }
  EXPECT_GE(cases["lars"], 10);
  EXPECT_GE(cases["lamb"], 10);
  EXPECT_GE(cases["adafactor"], 10);
  EXPECT_GE(cases["muon"], 10);
}

TEST(SchedulerSpec, ChildrenInsideTheOptionsAsInTorchsConstructor) {
  // torch: SequentialLR(opt, schedulers=[...], milestones=[...]); the same
  // spec beside the options or inside them.
  const SchedulerSpec beside = parse_scheduler_spec(
      R"({"name": "sequentiallr", "options": {"milestones": [4]},
          "schedulers": [{"name": "linearlr"}, {"name": "exponentiallr", "options": {"gamma": 0.9}}]})",
      "beside");
  const SchedulerSpec inside = parse_scheduler_spec(
      R"({"name": "sequentiallr", "options": {"milestones": [4],
          "schedulers": [{"name": "linearlr"}, {"name": "exponentiallr", "options": {"gamma": 0.9}}]}})",
      "inside");
  ASSERT_EQ(inside.schedulers.size(), 2u);
  EXPECT_EQ(inside.schedulers[1].name, "exponentiallr");
  EXPECT_EQ(std::get<double>(inside.schedulers[1].options.at("gamma")), 0.9);
  EXPECT_EQ(inside.options.count("schedulers"), 0u);
  EXPECT_EQ(inside.options.at("milestones"), beside.options.at("milestones"));
  const SchedulerSpec chained = parse_scheduler_spec(
      R"({"name": "chainedscheduler", "options": {"schedulers": [{"name": "constantlr"}]}})", "chained");
  EXPECT_EQ(chained.schedulers.size(), 1u);
  try {
    (void)parse_scheduler_spec(R"({"name": "sequentiallr", "options": {"schedulers": [{"name": "linearlr"}]},
                                   "schedulers": [{"name": "linearlr"}]})",
                               "twice");
    ADD_FAILURE() << "schedulers given twice was accepted";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("schedulers given twice"), std::string::npos) << e.what();
  }
}

TEST(BadInput, OptionsMayBeNullTriplesOrWords) {
  // null is torch's None (the default); three numbers and words are read
  // as such (the rule then checks their kinds and values).
  const Case c = parse_case(R"({"format": "distopt-replay/1", "optimizer": {"name": "adafactor", "options":
                                 {"lr": null, "beta1": null, "x": [1, 2, 3], "y": "original"}},
                                 "params": [{"shape": [2], "data": [1, 2]}], "steps": []})",
                            "t.json");
  EXPECT_EQ(c.options.count("lr"), 0u);
  EXPECT_EQ(c.options.at("x").triple()[2], 3.0);
  EXPECT_EQ(c.options.at("y").word(), "original");
  EXPECT_THROW(parse_case(R"({"format": "distopt-replay/1", "optimizer": {"name": "sgd", "options": {"lr": [1, 2, 3, 4]}},
                              "params": [], "steps": []})",
                          "t.json"),
               InvalidInput);
}

TEST(Golden, ThreadedReplayIsBitwiseTheSame) {
  ThreadPool pool(2);
  const Case c = load_case(kGolden + "/adam_012_big.json");
  const Result a = run(c), b = run(c, &pool);
  EXPECT_EQ(a.params, b.params);
}

TEST(Compare, DetectsOneUlp) {
  Result a{{{1.0f, 2.0f}}, {{0.1}}};
  Result b = a;
  EXPECT_TRUE(compare(a, b).ok());
  b.params[0][1] = std::nextafter(2.0f, 3.0f) + 1e-4f;
  const Comparison cmp = compare(a, b);
  EXPECT_EQ(cmp.mismatches, 1u);
  EXPECT_NE(cmp.first_mismatch.find("params[0][1]"), std::string::npos);
}

TEST(Json, FloatsRoundTrip) {
  Result r{{{0.1f, 1e-38f, -3.4028235e38f, 1.0f / 3.0f}}, {{0.001}}};
  const std::string text = to_json(r);
  EXPECT_NE(text.find("0.1,"), std::string::npos) << text;
  const std::string doc = "{\"format\": \"distopt-replay/1\", \"optimizer\": {\"name\": \"sgd\", \"options\": {\"lr\": 0.1}}, "
                          "\"params\": [{\"shape\": [4], \"data\": " + text.substr(text.find("[[") + 1, text.find("]]") - text.find("[[")) +
                          "}], \"steps\": []}";
  const Case c = parse_case(doc, "t.json");
  EXPECT_EQ(c.params[0], r.params[0]);
}

std::string error_of(const std::string& text) {
  try {
    parse_case(text, "case.json");
  } catch (const InvalidInput& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
    return what;
  }
  return "(no error)";
}

const std::string kGood =
    R"({"format": "distopt-replay/1", "optimizer": {"name": "adam", "options": {"lr": 0.01}},
        "param_groups": [{"params": [0]}, {"params": [1], "options": {"lr": 0.1}}],
        "params": [{"shape": [2], "data": [1, 2]}, {"shape": [1], "data": [3]}],
        "steps": [{"grads": [[0.5, 0.5], null]}]})";

TEST(BadInput, GoodCaseParses) {
  const Case c = parse_case(kGood, "case.json");
  EXPECT_EQ(c.groups.size(), 2u);
  EXPECT_FALSE(c.steps[0].grads[1].has_value());
  const Result r = run(c);
  EXPECT_EQ(r.params[1][0], 3.0f);  // no gradient: untouched
  EXPECT_EQ(r.lr[1][0], 0.1);
}

TEST(BadInput, MalformedCasesGetOneLineErrors) {
  auto with = [](const std::string& from, const std::string& to) {
    std::string s = kGood;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  EXPECT_NE(error_of(kGood.substr(0, kGood.size() / 2)).find("case.json: malformed JSON: parse error"), std::string::npos);
  EXPECT_NE(error_of("").find("malformed JSON"), std::string::npos);
  EXPECT_EQ(error_of(with("distopt-replay/1", "distopt-replay/9")),
            "case.json: format: expected \"distopt-replay/1\", got \"distopt-replay/9\"");
  EXPECT_EQ(error_of(with("\"data\": [1, 2]", "\"data\": [1, 2, 3]")),
            "case.json: params[0].data: has 3 values, shape [2] needs 2");
  EXPECT_EQ(error_of(with("[0.5, 0.5]", "[0.5]")), "case.json: steps[0].grads[0]: has 1 values, parameter 0 has 2");
  EXPECT_EQ(error_of(with("[0.5, 0.5], null", "[0.5, 0.5]")),
            "case.json: steps[0].grads: must list one gradient (or null) per parameter: 2");
  EXPECT_EQ(error_of(with("\"params\": [1]", "\"params\": [0]")),
            "case.json: param_groups[1].params[0]: parameter 0 is already in group 0");
  EXPECT_EQ(error_of(with("\"params\": [1]", "\"params\": []")), "case.json: param_groups: parameter 1 is in no group");
  EXPECT_EQ(error_of(with("[0.5, 0.5]", "[0.5, \"x\"]")), "case.json: steps[0].grads[0][1]: expected a number, got \"x\"");
  EXPECT_EQ(error_of(with("\"steps\"", "\"stepz\"")), "case.json: case: missing member 'steps'");
  EXPECT_EQ(error_of(with("{\"lr\": 0.01}", "{\"lr\": {\"fast\": 1}}")),
            "case.json: optimizer.options.lr: must be a number, a boolean, two or three numbers or a word, got "
            "{\"fast\":1}");
}

TEST(BadInput, UnknownOptimizerOrOptionFailsAtRun) {
  auto run_text = [](const std::string& text) {
    try {
      run(parse_case(text, "case.json"));
    } catch (const InvalidInput& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string s = kGood;
  s.replace(s.find("\"lr\": 0.01"), 10, "\"lr\": -1");
  EXPECT_EQ(run_text(s), "Invalid learning rate: -1");
  s = kGood;
  s.replace(s.find("\"adam\""), 6, "\"adan\"");
  EXPECT_NE(run_text(s).find("unknown optimizer 'adan'"), std::string::npos);
  // A word where the rule wants a number: the rule's spec decides, at run.
  s = kGood;
  s.replace(s.find("\"lr\": 0.01"), 10, "\"lr\": \"fast\"");
  EXPECT_NE(run_text(s).find("lr"), std::string::npos);
  EXPECT_NE(run_text(s).find("fast"), std::string::npos);
}

TEST(BadInput, MissingFileIsAnIoError) {
  EXPECT_THROW(load_case("/nonexistent/case.json"), IoError);
}

}  // namespace
}  // namespace distopt::replay
