// Gradient clipping against PyTorch (tests/golden/clip, from
// scripts/gen_golden_clip.py), and the reduction hook a sharded engine uses.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>

#include "distopt/core/error.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/optim/optimizer.hpp"
#include "golden_json.hpp"

namespace distopt {
namespace {

using golden::close;
using golden::json;
using golden::num;

TEST(ClipGolden, MatchesTorch) {
  const json doc = golden::load("clip/clip_grad.json");
  int norm_cases = 0, value_cases = 0;
  for (const json& c : doc["cases"]) {
    const std::string name = c["name"];
    std::vector<std::vector<float>> data;
    std::vector<TensorView> views;
    for (std::size_t i = 0; i < c["grads"].size(); ++i) {
      std::vector<float> g;
      for (const json& x : c["grads"][i]) g.push_back(static_cast<float>(num(x)));
      data.push_back(std::move(g));
    }
    for (std::size_t i = 0; i < data.size(); ++i) {
      Shape shape;
      for (const json& d : c["shapes"][i]) shape.push_back(d.get<std::int64_t>());
      views.push_back({data[i].data(), DType::f32, shape});
    }
    if (c["op"] == "norm") {
      ++norm_cases;
      const double total = clip_grad_norm(views, c["max_norm"].get<double>(), num(c["norm_type"]));
      EXPECT_TRUE(close(total, num(c["expected_total"]), 1e-6)) << name;
    } else {
      ++value_cases;
      clip_grad_value(views, c["clip_value"].get<double>());
    }
    for (std::size_t i = 0; i < data.size(); ++i)
      for (std::size_t k = 0; k < data[i].size(); ++k) {
        const double want = num(c["expected"][i][k]);
        ASSERT_TRUE(close(data[i][k], want, 2e-6)) << name << " grad " << i << "[" << k << "]";
      }
  }
  EXPECT_GE(norm_cases, 15);
  EXPECT_GE(value_cases, 3);
}

TEST(Clip, ShardedPartialsReduceToTheWholeNorm) {
  // Two "ranks" holding halves of the same gradients: summing (max for inf)
  // the partial statistics gives the unsharded norm and the same clipping.
  std::vector<float> whole(1000), a, b;
  for (std::size_t i = 0; i < whole.size(); ++i) whole[i] = std::sin(0.37 * static_cast<double>(i)) * 3.0f;
  a.assign(whole.begin(), whole.begin() + 400);
  b.assign(whole.begin() + 400, whole.end());
  for (double p : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()}) {
    std::vector<float> w = whole, x = a, y = b;
    TensorView vw{w.data(), DType::f32, {1000}}, vx{x.data(), DType::f32, {400}}, vy{y.data(), DType::f32, {600}};
    const double px = grad_norm_partial({&vx, 1}, p), py = grad_norm_partial({&vy, 1}, p);
    auto reduce = [&](double& v, bool max) {
      EXPECT_EQ(max, std::isinf(p));
      v = max ? std::max(px, py) : px + py;
    };
    const double n_whole = clip_grad_norm({&vw, 1}, 1.0, p);
    const double n_x = clip_grad_norm({&vx, 1}, 1.0, p, false, reduce);
    const double n_y = clip_grad_norm({&vy, 1}, 1.0, p, false, reduce);
    EXPECT_EQ(n_x, n_y);
    EXPECT_NEAR(n_x, n_whole, 1e-5 * n_whole) << "p " << p;
    for (std::size_t i = 0; i < 400; ++i) ASSERT_NEAR(x[i], w[i], 1e-6f) << i;
    for (std::size_t i = 0; i < 600; ++i) ASSERT_NEAR(y[i], w[400 + i], 1e-6f) << i;
  }
}

TEST(Clip, OptimizerGradsNonFiniteAndBadArguments) {
  float p1[2] = {0, 0}, g1[2] = {3, 4}, p2[1] = {0}, g2[1] = {100};
  Optimizer opt("sgd", {Param{"a", {p1, DType::f32, {2}}, {g1, DType::f32, {2}}, true},
                        Param{"b", {p2, DType::f32, {1}}, {g2, DType::f32, {1}}, false}},
                {{"lr", 0.1}});
  // Parameter b has no gradient: only a's count, as torch skips grad None.
  EXPECT_NEAR(clip_grad_norm(opt, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(g1[0], 0.6f, 1e-6);
  EXPECT_EQ(g2[0], 100.0f);
  clip_grad_value(opt, 0.5);
  EXPECT_EQ(g1[1], 0.5f);
  g1[0] = std::numeric_limits<float>::infinity();
  try {
    clip_grad_norm(opt, 1.0, 2.0, true);
    FAIL() << "a non-finite norm must be refused when error_if_nonfinite";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("is non-finite, so it cannot be clipped"), std::string::npos);
  }
  EXPECT_EQ(g1[1], 0.5f) << "nothing scaled after the error";
  EXPECT_THROW(clip_grad_norm(opt, 1.0, -1.0), InvalidInput);
  EXPECT_THROW(clip_grad_norm(opt, std::nan(""), 2.0), InvalidInput);
  EXPECT_EQ(clip_grad_norm(std::span<const TensorView>{}, 1.0), 0.0);
}

TEST(Clip, HalfPrecisionGradients) {
  std::vector<bf16> g(4);
  for (int i = 0; i < 4; ++i) g[i].bits = float_to_bf16_bits(2.0f);
  TensorView v{g.data(), DType::bf16, {4}};
  EXPECT_NEAR(clip_grad_norm({&v, 1}, 1.0), 4.0, 1e-6);
  EXPECT_NEAR(bf16_bits_to_float(g[0].bits), 0.5f, 2e-3);  // 2 * 1/4
}

}  // namespace
}  // namespace distopt
