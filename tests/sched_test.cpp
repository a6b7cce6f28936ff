// LR schedulers: golden trajectories from PyTorch, state_dict round trips,
// torch's option checks.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "distopt/core/error.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/replay/replay.hpp"

namespace distopt {
namespace {

const std::string kGolden = std::string(DISTOPT_SOURCE_DIR) + "/tests/golden/sched";
const std::string kGoldenLambda = std::string(DISTOPT_SOURCE_DIR) + "/tests/golden/sched_lambda";

// The functions scripts/gen_golden_sched.py names in LAMBDAS.
std::function<double(long)> named_lambda(const std::string& name) {
  if (name == "exp95") return [](long e) { return std::pow(0.95, static_cast<double>(e)); };
  if (name == "inv") return [](long e) { return 1.0 / static_cast<double>(e + 1); };
  if (name == "warmup5") return [](long e) { return std::min(1.0, static_cast<double>(e + 1) / 5); };
  if (name == "const95") return [](long) { return 0.95; };
  if (name == "alt") return [](long e) { return e % 2 ? 1.1 : 0.9; };
  if (name == "decay") return [](long e) { return 1.0 - 0.01 * static_cast<double>(e); };
  throw InvalidInput("unknown test lambda " + name);
}

// make_scheduler, plus lambdalr/multiplicativelr with named functions.
std::unique_ptr<Scheduler> test_factory(Optimizer& opt, const SchedulerSpec& spec) {
  if (spec.name != "lambdalr" && spec.name != "multiplicativelr") return make_scheduler(opt, spec);
  std::vector<std::function<double(long)>> fns;
  std::stringstream names(std::get<std::string>(spec.options.at("lr_lambda")));
  for (std::string n; std::getline(names, n, ',');) fns.push_back(named_lambda(n));
  if (spec.name == "lambdalr") return std::make_unique<LambdaLR>(opt, std::move(fns));
  return std::make_unique<MultiplicativeLR>(opt, std::move(fns));
}

std::vector<std::filesystem::path> cases_in(const std::string& dir) {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".json") out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SchedulerGolden, EveryTorchCasePasses) {
  std::map<std::string, int> per_scheduler;
  for (const std::string& dir : {kGolden, kGoldenLambda})
    for (const auto& path : cases_in(dir)) {
      const replay::Case c = replay::load_case(path.string());
      ASSERT_TRUE(c.scheduler && c.expected) << path;
      ++per_scheduler[c.scheduler->name];
      const replay::Comparison cmp = replay::compare(replay::run(c, nullptr, test_factory), *c.expected);
      EXPECT_TRUE(cmp.ok()) << path.filename() << ": " << cmp.first_mismatch;
    }
  // Every scheduler torch has (and SWALR), at least 3 cases each.
  for (std::string_view name : scheduler_names()) EXPECT_GE(per_scheduler[std::string(name)], 3) << name;
  EXPECT_GE(per_scheduler["lambdalr"], 3);
  EXPECT_GE(per_scheduler["multiplicativelr"], 3);
}

TEST(SchedulerGolden, LrsMatchTorchToTheLastBits) {
  // The lrs are computed in double by the same formulas in the same order as
  // torch's Python: they agree far below the replay tolerance.
  double worst = 0;
  for (const auto& path : cases_in(kGolden)) {
    const replay::Case c = replay::load_case(path.string());
    const replay::Result r = replay::run(c);
    for (std::size_t g = 0; g < r.lr.size(); ++g)
      for (std::size_t k = 0; k < r.lr[g].size(); ++k) {
        const double want = c.expected->lr[g][k];
        worst = std::max(worst, std::abs(r.lr[g][k] - want) / std::max(std::abs(want), 1e-300));
      }
  }
  EXPECT_LT(worst, 1e-13);
}

// --------------------------------------------------------- state_dict round trip

struct Trajectory {
  std::vector<std::vector<double>> lrs;  // per step, per group
  std::vector<std::vector<float>> params;
};

// Runs a case; at step `split` (if any) saves optimizer and scheduler state,
// builds a fresh optimizer and scheduler on a copy of the parameters, loads
// the states and continues with those.
Trajectory run_with_split(const replay::Case& c, std::optional<std::size_t> split) {
  std::vector<std::vector<float>> values = c.params;
  std::vector<std::vector<float>> grads;
  for (const auto& p : c.params) grads.emplace_back(p.size());
  auto make = [&](std::vector<std::vector<float>>& vals) {
    std::vector<ParamGroupSpec> groups(c.groups.size());
    for (std::size_t g = 0; g < c.groups.size(); ++g) {
      groups[g].options = c.groups[g].options;
      for (std::size_t i : c.groups[g].params)
        groups[g].params.push_back(
            Param{"p", {vals[i].data(), DType::f32, c.shapes[i]}, {grads[i].data(), DType::f32, c.shapes[i]}, false});
    }
    auto opt = std::make_unique<Optimizer>(c.optimizer, std::move(groups), c.options);
    return opt;
  };
  std::vector<std::vector<float>> values2;
  auto opt = make(values);
  auto sched = test_factory(*opt, *c.scheduler);
  Trajectory run;
  for (std::size_t k = 0; k < c.steps.size(); ++k) {
    if (split && k == *split) {
      const StateDict os = opt->state_dict();
      const SchedulerState ss = sched->state_dict();
      values2 = values;
      auto opt2 = make(values2);
      auto sched2 = test_factory(*opt2, *c.scheduler);
      opt2->load_state_dict(os);
      sched2->load_state_dict(ss);
      opt = std::move(opt2);
      sched = std::move(sched2);
    }
    // Parameters are ordered group by group in the optimizer.
    std::size_t idx = 0;
    for (const auto& g : c.groups)
      for (std::size_t i : g.params) {
        std::copy(c.steps[k].grads[i]->begin(), c.steps[k].grads[i]->end(), grads[i].begin());
        opt->param(idx++).has_grad = true;
      }
    opt->step();
    if (sched->needs_metric())
      sched->step(*c.steps[k].metric);
    else
      sched->step();
    run.lrs.push_back(sched->last_lr());
  }
  run.params = split ? values2 : values;
  return run;
}

TEST(SchedulerState, RoundTripMidRunContinuesIdentically) {
  int checked = 0;
  for (const std::string& dir : {kGolden, kGoldenLambda})
    for (const auto& path : cases_in(dir)) {
      const replay::Case c = replay::load_case(path.string());
      const Trajectory whole = run_with_split(c, std::nullopt);
      for (std::size_t split : {std::size_t{1}, c.steps.size() / 2, c.steps.size() - 1}) {
        const Trajectory resumed = run_with_split(c, split);
        EXPECT_EQ(resumed.lrs, whole.lrs) << path.filename() << " split at step " << split;
        EXPECT_EQ(resumed.params, whole.params) << path.filename() << " split at step " << split;
      }
      ++checked;
    }
  EXPECT_GE(checked, 50);
}

TEST(SchedulerState, LoadValidatesBeforeChangingAnything) {
  float p[2] = {1, 2}, g[2] = {0, 0};
  Optimizer opt("sgd", {Param{"p", {p, DType::f32, {2}}, {g, DType::f32, {2}}, false}}, {{"lr", 0.1}});
  StepLR a(opt, 2, 0.5);
  a.step();
  a.step();
  SchedulerState s = a.state_dict();
  EXPECT_EQ(s.kind, "steplr");
  EXPECT_EQ(s.values.at("last_epoch"), std::vector<double>{2});

  StepLR b(opt, 3, 0.5);
  SchedulerState wrong = s;
  wrong.kind = "exponentiallr";
  EXPECT_THROW(b.load_state_dict(wrong), InvalidInput);
  wrong = s;
  wrong.values.erase("last_epoch");
  EXPECT_THROW(b.load_state_dict(wrong), InvalidInput);
  wrong = s;
  wrong.values["base_lrs"] = {0.1, 0.2};  // two groups' worth for one group
  EXPECT_THROW(b.load_state_dict(wrong), InvalidInput);
  EXPECT_EQ(b.last_epoch(), 0) << "a failed load changes nothing";
  b.load_state_dict(s);
  EXPECT_EQ(b.last_epoch(), 2);
}

// ------------------------------------------------------------ semantics

struct OneParam {
  float p[3] = {1, 2, 3}, g[3] = {0.1f, 0.2f, 0.3f};
  Optimizer opt;
  explicit OneParam(const std::string& rule, OptionMap o)
      : opt(rule, {Param{"p", {p, DType::f32, {3}}, {g, DType::f32, {3}}, false}}, std::move(o)) {}
};

TEST(Scheduler, ConstructionTakesTheInitialStep) {
  OneParam s("sgd", {{"lr", 0.3}});
  LinearLR lin(s.opt, 0.5, 1.0, 4);
  EXPECT_DOUBLE_EQ(s.opt.lr(0), 0.15) << "constructing LinearLR multiplies by start_factor";
  EXPECT_EQ(lin.last_epoch(), 0);
  EXPECT_EQ(s.opt.extra(0, "initial_lr"), 0.3);
  // A second scheduler takes its base lr from initial_lr, not the current lr.
  ExponentialLR ex(s.opt, 0.5);
  EXPECT_EQ(ex.base_lrs(), std::vector<double>{0.3});
  EXPECT_DOUBLE_EQ(s.opt.lr(0), 0.15);
}

TEST(Scheduler, CyclicLrCyclesMomentumOrBeta1) {
  OneParam sgd("sgd", {{"lr", 0.1}, {"momentum", 0.9}});
  CyclicLROptions o;
  o.base_lr = {0.01};
  o.max_lr = {0.1};
  o.step_size_up = 2;
  CyclicLR c(sgd.opt, o);
  EXPECT_DOUBLE_EQ(sgd.opt.group(0).options.at("momentum").number(), 0.9);
  c.step();
  EXPECT_DOUBLE_EQ(sgd.opt.lr(0), 0.055);
  EXPECT_DOUBLE_EQ(sgd.opt.group(0).options.at("momentum").number(), 0.85);

  OneParam adam("adam", {{"lr", 0.001}});
  CyclicLR ca(adam.opt, o);
  ca.step();
  ca.step();
  EXPECT_DOUBLE_EQ(adam.opt.group(0).options.at("betas").pair()[0], 0.8);
  EXPECT_DOUBLE_EQ(adam.opt.group(0).options.at("betas").pair()[1], 0.999);
}

TEST(Scheduler, WarmRestartsTakeFractionalEpochs) {
  OneParam s("sgd", {{"lr", 1.0}});
  CosineAnnealingWarmRestarts w(s.opt, 10, 2, 0.0);
  w.step_epoch(5.0);
  EXPECT_NEAR(s.opt.lr(0), 0.5, 1e-15);
  w.step_epoch(10.0 + 10.0);  // second period (length 20), half-way
  EXPECT_NEAR(s.opt.lr(0), 0.5, 1e-15);
  EXPECT_THROW(w.step_epoch(-1), InvalidInput);
}

TEST(Scheduler, ReduceLrOnPlateauNeedsAMetric) {
  OneParam s("sgd", {{"lr", 1.0}});
  ReduceLROnPlateauOptions o;
  o.patience = 0;
  ReduceLROnPlateau r(s.opt, o);
  EXPECT_THROW(r.step(), InvalidInput);
  r.step(1.0);
  r.step(1.0);
  EXPECT_DOUBLE_EQ(s.opt.lr(0), 0.1);
  StepLR st(s.opt, 1);
  EXPECT_THROW(st.step(0.5), InvalidInput);
}

// ------------------------------------------------------------ bad options

std::string error_of(const std::string& rule, const SchedulerSpec& spec) {
  OneParam s(rule, rule == "sgd" ? OptionMap{{"lr", 0.1}} : OptionMap{});
  try {
    auto sched = make_scheduler(s.opt, spec);
    for (int i = 0; i < 50; ++i) sched->needs_metric() ? sched->step(1.0) : sched->step();
  } catch (const InvalidInput& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
    return what;
  }
  return "(no error)";
}

SchedulerSpec spec(std::string name, std::map<std::string, SchedulerOption, std::less<>> o,
                   std::vector<SchedulerSpec> children = {}) {
  return SchedulerSpec{std::move(name), std::move(o), std::move(children)};
}

TEST(SchedulerOptions, TorchsChecksAsOneLineErrors) {
  auto has = [](const std::string& what, const std::string& want) {
    return what.find(want) != std::string::npos ? ::testing::AssertionSuccess()
                                                : ::testing::AssertionFailure() << "'" << what << "' lacks '" << want << "'";
  };
  EXPECT_TRUE(has(error_of("sgd", spec("reducelronplateau", {{"factor", 1.0}})), "Factor should be < 1.0."));
  EXPECT_TRUE(has(error_of("sgd", spec("reducelronplateau", {{"mode", std::string("up")}})), "mode up is unknown!"));
  EXPECT_TRUE(has(error_of("sgd", spec("onecyclelr", {{"max_lr", 0.1}, {"total_steps", 10.0}, {"pct_start", 1.5}})),
                  "Expected float between 0 and 1 pct_start, but got 1.5"));
  EXPECT_TRUE(has(error_of("sgd", spec("onecyclelr", {{"max_lr", 0.1}, {"total_steps", 10.0}})),
                  "Tried to step 12 times. The specified number of total steps is 10"));
  EXPECT_TRUE(has(error_of("sgd", spec("onecyclelr", {{"max_lr", 0.1}})),
                  "You must define either total_steps OR (epochs AND steps_per_epoch)"));
  EXPECT_TRUE(has(error_of("sgd", spec("cycliclr", {{"base_lr", 0.01}})), "cycliclr: option max_lr is required"));
  EXPECT_TRUE(has(error_of("adagrad", spec("cycliclr", {{"base_lr", 0.01}, {"max_lr", 0.1}})),
                  "optimizer must support momentum"));
  EXPECT_TRUE(has(error_of("sgd", spec("cycliclr", {{"base_lr", 0.01}, {"max_lr", 0.1}, {"mode", std::string("sine")}})),
                  "mode is invalid"));
  EXPECT_TRUE(has(error_of("sgd", spec("cosineannealingwarmrestarts", {{"T_0", 2.5}})), "T_0 must be an integer"));
  EXPECT_TRUE(has(error_of("sgd", spec("cosineannealingwarmrestarts", {{"T_0", 0.0}})),
                  "Expected positive integer T_0, but got 0"));
  EXPECT_TRUE(has(error_of("sgd", spec("constantlr", {{"factor", 1.5}})),
                  "Constant multiplicative factor expected to be between 0 and 1."));
  EXPECT_TRUE(has(error_of("sgd", spec("linearlr", {{"start_factor", 0.0}})), "Starting multiplicative factor"));
  EXPECT_TRUE(has(error_of("sgd", spec("steplr", {})), "steplr: option step_size is required"));
  EXPECT_TRUE(has(error_of("sgd", spec("steplr", {{"step_size", 2.0}, {"gama", 0.5}})),
                  "unknown option 'gama' for scheduler steplr"));
  EXPECT_TRUE(has(error_of("sgd", spec("warmuplr", {})), "unknown scheduler 'warmuplr'"));
  EXPECT_TRUE(has(error_of("sgd", spec("exponentiallr", {{"gamma", std::string("fast")}})),
                  "option gamma must be a number"));
  EXPECT_TRUE(has(error_of("sgd", spec("sequentiallr", {{"milestones", std::vector<double>{2, 4}}},
                                       {spec("exponentiallr", {{"gamma", 0.9}}), spec("steplr", {{"step_size", 2.0}})})),
                  "expects number of schedulers provided to be one more than the number of milestone points"));
  EXPECT_TRUE(has(error_of("sgd", spec("sequentiallr", {{"milestones", std::vector<double>{}}},
                                       {spec("reducelronplateau", {})})),
                  "sequentiallr cannot hold reducelronplateau"));
  EXPECT_TRUE(has(error_of("sgd", spec("chainedscheduler", {}, {spec("reducelronplateau", {})})),
                  "chainedscheduler cannot hold reducelronplateau"));
  EXPECT_TRUE(has(error_of("sgd", spec("cycliclr", {{"base_lr", std::vector<double>{0.1, 0.2}}, {"max_lr", 0.5}})),
                  "expected 1 values for base_lr, got 2"));
  EXPECT_TRUE(has(error_of("sgd", spec("swalr", {{"swa_lr", 0.05}, {"anneal_epochs", -1.0}})),
                  "anneal_epochs must be equal or greater than 0, got -1"));
}

TEST(SchedulerReplay, MalformedSchedulerMembersAreNamed) {
  const std::string head =
      R"({"format": "distopt-replay/1", "optimizer": {"name": "sgd", "options": {"lr": 0.1}},
          "params": [{"shape": [1], "data": [1]}], "steps": [{"grads": [[0.5]]}], )";
  auto error = [&](const std::string& tail) {
    try {
      replay::parse_case(head + tail + "}", "case.json");
    } catch (const InvalidInput& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error(R"("scheduler": {"options": {}})").find("scheduler: missing member 'name'"), std::string::npos);
  EXPECT_NE(error(R"("scheduler": {"name": "steplr", "opts": {}})").find("unknown member 'opts'"), std::string::npos);
  EXPECT_NE(error(R"("scheduler": {"name": "reducelronplateau"})").find("steps[0]: needs a 'metric'"),
            std::string::npos);
  const replay::Case c = replay::parse_case(head + R"("scheduler": {"name": "nosuch"})" + "}", "case.json");
  try {
    replay::run(c);
    FAIL() << "an unknown scheduler must be refused";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("case.json: scheduler: unknown scheduler 'nosuch'"), std::string::npos)
        << e.what();
  }
}

// The command line's --scheduler NAME --scheduler-option KEY=VALUE, and
// the JSON form, through the library (one parser for the tool, replay and
// the Python front end).
TEST(SchedulerSpecText, KeyValueOptionsAreTyped) {
  const std::vector<std::string> kv = {"milestones=2,5", "gamma=0.5", "three_phase=true", "cycle_momentum=false",
                                       "anneal_strategy=linear", "eta_min=-1e-3", "x=.5", "y=+2", "mode=",
                                       "max_lr=0.1"};
  const SchedulerSpec s = scheduler_spec_from_options("multisteplr", kv);
  EXPECT_EQ(s.name, "multisteplr");
  EXPECT_TRUE(s.schedulers.empty());
  EXPECT_EQ(s.options.size(), kv.size());
  EXPECT_EQ(std::get<std::vector<double>>(s.options.at("milestones")), (std::vector<double>{2, 5}));
  EXPECT_EQ(std::get<double>(s.options.at("gamma")), 0.5);
  EXPECT_EQ(std::get<bool>(s.options.at("three_phase")), true);
  EXPECT_EQ(std::get<bool>(s.options.at("cycle_momentum")), false);
  EXPECT_EQ(std::get<std::string>(s.options.at("anneal_strategy")), "linear");
  EXPECT_EQ(std::get<double>(s.options.at("eta_min")), -1e-3);
  EXPECT_EQ(std::get<double>(s.options.at("x")), 0.5);
  EXPECT_EQ(std::get<double>(s.options.at("y")), 2.0);
  EXPECT_EQ(std::get<std::string>(s.options.at("mode")), "");
  EXPECT_EQ(std::get<double>(s.options.at("max_lr")), 0.1);
  EXPECT_TRUE(scheduler_spec_from_options("steplr", {}).options.empty());
  for (const auto& [bad, expected] : std::vector<std::pair<std::string, std::string>>{
           {"gamma", "--scheduler-option: 'gamma' is not KEY=VALUE"},
           {"=3", "--scheduler-option: '=3' is not KEY=VALUE"},
           {"gamma=1x", "--scheduler-option gamma: '1x' is not a finite number"},
           {"gamma=-inf", "--scheduler-option gamma: '-inf' is not a finite number"},
           {"milestones=2,,5", "--scheduler-option milestones: '' is not a finite number"},
           {"milestones=2,1e999", "--scheduler-option milestones: '1e999' is not a finite number"}}) {
    try {
      (void)scheduler_spec_from_options("steplr", std::vector<std::string>{bad});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidInput& e) {
      EXPECT_EQ(std::string(e.what()), expected);
    }
  }
}

TEST(SchedulerSpecText, JsonTextBuildsTheScheduler) {
  float p = 1, g = 0;
  auto lrs = [&](auto make) {
    Optimizer opt("sgd", {Param{"p", {&p, DType::f32, {1}}, {&g, DType::f32, {1}}, true}}, {{"lr", 0.1}});
    auto sched = make(opt);
    std::vector<double> out;
    for (int k = 0; k < 6; ++k) {
      sched->step();
      out.push_back(opt.lr(0));
    }
    return out;
  };
  const auto from_json = lrs([](Optimizer& o) {
    return make_scheduler(o, std::string_view(R"({"name": "steplr", "options": {"step_size": 2, "gamma": 0.5}})"));
  });
  EXPECT_EQ(from_json, (std::vector<double>{0.1, 0.05, 0.05, 0.025, 0.025, 0.0125}));
  try {
    (void)parse_scheduler_spec(R"({"name": "steplr", "option": {}})", "--scheduler");
    ADD_FAILURE() << "an unknown member was accepted";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("--scheduler: scheduler: unknown member 'option'"), std::string::npos)
        << e.what();
  }
}

TEST(SchedulerSpecText, NestingIsBoundedBeforeTheStackIs) {
  std::string spec = R"({"name": "constantlr"})";
  for (int i = 0; i < 100; ++i) spec = R"({"name": "chainedscheduler", "schedulers": [)" + spec + "]}";
  try {
    (void)parse_scheduler_spec(spec, "--scheduler");
    ADD_FAILURE() << "100 levels of schedulers were accepted";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("schedulers nested deeper than 64 levels"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace distopt
