// The built-in models: layout, PyTorch-style initialization, and gradients
// checked against central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"

using namespace distopt;
using namespace distopt::models;

namespace {

struct Batch {
  std::vector<float> x, y;
};

Batch random_batch(std::size_t n, std::size_t features, std::size_t classes, std::uint64_t seed) {
  Batch b;
  Rng rng(seed);
  for (std::size_t i = 0; i < n * features; ++i) b.x.push_back(static_cast<float>(rng.normal()));
  for (std::size_t i = 0; i < n; ++i)
    b.y.push_back(classes ? static_cast<float>(rng.below(classes)) : static_cast<float>(rng.normal()));
  return b;
}

// Every parameter element: analytic gradient of the mean loss vs a central
// difference of the loss computed in double from evaluate().
void check_gradients(Model& m, std::size_t classes, std::uint64_t seed) {
  const std::size_t n = 5;
  const Batch b = random_batch(n, m.features(), classes, seed);
  std::vector<float> p(m.buffer_elements()), g(m.buffer_elements());
  m.init(p, seed);
  const float scale = 1.0f / n;
  m.forward_backward(p, b.x.data(), b.y.data(), n, scale, g);
  int checked = 0;
  for (const ParamSlot& s : m.params())
    for (std::size_t k = 0; k < s.numel(); ++k) {
      const std::size_t i = s.offset + k;
      const float saved = p[i], h = 1e-2f * std::max(1.0f, std::abs(saved));
      p[i] = saved + h;
      const double up = m.evaluate(p, b.x.data(), b.y.data(), n).loss_sum / n;
      p[i] = saved - h;
      const double down = m.evaluate(p, b.x.data(), b.y.data(), n).loss_sum / n;
      p[i] = saved;
      const double fd = (up - down) / (2.0 * h);
      EXPECT_NEAR(g[i], fd, 2e-3 + 2e-2 * std::abs(fd)) << m.name() << " " << s.name << "[" << k << "]";
      ++checked;
    }
  EXPECT_EQ(checked, static_cast<int>([&] {
              std::size_t t = 0;
              for (const auto& s : m.params()) t += s.numel();
              return t;
            }()));
}

}  // namespace

TEST(Models, MlpLayoutIsTorchsLinearStackInAlignedSlots) {
  auto m = make_model("mlp", 784, 10);
  ASSERT_EQ(m->params().size(), 6u);
  EXPECT_EQ(m->params()[0].name, "fc1.weight");
  EXPECT_EQ(m->params()[0].shape, (Shape{256, 784}));
  EXPECT_EQ(m->params()[3].shape, (Shape{128}));
  EXPECT_EQ(m->params()[4].shape, (Shape{10, 128}));
  std::size_t elements = 0;
  for (const auto& p : m->params()) {
    EXPECT_EQ(p.offset % 16, 0u) << p.name << " is not 64-byte aligned";
    elements += p.numel();
  }
  EXPECT_EQ(elements, 784u * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);  // 235,146
  ASSERT_EQ(m->units().size(), 3u);
  EXPECT_EQ(m->units()[0].begin, 0u);
  EXPECT_EQ(m->units()[1].begin, m->units()[0].end);
  EXPECT_EQ(m->units()[2].end, m->buffer_elements());
}

TEST(Models, InitIsTorchsLinearDefault) {
  auto m = make_model("mlp", 784, 10);
  std::vector<float> p(m->buffer_elements(), 99.0f);
  m->init(p, 1);
  const std::size_t fan_in[] = {784, 784, 256, 256, 128, 128};
  for (std::size_t i = 0; i < m->params().size(); ++i) {
    const ParamSlot& s = m->params()[i];
    const double bound = 1.0 / std::sqrt(double(fan_in[i]));
    double sum = 0, sq = 0;
    for (std::size_t k = 0; k < s.numel(); ++k) {
      const double v = p[s.offset + k];
      ASSERT_LE(std::abs(v), bound) << s.name;
      sum += v;
      sq += v * v;
    }
    if (s.numel() < 1000) continue;
    const double n = double(s.numel());
    EXPECT_NEAR(sum / n, 0.0, 5 * bound / std::sqrt(3 * n)) << s.name;
    EXPECT_NEAR(sq / n, bound * bound / 3, 0.05 * bound * bound / 3) << s.name;  // U(-b, b) variance
  }
  // Padding between slots is zero; a different seed gives different values.
  const ParamSlot& last = m->params().back();  // fc3.bias: 10 values in a 16-element slot
  for (std::size_t k = last.numel(); k < m->buffer_elements() - last.offset; ++k) EXPECT_EQ(p[last.offset + k], 0.0f);
  std::vector<float> q(m->buffer_elements());
  m->init(q, 2);
  EXPECT_NE(p, q);
}

// init_range draws any range of init's values without the whole buffer
// (a zero3 rank starts from its pieces alone): ranges that start and end
// inside parameters, in padding, across slots, empty ones.
TEST(Models, InitRangeGivesInitsValuesForAnyRange) {
  ModelOptions gpt_options{{}, GptShape{2, 2, 32, 8, 256}, 1, MatmulPrecision::f32, false};
  std::vector<std::unique_ptr<Model>> models;
  models.push_back(make_model("mlp", 784, 10));
  models.push_back(make_model("gpt", 9, 256, gpt_options));
  for (const auto& m : models) {
    const std::size_t n = m->buffer_elements();
    std::vector<float> whole(n);
    m->init(whole, 7);
    Rng rng(3);
    for (int trial = 0; trial < 40; ++trial) {
      std::size_t a = rng.below(n + 1), b = rng.below(n + 1);
      if (a > b) std::swap(a, b);
      std::vector<float> part(b - a, 99.0f);
      m->init_range(a, part, 7);
      for (std::size_t k = 0; k < part.size(); ++k)
        ASSERT_EQ(part[k], whole[a + k]) << m->name() << " range [" << a << ", " << b << ") at " << a + k;
    }
    std::vector<float> tail(1);
    m->init_range(n - 1, tail, 7);
    EXPECT_EQ(tail[0], whole[n - 1]);
  }
}

TEST(Models, MlpGradientsMatchFiniteDifferences) {
  auto m = make_model("mlp", 6, 3, {5, 4});
  check_gradients(*m, 3, 11);
}

// Tiles (ModelOptions::tile_rows) compute a layer in row blocks: the same
// layout and initial values, the loss and gradients of the whole layers up
// to rounding, and gradients that match finite differences.
TEST(Models, TiledMlpIsTheWholeLayersUpToRounding) {
  ModelOptions tiled;
  tiled.hidden = {70, 33};
  tiled.tile_rows = 16;
  const auto t = make_model("mlp", 40, 5, tiled);
  const auto w = make_model("mlp", 40, 5, tiled.hidden);
  ASSERT_EQ(t->buffer_elements(), w->buffer_elements());
  EXPECT_EQ(t->units()[0].tile, 16u * 40);
  EXPECT_EQ(t->units()[1].tile, 16u * 70);
  EXPECT_EQ(t->units()[2].tile, 0u);
  std::vector<float> params(t->buffer_elements()), p2(w->buffer_elements());
  t->init(params, 5);
  w->init(p2, 5);
  ASSERT_EQ(params, p2);
  const std::size_t n = 9;
  Rng rng(4);
  std::vector<float> x(n * 40), y(n);
  for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1));
  for (std::size_t i = 0; i < n; ++i) y[i] = static_cast<float>(i % 5);
  std::vector<float> gt(params.size(), 7.0f), gw(params.size(), 7.0f);
  const BatchStats st = t->forward_backward(params, x.data(), y.data(), n, 1.0f, gt);
  const BatchStats sw = w->forward_backward(params, x.data(), y.data(), n, 1.0f, gw);
  EXPECT_NEAR(st.loss_sum, sw.loss_sum, 1e-5 * std::abs(sw.loss_sum));
  double scale = 0;
  for (float g : gw) scale = std::max(scale, double(std::abs(g)));
  for (std::size_t k = 0; k < gt.size(); ++k) ASSERT_NEAR(gt[k], gw[k], 1e-5 * scale) << "element " << k;
  ModelOptions small;  // the finite-difference test's model, in tiles of 2 rows
  small.hidden = {5, 4};
  small.tile_rows = 2;
  const auto s = make_model("mlp", 6, 3, small);
  ASSERT_GT(s->units()[2].tile, 0u);
  check_gradients(*s, 3, 11);
}

TEST(Models, LogregGradientsMatchFiniteDifferences) {
  auto m = make_model("logreg", 7, 4);
  check_gradients(*m, 4, 12);
}

TEST(Models, LinregGradientsMatchFiniteDifferences) {
  auto m = make_model("linreg", 5, 0);
  check_gradients(*m, 0, 13);
}

// DDP relies on it: the gradient of a batch is the sum of its pieces' gradients.
TEST(Models, BatchGradientIsTheSumOfItsPieces) {
  auto m = make_model("mlp", 20, 4, {16, 8});
  const Batch b = random_batch(12, 20, 4, 3);
  std::vector<float> p(m->buffer_elements()), whole(p.size()), a(p.size()), c(p.size());
  m->init(p, 3);
  const BatchStats s = m->forward_backward(p, b.x.data(), b.y.data(), 12, 1.0f / 12, whole);
  const BatchStats s1 = m->forward_backward(p, b.x.data(), b.y.data(), 5, 1.0f / 12, a);
  const BatchStats s2 = m->forward_backward(p, b.x.data() + 5 * 20, b.y.data() + 5, 7, 1.0f / 12, c);
  EXPECT_NEAR(s.loss_sum, s1.loss_sum + s2.loss_sum, 1e-5);
  EXPECT_EQ(s.count, 12);
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(whole[i], a[i] + c[i], 1e-6 + 1e-5 * std::abs(whole[i]));
  // An empty piece contributes zeros.
  std::fill(a.begin(), a.end(), 5.0f);
  EXPECT_EQ(m->forward_backward(p, nullptr, nullptr, 0, 1.0f, a).count, 0);
  for (float v : a) ASSERT_EQ(v, 0.0f);
}

TEST(Models, UnknownNamesAndMismatchedDataAreRejected) {
  EXPECT_THROW(make_model("resnet", 784, 10), InvalidInput);
  EXPECT_THROW(make_model("linreg", 784, 10), InvalidInput);
  EXPECT_THROW(make_model("mlp", 32, 0), InvalidInput);
}
