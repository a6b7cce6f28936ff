// Dynamic loss scaling (GradScaler) against PyTorch's GradScaler
// (tests/golden/scaler, from scripts/gen_golden_scaler.py -- torch's Python
// logic with its two CUDA kernels emulated on the CPU, as the script says),
// and the found-inf reduction hook a sharded engine uses.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/optimizer.hpp"
#include "golden_json.hpp"

namespace distopt {
namespace {

using golden::json;

GradScalerOptions scaler_options(const json& o) {
  GradScalerOptions s;
  if (o.contains("init_scale")) s.init_scale = o["init_scale"].get<double>();
  if (o.contains("growth_factor")) s.growth_factor = o["growth_factor"].get<double>();
  if (o.contains("backoff_factor")) s.backoff_factor = o["backoff_factor"].get<double>();
  if (o.contains("growth_interval")) s.growth_interval = o["growth_interval"].get<std::int64_t>();
  if (o.contains("enabled")) s.enabled = o["enabled"].get<bool>();
  return s;
}

TEST(ScalerGolden, ScaleSequenceSkipsAndParamsMatchTorch) {
  const json doc = golden::load("scaler/grad_scaler.json");
  int cases = 0, skipped = 0, grown = 0;
  for (const json& c : doc["cases"]) {
    const std::string name = c["name"];
    std::vector<std::vector<float>> values, grads;
    std::vector<Param> params;
    for (std::size_t i = 0; i < c["shapes"].size(); ++i) {
      values.push_back(golden::floats(c["params"][i]));
      grads.emplace_back(values.back().size());
    }
    for (std::size_t i = 0; i < values.size(); ++i) {
      Shape shape;
      for (const json& d : c["shapes"][i]) shape.push_back(d.get<std::int64_t>());
      params.push_back(Param{"p" + std::to_string(i), {values[i].data(), DType::f32, shape},
                             {grads[i].data(), DType::f32, shape}, true});
    }
    OptionMap opt_options;
    for (const auto& [k, v] : c["optimizer"]["options"].items()) opt_options[k] = v.get<double>();
    Optimizer opt(c["optimizer"]["name"].get<std::string>(), params, opt_options);
    GradScaler scaler(scaler_options(c["scaler"]));
    double last_scale = scaler.get_scale();
    for (std::size_t k = 0; k < c["steps"].size(); ++k) {
      const json& s = c["steps"][k];
      (void)scaler.scale(1.0f);
      // What backward of the scaled loss writes: the raw gradient times the
      // float32 scale.
      const auto factor = static_cast<float>(scaler.get_scale());
      for (std::size_t i = 0; i < grads.size(); ++i) {
        const auto raw = golden::floats(s["grads"][i]);
        for (std::size_t e = 0; e < raw.size(); ++e) grads[i][e] = scaler.enabled() ? raw[e] * factor : raw[e];
        opt.param(i).has_grad = true;
      }
      if (s.contains("unscale_clip")) {
        scaler.unscale(opt);
        clip_grad_norm(opt, s["unscale_clip"].get<double>());
      }
      const bool stepped = scaler.step(opt);
      EXPECT_EQ(stepped, s["expected_stepped"].get<bool>()) << name << " step " << k;
      if (s.contains("new_scale"))
        scaler.update(s["new_scale"].get<double>());
      else
        scaler.update();
      // The scale is a float32, its tracker an int32: exact.
      EXPECT_EQ(scaler.get_scale(), s["expected_scale"].get<double>()) << name << " step " << k;
      EXPECT_EQ(scaler.growth_tracker(), s["expected_growth_tracker"].get<std::int64_t>()) << name << " step " << k;
      skipped += stepped ? 0 : 1;
      grown += scaler.get_scale() > last_scale ? 1 : 0;
      last_scale = scaler.get_scale();
      for (std::size_t i = 0; i < values.size(); ++i) {
        const auto want = golden::floats(s["expected_params"][i]);
        for (std::size_t e = 0; e < want.size(); ++e)
          // The optimizer's tolerance (replay's): atol 1e-6 + rtol 1e-5.
          ASSERT_LE(std::abs(values[i][e] - want[e]), 1e-6 + 1e-5 * std::abs(want[e]))
              << name << " step " << k << " param " << i << "[" << e << "]";
      }
    }
    const json& want = c["expected_state_dict"];
    const auto sd = scaler.state_dict();
    if (want.empty()) {
      EXPECT_FALSE(sd.has_value()) << name << ": a disabled scaler's state_dict is empty";
    } else {
      ASSERT_TRUE(sd.has_value()) << name;
      EXPECT_EQ(static_cast<float>(sd->scale), static_cast<float>(golden::num(want["scale"]))) << name;
      EXPECT_EQ(sd->growth_factor, want["growth_factor"].get<double>()) << name;
      EXPECT_EQ(sd->backoff_factor, want["backoff_factor"].get<double>()) << name;
      EXPECT_EQ(sd->growth_interval, want["growth_interval"].get<std::int64_t>()) << name;
      EXPECT_EQ(sd->growth_tracker, want["_growth_tracker"].get<std::int64_t>()) << name;
    }
    ++cases;
  }
  EXPECT_GE(cases, 8);
  EXPECT_GE(skipped, 10) << "the cases must exercise skipped steps";
  EXPECT_GE(grown, 10) << "the cases must exercise growth";
}

// Two ranks each hold half of the gradient; the inf is in rank 1's half
// only. With the found-inf hook both skip and both back off, and the scales
// stay equal.
TEST(Scaler, FoundInfHookMakesShardsAgree) {
  for (bool with_hook : {false, true}) {
    float pa[2] = {1, 2}, ga[2], pb[2] = {3, 4}, gb[2];
    Optimizer a("sgd", {Param{"a", {pa, DType::f32, {2}}, {ga, DType::f32, {2}}, true}}, {{"lr", 0.1}});
    Optimizer b("sgd", {Param{"b", {pb, DType::f32, {2}}, {gb, DType::f32, {2}}, true}}, {{"lr", 0.1}});
    GradScaler sa({.init_scale = 8.0}), sb({.init_scale = 8.0});
    (void)sa.scale(1.0f);
    (void)sb.scale(1.0f);
    ga[0] = ga[1] = 8.0f;
    gb[0] = std::numeric_limits<float>::infinity();
    gb[1] = 8.0f;
    // Rank-local flags, then the hook: max over the two ranks.
    const double flag_a = 0.0, flag_b = 1.0;
    StatReduce hook = [&](double& v, bool max) {
      EXPECT_TRUE(max);
      v = std::max(flag_a, flag_b);
    };
    const bool stepped_a = sa.step(a, with_hook ? hook : StatReduce{});
    const bool stepped_b = sb.step(b, with_hook ? hook : StatReduce{});
    sa.update();
    sb.update();
    EXPECT_FALSE(stepped_b);
    if (with_hook) {
      EXPECT_FALSE(stepped_a) << "the hook spreads rank 1's inf to rank 0";
      EXPECT_EQ(pa[0], 1.0f);
      EXPECT_EQ(sa.get_scale(), sb.get_scale());
      EXPECT_EQ(sa.get_scale(), 4.0);
    } else {
      EXPECT_TRUE(stepped_a) << "without it rank 0 steps alone";
      EXPECT_NE(sa.get_scale(), sb.get_scale());
    }
  }
}

TEST(Scaler, TorchsChecksAsOneLineErrors) {
  EXPECT_THROW(GradScaler({.growth_factor = 1.0}), InvalidInput);
  EXPECT_THROW(GradScaler({.backoff_factor = 1.0}), InvalidInput);
  EXPECT_THROW(GradScaler({.growth_interval = 0}), InvalidInput);
  float p[1] = {1}, g[1] = {1};
  Optimizer opt("sgd", {Param{"p", {p, DType::f32, {1}}, {g, DType::f32, {1}}, true}}, {{"lr", 0.1}});
  GradScaler s;
  EXPECT_THROW(s.step(opt), InvalidInput) << "step before the first scale()";
  EXPECT_THROW(s.update(), InvalidInput);
  (void)s.scale(1.0f);
  s.unscale(opt);
  try {
    s.unscale(opt);
    FAIL() << "second unscale_ must throw";
  } catch (const InvalidInput& e) {
    EXPECT_STREQ(e.what(), "unscale_() has already been called on this optimizer since the last update().");
  }
  EXPECT_TRUE(s.step(opt));
  EXPECT_THROW(s.step(opt), InvalidInput);
  EXPECT_THROW(s.unscale(opt), InvalidInput);
  s.update();
  EXPECT_NO_THROW(s.unscale(opt)) << "update() resets the stages";

  std::vector<f16> h(2);
  TensorView hv{h.data(), DType::f16, {2}};
  EXPECT_THROW(unscale_grads({&hv, 1}, 0.5f), InvalidInput);
  EXPECT_NO_THROW(unscale_grads({&hv, 1}, 0.5f, true));

  // load_state_dict checks before changing anything.
  GradScaler t;
  EXPECT_THROW(t.load_state_dict({.scale = 8, .growth_factor = 0.5}), InvalidInput);
  EXPECT_THROW(t.load_state_dict({.scale = -1}), InvalidInput);
  EXPECT_THROW(t.load_state_dict({.scale = 8, .growth_tracker = -1}), InvalidInput);
  EXPECT_THROW(t.load_state_dict({.scale = std::nan("")}), InvalidInput);
  EXPECT_EQ(t.get_scale(), 65536.0);
  // States torch saves and loads: a tracker past a lowered interval, a
  // scale backed off to 0.
  EXPECT_NO_THROW(t.load_state_dict({.scale = 8, .growth_interval = 4, .growth_tracker = 9}));
  EXPECT_NO_THROW(t.load_state_dict({.scale = 0}));

  // The setters refuse what the constructor refuses.
  EXPECT_THROW(t.set_growth_factor(0.5), InvalidInput);
  EXPECT_THROW(t.set_backoff_factor(1.5), InvalidInput);
  EXPECT_THROW(t.set_growth_interval(0), InvalidInput);

  // update() after scale() with no unscale_/step in between.
  GradScaler u;
  (void)u.scale(1.0f);
  try {
    u.update();
    FAIL() << "update without an inf check must throw";
  } catch (const InvalidInput& e) {
    EXPECT_STREQ(e.what(), "No inf checks were recorded prior to update.");
  }
}

TEST(Scaler, ScalesAbove2To126WorkWhileDenormalsAreFlushed) {
  // 2^127's float reciprocal, 2^-127, is denormal: flushed, it would zero
  // every gradient. The scaler computes as IEEE (and torch) does whatever
  // the caller's mode, and restores that mode.
  float p[1] = {1}, g[1] = {0};
  Optimizer opt("sgd", {Param{"p", {p, DType::f32, {1}}, {g, DType::f32, {1}}, true}}, {{"lr", 0.5}});
  const DenormalMode flushed(DenormalMode::flush);
#if defined(__SSE3__)
  const unsigned mode = _mm_getcsr();
#endif
  GradScaler s({.init_scale = 0x1p127, .growth_interval = 1});
  g[0] = s.scale(1.5f);  // the "backward" of loss 1.5 w.r.t. p
  EXPECT_EQ(g[0], 1.5f * 0x1p127f);
  EXPECT_TRUE(s.step(opt));
  EXPECT_EQ(g[0], 1.5f) << "unscaled by the denormal reciprocal, not by a flushed 0";
  EXPECT_EQ(p[0], 1.0f - 0.5f * 1.5f);
  s.update();
  EXPECT_EQ(s.get_scale(), 0x1p127) << "2^128 is inf in float32: the scale does not grow";
  // Backing off to a denormal scale keeps it, as torch does.
  GradScaler d({.init_scale = 0x1p-126, .backoff_factor = 0.5});
  (void)d.scale(1.0f);
  g[0] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(d.step(opt));
  d.update();
  EXPECT_EQ(d.get_scale(), 0x1p-127);
#if defined(__SSE3__)
  EXPECT_EQ(_mm_getcsr(), mode) << "the caller's mode is restored";
#endif
}

TEST(Scaler, StateDictRoundTripContinuesIdentically) {
  GradScalerOptions o{.init_scale = 100.0, .growth_factor = 1.5, .backoff_factor = 0.25, .growth_interval = 3};
  float p[1] = {1}, g[1] = {1};
  Optimizer opt("sgd", {Param{"p", {p, DType::f32, {1}}, {g, DType::f32, {1}}, true}}, {{"lr", 0.1}});
  auto run = [&](GradScaler& s, int k) {
    (void)s.scale(1.0f);
    g[0] = (k % 5 == 3) ? std::numeric_limits<float>::infinity() : 1.0f;
    s.step(opt);
    s.update();
  };
  GradScaler a(o);
  for (int k = 0; k < 7; ++k) run(a, k);
  GradScaler b;  // defaults, overwritten by the load
  b.load_state_dict(*a.state_dict());
  EXPECT_EQ(b.get_scale(), a.get_scale());
  EXPECT_EQ(b.growth_tracker(), a.growth_tracker());
  for (int k = 7; k < 20; ++k) {
    run(a, k);
    run(b, k);
    EXPECT_EQ(a.get_scale(), b.get_scale()) << k;
    EXPECT_EQ(a.growth_tracker(), b.growth_tracker()) << k;
  }
}

TEST(Scaler, UnscaleMultipliesByTheFloatReciprocalAndFindsNonFinite) {
  std::vector<float> g = {3.0f, -6.0f, 1e-3f};
  TensorView v{g.data(), DType::f32, {3}};
  const float inv = static_cast<float>(1.0 / 3.0);
  EXPECT_FALSE(unscale_grads({&v, 1}, inv));
  EXPECT_EQ(g[0], 3.0f * inv);
  EXPECT_EQ(g[1], -6.0f * inv);
  g[2] = std::nanf("");
  EXPECT_TRUE(unscale_grads({&v, 1}, 1.0f));
  EXPECT_EQ(g[0], 3.0f * inv) << "inv_scale 1 leaves values alone";
  std::vector<bf16> h(1);
  h[0].bits = float_to_bf16_bits(std::numeric_limits<float>::infinity());
  TensorView hv{h.data(), DType::bf16, {1}};
  EXPECT_TRUE(unscale_grads({&hv, 1}, 0.5f));
}

}  // namespace
}  // namespace distopt
