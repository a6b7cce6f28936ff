#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/data/dataset.hpp"

namespace distopt::data {

Split make_synthetic_classification(std::size_t features, std::size_t classes, std::size_t train_size,
                                    std::size_t test_size, std::uint64_t seed) {
  if (features == 0 || classes < 2) throw InvalidInput("synthetic classification needs features > 0 and classes >= 2");
  // The teacher: features -> hidden (ReLU) -> classes, N(0, 1/fan_in) weights,
  // biases chosen so that hidden units are active about half the time.
  const std::size_t hidden = 32;
  Rng rng(seed, /*stream=*/1);
  std::vector<double> w1(hidden * features), b1(hidden), w2(classes * hidden);
  for (auto& w : w1) w = rng.normal() / std::sqrt(double(features));
  for (std::size_t h = 0; h < hidden; ++h) {
    double mean = 0;  // E[w·x] for x uniform in [0, 1)
    for (std::size_t f = 0; f < features; ++f) mean += 0.5 * w1[h * features + f];
    b1[h] = -mean;
  }
  for (auto& w : w2) w = rng.normal() / std::sqrt(double(hidden));
  auto make = [&](std::size_t n, std::uint64_t stream) {
    Dataset d;
    d.features = features;
    d.classes = classes;
    d.x.resize(n * features);
    d.y.resize(n);
    Rng r(seed, stream);
    std::vector<double> act(hidden);
    for (std::size_t i = 0; i < n; ++i) {
      float* x = d.x.data() + i * features;
      for (std::size_t f = 0; f < features; ++f) x[f] = static_cast<float>(r.uniform());
      for (std::size_t h = 0; h < hidden; ++h) {
        double z = b1[h];
        for (std::size_t f = 0; f < features; ++f) z += w1[h * features + f] * x[f];
        act[h] = z > 0 ? z : 0;
      }
      std::size_t best = 0;
      double best_z = -INFINITY;
      for (std::size_t c = 0; c < classes; ++c) {
        double z = 0;
        for (std::size_t h = 0; h < hidden; ++h) z += w2[c * hidden + h] * act[h];
        if (z > best_z) best_z = z, best = c;
      }
      d.y[i] = static_cast<float>(best);
    }
    return d;
  };
  Split s;
  s.name = "synthetic";
  s.train = make(train_size, 2);
  s.test = make(test_size, 3);
  return s;
}

Split make_synthetic_regression(std::size_t features, std::size_t train_size, std::size_t test_size, double noise,
                                std::uint64_t seed) {
  if (features == 0) throw InvalidInput("synthetic regression needs features > 0");
  Rng rng(seed, 1);
  std::vector<double> w(features);
  for (auto& v : w) v = rng.normal();
  const double b = rng.normal();
  auto make = [&](std::size_t n, std::uint64_t stream) {
    Dataset d;
    d.features = features;
    d.x.resize(n * features);
    d.y.resize(n);
    Rng r(seed, stream);
    for (std::size_t i = 0; i < n; ++i) {
      double t = b;
      for (std::size_t f = 0; f < features; ++f) {
        const double x = r.normal();
        d.x[i * features + f] = static_cast<float>(x);
        t += w[f] * x;
      }
      d.y[i] = static_cast<float>(t + noise * r.normal());
    }
    return d;
  };
  Split s;
  s.name = "synthetic-regression";
  s.train = make(train_size, 2);
  s.test = make(test_size, 3);
  return s;
}

}  // namespace distopt::data
