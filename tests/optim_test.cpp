// Update rules and the Optimizer: every rule against an independent double
// reference, then properties checked over the whole registry (slicing and
// threading invariance, misaligned starts, bf16/f16 master weights, state_dict
// round trips, torch's skip semantics, no allocation in step, bad input).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <tuple>

#include "distopt/core/error.hpp"
#include "distopt/optim/option_text.hpp"
#include "distopt/optim/optimizer.hpp"
#include "optim_reference.hpp"

// Counts heap allocations made through operator new (std::vector, strings,
// std::function ...), to check that a steady-state step allocates nothing.
static std::atomic<long> g_news{0};
void* operator new(std::size_t n) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace distopt {
namespace {

std::vector<float> random_vector(std::size_t n, std::uint32_t seed, float scale = 1.0f, bool zeros = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = (zeros && i % 11 == 3) ? 0.0f : d(rng);
  return v;
}

// A single f32 parameter with its own gradient buffer.
struct Tensor1 {
  Buffer value, grad;
  std::size_t n, off;
  explicit Tensor1(const std::vector<float>& init, std::size_t offset = 0)
      : value((init.size() + offset) * 4 + 4, 0), grad((init.size() + offset) * 4 + 4, 1), n(init.size()),
        off(offset) {
    std::copy(init.begin(), init.end(), data());
  }
  float* data() { return value.as<float>() + off; }
  float* g() { return grad.as<float>() + off; }
  Param param() {
    Param p;
    p.value = {data(), DType::f32, {static_cast<std::int64_t>(n)}};
    p.grad = {g(), DType::f32, {static_cast<std::int64_t>(n)}};
    return p;
  }
};

struct RefCase {
  std::string rule;
  OptionMap options;
};

std::vector<RefCase> reference_cases() {
  return {
      {"sgd", {{"lr", 0.1}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.3}, {"weight_decay", 0.1}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.05}, {"maximize", true}}},
      {"adam", {}},
      {"adam", {{"lr", 0.01}, {"amsgrad", true}, {"weight_decay", 0.1}, {"eps", 0.1}}},
      {"adam", {{"maximize", true}, {"betas", OptionValue(0.8, 0.9)}}},
      {"adam", {{"decoupled_weight_decay", true}, {"weight_decay", 0.2}, {"lr", 0.05}}},
      {"adamw", {}},
      {"adamw", {{"amsgrad", true}, {"weight_decay", 0.3}, {"lr", 0.05}, {"eps", 0.05}}},
      {"adamax", {}},
      {"adamax", {{"weight_decay", 0.1}, {"eps", 0.1}, {"maximize", true}}},
      {"adadelta", {}},
      {"adadelta", {{"rho", 0.5}, {"eps", 0.01}, {"weight_decay", 0.1}, {"maximize", true}}},
      {"adagrad", {}},
      {"adagrad", {{"lr_decay", 0.1}, {"initial_accumulator_value", 0.5}, {"eps", 0.1}, {"weight_decay", 0.1},
                   {"maximize", true}}},
      {"rmsprop", {}},
      {"rmsprop", {{"centered", true}}},
      {"rmsprop", {{"centered", true}, {"momentum", 0.5}, {"eps", 0.1}, {"weight_decay", 0.1}, {"alpha", 0.9}}},
      {"rmsprop", {{"momentum", 0.9}, {"maximize", true}}},
      {"nadam", {}},
      {"nadam", {{"weight_decay", 0.1}, {"momentum_decay", 0.01}, {"eps", 0.1}}},
      {"nadam", {{"decoupled_weight_decay", true}, {"weight_decay", 0.2}, {"maximize", true}}},
      {"radam", {}},
      {"radam", {{"betas", OptionValue(0.9, 0.99)}, {"weight_decay", 0.1}, {"eps", 0.1}}},
      {"radam", {{"decoupled_weight_decay", true}, {"weight_decay", 0.1}, {"maximize", true}}},
      {"rprop", {}},
      {"rprop", {{"etas", OptionValue(0.3, 1.5)}, {"step_sizes", OptionValue(1e-3, 0.05)}, {"maximize", true}}},
      {"asgd", {}},
      {"asgd", {{"t0", 3.0}, {"lambd", 0.01}, {"alpha", 0.5}, {"weight_decay", 0.1}, {"maximize", true}}},
      {"lion", {}},
      {"lion", {{"lr", 0.01}, {"weight_decay", 0.1}, {"betas", OptionValue(0.8, 0.95)}, {"maximize", true}}},
  };
}

std::string case_name(const RefCase& c) {
  std::string s = c.rule;
  for (const auto& [k, v] : c.options) s += " " + k + "=" + v.to_string();
  return s;
}

TEST(Rules, MatchDoublePrecisionReference) {
  for (const RefCase& c : reference_cases()) {
    SCOPED_TRACE(case_name(c));
    const std::size_t n = 33;
    const auto init = random_vector(n, 7, 1.0f, false);
    Tensor1 t(init);
    Optimizer opt(c.rule, std::vector<Param>{t.param()}, c.options);
    std::vector<double> ref(init.begin(), init.end());
    reference::State state;
    const OptionMap resolved = opt.group(0).options;
    for (int k = 0; k < 12; ++k) {
      const auto g = random_vector(n, 100 + k, k % 3 == 2 ? 0.1f : 1.0f);
      std::copy(g.begin(), g.end(), t.g());
      opt.param(0).has_grad = true;
      opt.step();
      reference::step(c.rule, resolved, ref, std::vector<double>(g.begin(), g.end()), state);
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_NEAR(t.data()[i], ref[i], 1e-5 + 1e-4 * std::fabs(ref[i])) << "step " << k + 1 << " element " << i;
    }
    // The state the reference keeps is the state torch keeps.
    for (const auto& [key, values] : state.tensors) {
      const StateLayout l = opt.rule().layout(resolved);
      if (std::find(l.tensors.begin(), l.tensors.end(), key) == l.tensors.end()) continue;
      const auto ours = opt.state_tensor(0, key);
      for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(ours[i], values[i], 1e-5 + 1e-4 * std::fabs(values[i])) << key;
    }
  }
}

TEST(Rules, DefaultsAreTorchs) {
  // torch.optim defaults (lion: the paper's reference code).
  const std::vector<std::tuple<std::string, std::string, OptionValue>> torch = {
      {"sgd", "momentum", 0.0},        {"adam", "lr", 1e-3},          {"adam", "betas", OptionValue(0.9, 0.999)},
      {"adam", "eps", 1e-8},           {"adam", "weight_decay", 0.0}, {"adamw", "weight_decay", 1e-2},
      {"adamax", "lr", 2e-3},          {"adadelta", "lr", 1.0},       {"adadelta", "rho", 0.9},
      {"adadelta", "eps", 1e-6},       {"adagrad", "lr", 1e-2},       {"adagrad", "eps", 1e-10},
      {"rmsprop", "lr", 1e-2},         {"rmsprop", "alpha", 0.99},    {"nadam", "lr", 2e-3},
      {"nadam", "momentum_decay", 4e-3}, {"radam", "lr", 1e-3},       {"rprop", "etas", OptionValue(0.5, 1.2)},
      {"rprop", "step_sizes", OptionValue(1e-6, 50.0)}, {"asgd", "lambd", 1e-4}, {"asgd", "alpha", 0.75},
      {"asgd", "t0", 1e6},             {"lion", "lr", 1e-4},          {"lion", "betas", OptionValue(0.9, 0.99)},
  };
  for (const auto& [rule, option, value] : torch)
    EXPECT_EQ(option_spec(rule_or_throw(rule), option).default_value, value) << rule << "." << option;
}

TEST(Options, TriplesAndWordsAreValuesLikeTheOthers) {
  // Muon's ns_coefficients and adjust_lr_fn are of these kinds.
  constexpr OptionValue coefficients(3.4445, -4.775, 2.0315), fn("match_rms_adamw");
  static_assert(coefficients.kind() == OptionValue::Kind::triple);
  EXPECT_EQ(coefficients.triple()[1], -4.775);
  EXPECT_EQ(coefficients.to_string(), "(3.4445000000000001, -4.7750000000000004, 2.0314999999999999)");
  EXPECT_EQ(fn.kind(), OptionValue::Kind::word);
  EXPECT_EQ(fn.word(), "match_rms_adamw");
  EXPECT_EQ(fn, OptionValue(std::string("match_rms_adamw")));
  EXPECT_NE(fn, OptionValue("original"));
  EXPECT_EQ(OptionValue("x").kind(), OptionValue::Kind::word);  // not a flag from the pointer
  EXPECT_FALSE(OptionValue::word_fits(std::string(40, 'a')));
  EXPECT_THROW((void)fn.number(), PreconditionError);
  EXPECT_EQ(name_of(OptionValue::Kind::triple), "three numbers");
}

TEST(Registry, EveryRuleDeclaresItsLocalityAndIsFindable) {
  EXPECT_EQ(all_rules().size(), 18u);
  for (const RuleInfo* r : all_rules()) {
    const bool stats = r->name == "lars" || r->name == "lamb" || r->name == "adafactor";
    const bool whole = r->name == "muon" || r->name == "shampoo" || r->name == "adagrad_full";
    EXPECT_EQ(r->locality, stats ? Locality::tensor_stats : whole ? Locality::whole_tensor : Locality::pointwise)
        << r->name;
    EXPECT_EQ(r->stat_passes > 0, stats || whole) << r->name;
    EXPECT_EQ(r->whole != nullptr, whole) << r->name;
    EXPECT_EQ(find_rule(r->name), r);
  }
  EXPECT_EQ(find_rule("kfac"), nullptr);
}


// Runs `steps` steps of `rule` over a tensor of n elements placed `offset`
// floats past an aligned start, with a pool of `threads` and work chunks of
// `chunk` elements; returns the parameters.
std::vector<float> run_rule(const RuleInfo& rule, std::size_t n, std::size_t offset, int threads, std::size_t chunk,
                            int steps = 3) {
  Tensor1 t(random_vector(n, 3), offset);
  ThreadPool pool(threads);
  OptimizerConfig cfg;
  cfg.pool = &pool;
  cfg.chunk_elements = chunk;
  OptionMap options;
  if (rule.name == "sgd") options = {{"lr", 0.1}, {"momentum", 0.9}};
  Optimizer opt(rule.name, std::vector<Param>{t.param()}, options, cfg);
  for (int k = 0; k < steps; ++k) {
    const auto g = random_vector(n, 50 + k);
    std::copy(g.begin(), g.end(), t.g());
    opt.param(0).has_grad = true;
    opt.step();
  }
  return {t.data(), t.data() + n};
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

TEST(Rules, SlicingThreadingAndAlignmentDoNotChangeBits) {
  for (const RuleInfo* rule : all_rules()) {
    if (rule->locality == Locality::whole_tensor) continue;  // shape limits: their own tests
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, (std::size_t{1} << 20) + 3}) {
      SCOPED_TRACE(std::string(rule->name) + " n=" + std::to_string(n));
      const auto whole = run_rule(*rule, n, 0, 1, 1u << 30);
      EXPECT_TRUE(bitwise_equal(whole, run_rule(*rule, n, 0, 3, 1000))) << "threaded, chunks of 1000";
      EXPECT_TRUE(bitwise_equal(whole, run_rule(*rule, n, 1, 1, 1u << 30))) << "start misaligned by 4 bytes";
      EXPECT_TRUE(bitwise_equal(whole, run_rule(*rule, n, 3, 2, 777))) << "misaligned and threaded";
    }
  }
}

template <class T>
void check_low_precision_master_weights(DType dtype) {
  const std::size_t n = 1000;
  for (const RuleInfo* rule : all_rules()) {
    if (rule->locality == Locality::whole_tensor) continue;  // shape limits: their own tests
    SCOPED_TRACE(std::string(rule->name) + " " + std::string(name_of(dtype)));
    // Low-precision parameter and gradient...
    std::vector<T> value(n), grad(n);
    const auto init = random_vector(n, 9);
    for (std::size_t i = 0; i < n; ++i) value[i] = from_float<T>(init[i]);
    Param lp;
    lp.value = {value.data(), dtype, {static_cast<std::int64_t>(n)}};
    lp.grad = {grad.data(), dtype, {static_cast<std::int64_t>(n)}};
    // ... and an fp32 run over exactly the widened values.
    std::vector<float> widened(n);
    for (std::size_t i = 0; i < n; ++i) widened[i] = to_float(value[i]);
    Tensor1 f(widened);
    OptionMap options;
    if (rule->name == "sgd") options = {{"lr", 0.1}, {"momentum", 0.9}};
    Optimizer a(rule->name, std::vector<Param>{lp}, options);
    Optimizer b(rule->name, std::vector<Param>{f.param()}, options);
    for (int k = 0; k < 4; ++k) {
      const auto g = random_vector(n, 70 + k);
      for (std::size_t i = 0; i < n; ++i) {
        grad[i] = from_float<T>(g[i]);
        f.g()[i] = to_float(grad[i]);
      }
      a.param(0).has_grad = b.param(0).has_grad = true;
      a.step();
      b.step();
    }
    const auto master = a.state_tensor(0, "master_param");
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(&master[i], &f.data()[i], 4), 0) << "master weight " << i;
      ASSERT_EQ(std::memcmp(&value[i], &static_cast<const T&>(from_float<T>(master[i])), 2), 0) << "rounded param " << i;
    }
  }
}

TEST(Rules, Bf16ParamsKeepFp32MasterWeights) { check_low_precision_master_weights<bf16>(DType::bf16); }
TEST(Rules, F16ParamsKeepFp32MasterWeights) { check_low_precision_master_weights<f16>(DType::f16); }

TEST(Optimizer, StateDictRoundTripIsBitwise) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const RuleInfo* rule : all_rules()) {
      if (rule->locality == Locality::whole_tensor) continue;  // shape limits: their own tests
      SCOPED_TRACE(std::string(rule->name) + " " + std::string(name_of(dtype)));
      const std::size_t n = 257;
      // Two runs over identical storage: one straight through, one stopped,
      // saved, reloaded into a fresh optimizer and continued.
      std::vector<float> init = random_vector(n, 5);
      std::vector<std::vector<std::uint16_t>> lp(2, std::vector<std::uint16_t>(n)), lpg(2, std::vector<std::uint16_t>(n));
      std::vector<std::vector<float>> fp(2, init), fpg(2, std::vector<float>(n));
      auto make_param = [&](int run) {
        Param p;
        if (dtype == DType::f32) {
          p.value = {fp[run].data(), dtype, {static_cast<std::int64_t>(n)}};
          p.grad = {fpg[run].data(), dtype, {static_cast<std::int64_t>(n)}};
        } else {
          for (std::size_t i = 0; i < n; ++i) lp[run][i] = float_to_bf16_bits(init[i]);
          p.value = {lp[run].data(), dtype, {static_cast<std::int64_t>(n)}};
          p.grad = {lpg[run].data(), dtype, {static_cast<std::int64_t>(n)}};
        }
        return p;
      };
      OptionMap options{{"lr", 0.01}};
      if (rule->name == "adafactor") options["relative_step"] = false;  // lr given
      ParamGroupSpec g0{{make_param(0)}, {}}, g1{{make_param(1)}, {}};
      Optimizer straight(rule->name, std::vector<ParamGroupSpec>{g0}, options);
      auto feed = [&](Optimizer& o, int run, int k) {
        const auto g = random_vector(n, 200 + k);
        for (std::size_t i = 0; i < n; ++i) {
          fpg[run][i] = g[i];
          lpg[run][i] = float_to_bf16_bits(g[i]);
        }
        o.param(0).has_grad = true;
        o.step();
      };
      auto first = std::make_unique<Optimizer>(rule->name, std::vector<ParamGroupSpec>{g1}, options);
      for (int k = 0; k < 5; ++k) {
        feed(straight, 0, k);
        feed(*first, 1, k);
      }
      const StateDict saved = first->state_dict();
      first.reset();
      OptionMap other{{"lr", 0.5}};
      if (rule->name == "adafactor") other["relative_step"] = false;
      Optimizer resumed(rule->name, std::vector<ParamGroupSpec>{ParamGroupSpec{{make_param(1)}, {}}}, other);
      // make_param re-initialised run 1's bf16 storage; restore the values it had.
      if (dtype != DType::f32)
        for (std::size_t i = 0; i < n; ++i)
          lp[1][i] = float_to_bf16_bits(std::get<StateTensor>(saved.state.at(0).at("master_param")).data[i]);
      resumed.load_state_dict(saved);
      EXPECT_EQ(resumed.lr(0), 0.01);  // options come from the dict
      for (int k = 5; k < 10; ++k) {
        feed(straight, 0, k);
        feed(resumed, 1, k);
      }
      if (dtype == DType::f32) EXPECT_TRUE(bitwise_equal(fp[0], fp[1]));
      else EXPECT_EQ(lp[0], lp[1]);
      const StateDict a = straight.state_dict(), b = resumed.state_dict();
      ASSERT_EQ(a.state.size(), b.state.size());
      for (const auto& [key, value] : a.state.at(0)) {
        if (std::holds_alternative<double>(value)) EXPECT_EQ(std::get<double>(value), std::get<double>(b.state.at(0).at(key))) << key;
        else EXPECT_EQ(std::get<StateTensor>(value).data, std::get<StateTensor>(b.state.at(0).at(key)).data) << key;
      }
    }
  }
}

TEST(Optimizer, AdafactorsFactoredStateRoundTripsWithTorchsShapes) {
  // A 3 x 4 x 5 tensor: exp_avg_sq_row [3, 4], exp_avg_sq_col [3, 5], no
  // exp_avg_sq; saved, reloaded and continued bit for bit.
  const Shape shape{3, 4, 5};
  std::vector<float> a = random_vector(60, 8), b = a, ga(60), gb(60);
  auto param = [&](std::vector<float>& v, std::vector<float>& g) {
    return Param{"w", {v.data(), DType::f32, shape}, {g.data(), DType::f32, shape}, true};
  };
  auto feed = [&](Optimizer& o, std::vector<float>& g, int k) {
    const std::vector<float> v = random_vector(60, 300 + k);
    std::copy(v.begin(), v.end(), g.begin());  // in place: the gradient view points into g
    o.param(0).has_grad = true;
    o.step();
  };
  Optimizer straight("adafactor", std::vector<Param>{param(a, ga)}, OptionMap{{"beta1", 0.9}});
  auto first = std::make_unique<Optimizer>("adafactor", std::vector<Param>{param(b, gb)}, OptionMap{{"beta1", 0.9}});
  for (int k = 0; k < 4; ++k) {
    feed(straight, ga, k);
    feed(*first, gb, k);
  }
  const StateDict saved = first->state_dict();
  first.reset();
  const auto& entry = saved.state.at(0);
  EXPECT_EQ(std::get<StateTensor>(entry.at("exp_avg_sq_row")).shape, (Shape{3, 4}));
  EXPECT_EQ(std::get<StateTensor>(entry.at("exp_avg_sq_col")).shape, (Shape{3, 5}));
  EXPECT_EQ(entry.count("exp_avg_sq"), 0u);
  EXPECT_EQ(std::get<StateTensor>(entry.at("exp_avg")).data.size(), 60u);
  Optimizer resumed("adafactor", std::vector<Param>{param(b, gb)}, OptionMap{{"beta1", 0.9}});
  resumed.load_state_dict(saved);
  for (int k = 4; k < 8; ++k) {
    feed(straight, ga, k);
    feed(resumed, gb, k);
  }
  EXPECT_TRUE(bitwise_equal(a, b));
  // A row vector of the wrong size is refused before anything changes.
  StateDict bad = saved;
  std::get<StateTensor>(bad.state.at(0).at("exp_avg_sq_row")).data.resize(11);
  EXPECT_THROW(resumed.load_state_dict(bad), InvalidInput);
}

TEST(WholeTensorRules, ThreadsStateDictAndMasterWeightsOnMatrices) {
  // What the all-rules tests above check on 1-D tensors, on 2-D ones, for
  // every whole_tensor rule (the state dict carries Shampoo's and full-matrix
  // Adagrad's matrices; their refresh every second step must survive it).
  const std::vector<std::pair<std::string, OptionMap>> cases = {
      {"muon", {{"lr", 0.02}}},
      {"shampoo", {{"lr", 0.05}, {"momentum", 0.5}, {"update_freq", 2}}},
      {"adagrad_full", {{"block_size", 100}, {"update_freq", 2}}},  // 9 blocks and a tail of 60
  };
  std::size_t whole_tensor_rules = 0;
  for (const RuleInfo* r : all_rules()) whole_tensor_rules += r->locality == Locality::whole_tensor;
  ASSERT_EQ(cases.size(), whole_tensor_rules) << "a whole_tensor rule without a case here";
  const Shape shape{24, 40};
  for (const auto& [name, options] : cases) {
    SCOPED_TRACE(name);
    auto run = [&](ThreadPool* pool, DType dtype, bool resume) {
      std::vector<float> w = random_vector(960, 4), g(960);
      std::vector<std::uint16_t> lw(960), lg(960);
      Param p{"w", {w.data(), DType::f32, shape}, {g.data(), DType::f32, shape}, true};
      if (dtype == DType::bf16) {
        for (std::size_t i = 0; i < 960; ++i) lw[i] = float_to_bf16_bits(w[i]);
        p.value = {lw.data(), dtype, shape};
        p.grad = {lg.data(), dtype, shape};
      }
      OptimizerConfig cfg;
      cfg.pool = pool;
      cfg.chunk_elements = 64;
      auto opt = std::make_unique<Optimizer>(name, std::vector<Param>{p}, options, cfg);
      for (int k = 0; k < 6; ++k) {
        const auto v = random_vector(960, 50 + k);
        for (std::size_t i = 0; i < 960; ++i) {
          g[i] = v[i];
          lg[i] = float_to_bf16_bits(v[i]);
        }
        if (resume && k == 3) {
          const StateDict d = opt->state_dict();
          opt = std::make_unique<Optimizer>(name, std::vector<Param>{p}, OptionMap{{"lr", 0.5}}, cfg);
          opt->load_state_dict(d);
        }
        opt->param(0).has_grad = true;
        opt->step();
      }
      std::vector<float> out(960);
      for (std::size_t i = 0; i < 960; ++i) out[i] = dtype == DType::f32 ? w[i] : bf16_bits_to_float(lw[i]);
      return out;
    };
    ThreadPool pool(3);
    const std::vector<float> plain = run(nullptr, DType::f32, false);
    EXPECT_TRUE(bitwise_equal(run(&pool, DType::f32, false), plain));
    EXPECT_TRUE(bitwise_equal(run(nullptr, DType::f32, true), plain));
    // bf16 parameters step fp32 master weights: close to the fp32 run.
    const std::vector<float> low = run(nullptr, DType::bf16, false);
    double worst = 0;
    for (std::size_t i = 0; i < 960; ++i) worst = std::max(worst, std::abs(double(low[i]) - plain[i]));
    EXPECT_LT(worst, 2e-2);
    EXPECT_GT(worst, 0.0);
  }
}

TEST(Optimizer, ParamWithoutGradIsSkippedLikeTorch) {
  Tensor1 a(random_vector(8, 1)), b(random_vector(8, 2));
  const std::vector<float> b_before(b.data(), b.data() + 8);
  Optimizer opt("adam", std::vector<Param>{a.param(), b.param()}, {{"weight_decay", 0.1}});
  for (int k = 0; k < 3; ++k) {
    opt.param(0).has_grad = true;
    opt.param(1).has_grad = false;
    std::fill_n(a.g(), 8, 0.5f);
    opt.step();
  }
  EXPECT_EQ(opt.state_scalar(0, "step"), 3.0);
  EXPECT_FALSE(opt.has_state(1));
  EXPECT_TRUE(bitwise_equal(b_before, std::vector<float>(b.data(), b.data() + 8)));  // no decay either
  opt.param(1).has_grad = true;
  std::fill_n(b.g(), 8, 0.0f);  // a zero gradient does take a step
  opt.step();
  EXPECT_EQ(opt.state_scalar(1, "step"), 1.0);
  EXPECT_EQ(opt.state_scalar(0, "step"), 4.0);
  EXPECT_FALSE(bitwise_equal(b_before, std::vector<float>(b.data(), b.data() + 8)));
  EXPECT_EQ(opt.state_dict().state.size(), 2u);
}

TEST(Optimizer, AdagradStateExistsBeforeTheFirstStep) {
  Tensor1 a(random_vector(4, 1));
  Optimizer opt("adagrad", std::vector<Param>{a.param()}, {{"initial_accumulator_value", 0.25}});
  ASSERT_TRUE(opt.has_state(0));
  EXPECT_EQ(opt.state_tensor(0, "sum")[3], 0.25f);
  EXPECT_EQ(opt.state_scalar(0, "step"), 0.0);
}

// torch's load_state_dict forgets a parameter the dict has no entry for:
// reset_state gives the same next step as a new optimizer, in the memory the
// state already had (views handed to Python stay valid).
TEST(Optimizer, ResetStateStartsTheParameterAfreshInItsOwnMemory) {
  for (const auto& [rule, options] : std::vector<std::pair<std::string, OptionMap>>{
           {"adam", {{"amsgrad", true}}}, {"adagrad", {{"initial_accumulator_value", 0.25}}},
           {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.5}}}, {"adafactor", {}}, {"lamb", {}}}) {
    SCOPED_TRACE(rule);
    Tensor1 a(random_vector(12, 1));
    Optimizer opt(rule, std::vector<Param>{a.param()}, options);
    for (int k = 0; k < 3; ++k) {
      std::copy_n(random_vector(12, 10 + k).data(), 12, a.g());
      opt.param(0).has_grad = true;
      opt.step();
    }
    const auto before = opt.state_views(0);
    opt.reset_state(0);
    EXPECT_EQ(opt.has_state(0), rule == "adagrad");  // eager state starts afresh at once
    Tensor1 b(std::vector<float>(a.data(), a.data() + 12));
    Optimizer fresh(rule, std::vector<Param>{b.param()}, options);
    const auto g = random_vector(12, 20);
    std::copy_n(g.data(), 12, a.g());
    std::copy_n(g.data(), 12, b.g());
    opt.param(0).has_grad = fresh.param(0).has_grad = true;
    opt.step();
    fresh.step();
    EXPECT_TRUE(bitwise_equal(std::vector<float>(a.data(), a.data() + 12), std::vector<float>(b.data(), b.data() + 12)));
    const auto after = opt.state_views(0);
    ASSERT_EQ(after.size(), before.size());
    for (std::size_t k = 0; k < after.size(); ++k) {
      EXPECT_EQ(after[k].data, before[k].data) << after[k].key;
      const auto n = static_cast<std::size_t>(numel(after[k].shape));
      const auto* expected = fresh.state_views(0)[k].data;
      EXPECT_TRUE(bitwise_equal(std::vector<float>(after[k].data, after[k].data + n),
                                std::vector<float>(expected, expected + n)))
          << after[k].key;
    }
  }
}

TEST(Optimizer, GroupsOptionsAndSchedulerStyleChanges) {
  Tensor1 a(random_vector(4, 1)), b(random_vector(4, 2)), c(random_vector(4, 3));
  Optimizer opt("sgd", std::vector<ParamGroupSpec>{{{a.param(), b.param()}, {}}, {{c.param()}, {{"lr", 0.5}}}},
                {{"lr", 0.1}, {"momentum", 0.9}});
  EXPECT_EQ(opt.num_groups(), 2u);
  EXPECT_EQ(opt.lr(0), 0.1);
  EXPECT_EQ(opt.lr(1), 0.5);
  EXPECT_EQ(opt.group(1).options.at("momentum").number(), 0.9);  // defaults fill the rest
  Tensor1 t4(random_vector(2, 9));
  opt.add_param_group({{t4.param()}, {{"momentum", 0.0}}});
  EXPECT_EQ(opt.num_groups(), 3u);
  EXPECT_EQ(opt.group(2).params, std::vector<std::size_t>{3});
  // A changed lr is used by the next step.
  std::fill_n(c.g(), 4, 1.0f);
  const float before = c.data()[0];
  opt.set_lr(1, 0.25);
  opt.param(2).has_grad = true;
  opt.step();
  EXPECT_FLOAT_EQ(c.data()[0], before - 0.25f);
  const StateDict d = opt.state_dict();
  ASSERT_EQ(d.param_groups.size(), 3u);
  EXPECT_EQ(d.param_groups[0].params, (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(d.param_groups[1].options.at("lr").number(), 0.25);
  EXPECT_EQ(d.state.count(2), 1u);
  EXPECT_EQ(d.state.count(0), 0u);
}

TEST(Optimizer, TogglingAmsgradLaterCreatesTheMissingState) {
  Tensor1 a(random_vector(16, 1));
  Optimizer opt("adam", std::vector<Param>{a.param()});
  opt.param(0).has_grad = true;
  opt.step();
  EXPECT_THROW(opt.state_tensor(0, "max_exp_avg_sq"), InvalidInput);
  opt.set_option(0, "amsgrad", true);
  opt.step();
  EXPECT_EQ(opt.state_scalar(0, "step"), 2.0);
  EXPECT_EQ(opt.state_tensor(0, "max_exp_avg_sq").size(), 16u);
}

TEST(Optimizer, ZeroGrad) {
  Tensor1 a(random_vector(4, 1));
  Optimizer opt("sgd", std::vector<Param>{a.param()}, {{"lr", 0.1}});
  opt.param(0).has_grad = true;
  std::fill_n(a.g(), 4, 3.0f);
  opt.zero_grad(false);
  EXPECT_TRUE(opt.param(0).has_grad);
  EXPECT_EQ(a.g()[2], 0.0f);
  opt.zero_grad();
  EXPECT_FALSE(opt.param(0).has_grad);
}

TEST(Optimizer, SteadyStateStepAllocatesNothing) {
  for (const RuleInfo* rule : all_rules()) {
    if (rule->locality == Locality::whole_tensor) continue;  // shape limits: their own tests
    std::vector<Tensor1> ts;
    ts.reserve(20);
    std::vector<Param> params;
    for (int i = 0; i < 20; ++i) {
      ts.emplace_back(random_vector(5000, i));
      params.push_back(ts.back().param());
      params.back().has_grad = true;
    }
    ThreadPool pool(2);
    OptimizerConfig cfg;
    cfg.pool = &pool;
    cfg.chunk_elements = 1024;
    OptionMap options;
    if (rule->name == "sgd") options = {{"lr", 0.1}, {"momentum", 0.9}};
    Optimizer opt(rule->name, params, options, cfg);
    opt.step();  // creates state
    const long before = g_news.load();
    for (int k = 0; k < 5; ++k) opt.step();
    EXPECT_EQ(g_news.load() - before, 0) << rule->name;
  }
}

// --- bad input: clear errors, nothing changed ----------------------------

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidInput& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(BadInput, WrongGradientSizeLeavesEveryParameterUntouched) {
  Tensor1 a(random_vector(8, 1)), b(random_vector(8, 2));
  Optimizer opt("adam", std::vector<Param>{a.param(), b.param()});
  opt.param(0).has_grad = opt.param(1).has_grad = true;
  opt.param(1).grad.shape = {7};
  const std::vector<float> a0(a.data(), a.data() + 8);
  const std::string e = error_of([&] { opt.step(); });
  EXPECT_NE(e.find("gradient of parameter 1 has 7 elements"), std::string::npos) << e;
  EXPECT_TRUE(bitwise_equal(a0, std::vector<float>(a.data(), a.data() + 8)));
  EXPECT_FALSE(opt.has_state(0));
  opt.param(1).grad.shape = {8};
  opt.param(1).grad.dtype = DType::bf16;
  EXPECT_NE(error_of([&] { opt.step(); }).find("is bf16, the parameter is f32"), std::string::npos);
}

TEST(BadInput, OptionsAreCheckedLikeTorch) {
  Tensor1 a(random_vector(4, 1));
  auto make = [&](const std::string& rule, OptionMap o) {
    return error_of([&] { Optimizer(rule, std::vector<Param>{a.param()}, o); });
  };
  EXPECT_EQ(make("adam", {{"lr", -1.0}}), "Invalid learning rate: -1");
  EXPECT_EQ(make("adam", {{"betas", OptionValue(1.0, 0.999)}}), "Invalid beta parameter at index 0: 1");
  EXPECT_EQ(make("adamw", {{"betas", OptionValue(0.9, -0.1)}}), "Invalid beta parameter at index 1: -0.1");
  EXPECT_EQ(make("adam", {{"eps", -1e-8}}), "Invalid epsilon value: -1e-08");
  EXPECT_EQ(make("sgd", {{"weight_decay", -0.1}}), "Invalid weight_decay value: -0.1");
  EXPECT_EQ(make("sgd", {{"nesterov", true}}), "Nesterov momentum requires a momentum and zero dampening");
  EXPECT_EQ(make("rprop", {{"etas", OptionValue(1.5, 1.2)}}), "Invalid eta values: 1.5, 1.2");
  EXPECT_EQ(make("adadelta", {{"rho", 1.5}}), "Invalid rho value: 1.5");
  EXPECT_NE(make("adam", {{"betaz", 0.9}}).find("unknown option 'betaz' for optimizer adam (known: lr, betas"),
            std::string::npos);
  EXPECT_EQ(make("adam", {{"amsgrad", 1.0}}), "option 'amsgrad' of optimizer adam must be a boolean, got 1");
  EXPECT_NE(make("adamm", {}).find("unknown optimizer 'adamm' (known: sgd, adam"), std::string::npos);
  EXPECT_EQ(error_of([&] { Optimizer("sgd", std::vector<Param>{}); }), "optimizer got an empty parameter list");
  EXPECT_NE(error_of([&] { Optimizer("sgd", std::vector<Param>{a.param(), a.param()}); }).find("more than one"),
            std::string::npos);
}

TEST(BadInput, RejectedSetOptionKeepsTheOldValue) {
  Tensor1 a(random_vector(4, 1));
  Optimizer opt("adam", std::vector<Param>{a.param()});
  EXPECT_EQ(error_of([&] { opt.set_option(0, "lr", -0.5); }), "Invalid learning rate: -0.5");
  EXPECT_EQ(opt.lr(0), 1e-3);
}

TEST(BadInput, MismatchedStateDictIsRejectedBeforeAnyChange) {
  Tensor1 a(random_vector(4, 1)), b(random_vector(4, 2));
  Optimizer opt("adam", std::vector<Param>{a.param()});
  opt.param(0).has_grad = true;
  opt.step();
  StateDict d = opt.state_dict();
  Optimizer two("adam", std::vector<Param>{a.param(), b.param()});
  EXPECT_NE(error_of([&] { two.load_state_dict(d); }).find("doesn't match the size of optimizer's group"),
            std::string::npos);
  d.param_groups[0].options["amsgrad"] = true;  // layout now needs max_exp_avg_sq
  Optimizer fresh("adam", std::vector<Param>{a.param()});
  EXPECT_NE(error_of([&] { fresh.load_state_dict(d); }).find("lacks 'max_exp_avg_sq'"), std::string::npos);
  EXPECT_FALSE(fresh.group(0).options.at("amsgrad").flag());
  EXPECT_FALSE(fresh.has_state(0));
}

TEST(BadInput, LambsOptimizerLevelOptionsAreNotGroupOptions) {
  // apex reads max_grad_norm (and the modes) from the optimizer, not from a
  // group: a group that sets one is an error, not silently ignored.
  Tensor1 a(random_vector(8, 1)), b(random_vector(8, 2));
  std::vector<ParamGroupSpec> groups(2);
  groups[0].params = {a.param()};
  groups[1].params = {b.param()};
  groups[1].options = {{"max_grad_norm", 0.5}};
  EXPECT_NE(error_of([&] { Optimizer("lamb", groups); }).find(
                "max_grad_norm is an option of the whole lamb optimizer, not of a parameter group"),
            std::string::npos);
  groups[1].options = {{"weight_decay", 0.0}};
  Optimizer opt("lamb", groups, OptionMap{{"max_grad_norm", 0.5}});
  EXPECT_NE(error_of([&] { opt.set_option(0, "use_nvlamb", true); }).find("use_nvlamb is an option of the whole"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Optimizer("lamb", std::vector<Param>{a.param()}, OptionMap{{"max_grad_norm", -1.0}}); }).find("Invalid max_grad_norm"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Optimizer("lars", std::vector<Param>{a.param()}, OptionMap{{"momentum", -0.5}}); }).find("Invalid momentum value"),
            std::string::npos);
  // Adafactor: transformers' own errors, and what transformers would only
  // fail on later.
  auto adafactor_error = [&](OptionMap o) {
    return error_of([&] { Optimizer("adafactor", std::vector<Param>{a.param()}, std::move(o)); });
  };
  EXPECT_NE(adafactor_error({{"lr", 0.01}}).find("Cannot combine manual `lr` and `relative_step=True` options"),
            std::string::npos);
  EXPECT_NE(adafactor_error({{"relative_step", false}, {"warmup_init", true}, {"lr", 0.01}})
                .find("`warmup_init=True` requires `relative_step=True`"),
            std::string::npos);
  EXPECT_NE(adafactor_error({{"relative_step", false}}).find("needs an lr when relative_step is false"),
            std::string::npos);
  EXPECT_NE(adafactor_error({{"clip_threshold", 0.0}}).find("Invalid clip_threshold"), std::string::npos);
  EXPECT_NE(adafactor_error({{"beta1", 1.0}}).find("Invalid beta1"), std::string::npos);
  // Muon: 2-D parameters only (torch's check, at construction), and its
  // words and step count.
  EXPECT_NE(error_of([&] { Optimizer("muon", std::vector<Param>{a.param()}); })
                .find("Muon only supports 2D parameters whereas we found a parameter with size: [8]"),
            std::string::npos);
  std::vector<float> m(12, 0.5f), mg(12, 0.1f);
  const Param matrix{"w", {m.data(), DType::f32, {3, 4}}, {mg.data(), DType::f32, {3, 4}}, true};
  auto muon_error = [&](OptionMap o) {
    return error_of([&] { Optimizer("muon", std::vector<Param>{matrix}, std::move(o)); });
  };
  EXPECT_NE(muon_error({{"adjust_lr_fn", "spectral"}}).find("Adjust learning rate function is not supported"),
            std::string::npos);
  EXPECT_NE(muon_error({{"ns_dtype", "float16"}}).find("ns_dtype must be float32 or bfloat16"), std::string::npos);
  EXPECT_NE(muon_error({{"ns_steps", 100}}).find("less than 100"), std::string::npos);
  EXPECT_NE(muon_error({{"ns_coefficients", 1.0}}).find("must be three numbers"), std::string::npos);
  EXPECT_EQ(muon_error({{"adjust_lr_fn", "match_rms_adamw"}}), "(no error)");
  // A rejected option leaves the group as it was.
  Optimizer ok("adafactor", std::vector<Param>{b.param()});
  EXPECT_NE(error_of([&] { ok.set_option(0, "lr", 0.1); }).find("Cannot combine"), std::string::npos);
  EXPECT_TRUE(std::isnan(ok.lr(0)));
}

TEST(Optimizer, AGroupMayHaveItsOwnRuleAsTwoTorchOptimizersWould) {
  // muon on a matrix and adamw on a vector in one Optimizer: the same bits
  // as two optimizers, one per rule (what torch users run).
  std::vector<float> w1 = random_vector(12, 1), v1 = random_vector(5, 2), w2 = w1, v2 = v1;
  std::vector<float> gw(12), gv(5);
  auto matrix = [&](std::vector<float>& w) {
    return Param{"w", {w.data(), DType::f32, {3, 4}}, {gw.data(), DType::f32, {3, 4}}, true};
  };
  auto vector = [&](std::vector<float>& v) {
    return Param{"b", {v.data(), DType::f32, {5}}, {gv.data(), DType::f32, {5}}, true};
  };
  std::vector<ParamGroupSpec> groups(2);
  groups[0].params = {matrix(w1)};
  groups[1].params = {vector(v1)};
  groups[1].rule = "adamw";
  groups[1].options = {{"lr", 0.01}};
  Optimizer both("muon", groups, OptionMap{{"lr", 0.02}});
  EXPECT_EQ(both.group(1).rule, "adamw");
  EXPECT_EQ(both.rule_of_group(1).name, "adamw");
  EXPECT_EQ(both.group(1).options.at("weight_decay").number(), 0.01);  // adamw's default, not muon's 0.1
  Optimizer muon("muon", std::vector<Param>{matrix(w2)}, OptionMap{{"lr", 0.02}});
  Optimizer adamw("adamw", std::vector<Param>{vector(v2)}, OptionMap{{"lr", 0.01}});
  for (int k = 0; k < 4; ++k) {
    const auto a = random_vector(12, 10 + k), b = random_vector(5, 20 + k);
    std::copy(a.begin(), a.end(), gw.begin());
    std::copy(b.begin(), b.end(), gv.begin());
    for (Optimizer* o : {&both, &muon, &adamw})
      for (std::size_t i = 0; i < o->num_params(); ++i) o->param(i).has_grad = true;
    both.step();
    muon.step();
    adamw.step();
  }
  EXPECT_TRUE(bitwise_equal(w1, w2));
  EXPECT_TRUE(bitwise_equal(v1, v2));
  // A saved group of another rule is refused.
  StateDict d = both.state_dict();
  EXPECT_EQ(d.param_groups[1].rule, "adamw");
  d.param_groups[1].rule = "sgd";
  EXPECT_NE(error_of([&] { both.load_state_dict(d); }).find("is for optimizer sgd, this group's is adamw"),
            std::string::npos);
}

// Optimizer options from one string, as a library user (or the Python
// front end) gives them: pairs and triples keep their commas.
TEST(OptionText, OneStringOfNamedValues) {
  const OptionMap adam = parse_options(rule_or_throw("adam"), "lr=0.1,betas=0.9,0.99,amsgrad=true,weight-decay=1e-2");
  ASSERT_EQ(adam.size(), 4u);
  EXPECT_EQ(adam.at("lr"), OptionValue(0.1));
  EXPECT_EQ(adam.at("betas"), OptionValue(0.9, 0.99));
  EXPECT_EQ(adam.at("amsgrad"), OptionValue(true));
  EXPECT_EQ(adam.at("weight_decay"), OptionValue(0.01));
  const OptionMap muon =
      parse_options(rule_or_throw("muon"), "ns_coefficients=3.4445,-4.775,2.0315,adjust_lr_fn=match_rms_adamw,lr=0.02");
  ASSERT_EQ(muon.size(), 3u);
  EXPECT_EQ(muon.at("ns_coefficients"), OptionValue(3.4445, -4.775, 2.0315));
  EXPECT_EQ(muon.at("adjust_lr_fn"), OptionValue("match_rms_adamw"));
  EXPECT_EQ(muon.at("lr"), OptionValue(0.02));
  EXPECT_TRUE(parse_options(rule_or_throw("sgd"), "").empty());
  // Flags: true/false, 1/0, or nothing after '=' for true.
  const OptionMap sgd = parse_options(rule_or_throw("sgd"), "nesterov=0,maximize=");
  EXPECT_EQ(sgd.at("nesterov"), OptionValue(false));
  EXPECT_EQ(sgd.at("maximize"), OptionValue(true));
  EXPECT_EQ(parse_options(rule_or_throw("adam"), "amsgrad=1").at("amsgrad"), OptionValue(true));
  EXPECT_EQ(parse_options(rule_or_throw("adam"), "amsgrad=false").at("amsgrad"), OptionValue(false));
}

TEST(OptionText, EveryMistakeIsOneLineNamingIt) {
  const std::tuple<const char*, const char*, const char*> cases[] = {
      {"adam", "lr", "optimizer options: 'lr' is not NAME=VALUE"},
      {"adam", "=0.1", "optimizer options: '=0.1' is not NAME=VALUE"},
      {"adam", "lr=0.1,lr=0.2", "optimizer options: lr is given twice"},
      {"adam", "weight-decay=0,weight_decay=1", "optimizer options: weight_decay is given twice"},
      {"adam", "momentum=0.9", "--momentum is not an option of optimizer adam"},
      {"adam", "lr=fast", "--lr: 'fast' is not a finite number"},
      {"adam", "lr=inf", "--lr: 'inf' is not a finite number"},
      {"adam", "lr=0.1,", "--lr: '0.1,' is not a finite number"},
      {"adam", "betas=0.9", "--betas: '0.9' is not a pair like 0.9,0.999"},
      {"adam", "betas=0.9,x", "--betas: 'x' is not a finite number"},
      {"adam", "amsgrad=maybe", "--amsgrad: 'maybe' is not true or false"},
      {"muon", "ns_coefficients=1,2", "--ns-coefficients: '1,2' is not three numbers like 3.4445,-4.775,2.0315"},
      {"muon", "ns_coefficients=1,2,3,4", "--ns-coefficients: '1,2,3,4' is not three numbers like"},
      {"muon", "adjust_lr_fn=", "--adjust-lr-fn: '' is not one of the option's words"},
  };
  for (const auto& [rule, text, expected] : cases) {
    try {
      (void)parse_options(rule_or_throw(rule), text);
      ADD_FAILURE() << text << " was accepted";
    } catch (const InvalidInput& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(expected), std::string::npos) << text << ": " << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  }
}

// The command line's form: one text per option, flags named with dashes.
TEST(OptionText, ValuesByNameAndNumbers) {
  const OptionMap o = parse_option_values(rule_or_throw("adamw"), {{"weight_decay", "0.5"}, {"betas", "0.8,0.9"}});
  EXPECT_EQ(o.at("weight_decay"), OptionValue(0.5));
  EXPECT_EQ(o.at("betas"), OptionValue(0.8, 0.9));
  EXPECT_EQ(parse_number("clip-norm-type", "-2.5e1"), -25.0);
  const auto message = [](auto fn) -> std::string {
    try {
      (void)fn();
    } catch (const InvalidInput& e) {
      return e.what();
    }
    return "(accepted)";
  };
  EXPECT_EQ(message([] { return parse_option_values(rule_or_throw("adamw"), {{"weight_decay", "x"}}); }),
            "--weight-decay: 'x' is not a finite number");
  EXPECT_EQ(message([] { return parse_number("clip-norm-type", "1e999"); }),
            "--clip-norm-type: '1e999' is not a finite number");
  EXPECT_EQ(message([] { return parse_number("clip-norm-type", "2 "); }), "--clip-norm-type: '2 ' is not a finite number");
  EXPECT_EQ(message([] { return parse_number("clip-norm-type", ""); }), "--clip-norm-type: '' is not a finite number");
}

}  // namespace
}  // namespace distopt
