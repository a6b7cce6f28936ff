// Shampoo and full-matrix Adagrad against an independent double-precision
// reference: the formulas of docs/optimizers.md ("Non-pointwise rules") written out on
// plain vectors, every matrix function by the cyclic Jacobi eigenvalue
// method (distopt uses Eigen's tridiagonal QR), the unfoldings by index
// arithmetic (distopt uses blocked products). No torch reference exists for
// either rule, so this is their parity test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"

using namespace distopt;

namespace {

using Matrix = std::vector<std::vector<double>>;

Matrix identity(std::size_t n, double scale) {
  Matrix m(n, std::vector<double>(n, 0.0));
  for (std::size_t i = 0; i < n; ++i) m[i][i] = scale;
  return m;
}

// f(A) = V f(L) V^T for symmetric A, by cyclic Jacobi rotations. f(v,
// resolution) also sees n * 2^-24 times the largest |eigenvalue|: what the
// rules' float-stored matrices can resolve (see adagrad_full.cpp).
Matrix matrix_function(Matrix a, const std::function<double(double, double)>& f) {
  const std::size_t n = a.size();
  Matrix v = identity(n, 1.0);
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, total = 0;
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) (i == j ? total : off) += a[i][j] * a[i][j];
    if (off <= 1e-30 * (total + off)) break;
    for (std::size_t p = 0; p < n; ++p)
      for (std::size_t q = p + 1; q < n; ++q) {
        if (a[p][q] == 0.0) continue;
        const double theta = (a[q][q] - a[p][p]) / (2 * a[p][q]);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (std::size_t k = 0; k < n; ++k) {  // A <- A J
          const double akp = a[k][p], akq = a[k][q];
          a[k][p] = c * akp - s * akq;
          a[k][q] = s * akp + c * akq;
        }
        for (std::size_t k = 0; k < n; ++k) {  // A <- J^T A
          const double apk = a[p][k], aqk = a[q][k];
          a[p][k] = c * apk - s * aqk;
          a[q][k] = s * apk + c * aqk;
        }
        for (std::size_t k = 0; k < n; ++k) {  // V <- V J
          const double vkp = v[k][p], vkq = v[k][q];
          v[k][p] = c * vkp - s * vkq;
          v[k][q] = s * vkp + c * vkq;
        }
      }
  }
  double largest = 0;
  for (std::size_t k = 0; k < n; ++k) largest = std::max(largest, std::abs(a[k][k]));
  const double resolution = static_cast<double>(n) * std::ldexp(1.0, -24) * largest;
  Matrix out(n, std::vector<double>(n, 0.0));
  for (std::size_t k = 0; k < n; ++k) {
    const double fk = f(a[k][k], resolution);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) out[i][j] += v[i][k] * fk * v[j][k];
  }
  return out;
}

// Row-major multi-index helpers: element e's index along `mode`, and the
// element with that index replaced.
struct Indexer {
  std::vector<std::int64_t> shape;
  std::size_t stride(std::size_t mode) const {
    std::size_t s = 1;
    for (std::size_t k = mode + 1; k < shape.size(); ++k) s *= static_cast<std::size_t>(shape[k]);
    return s;
  }
  std::size_t index(std::size_t e, std::size_t mode) const {
    return e / stride(mode) % static_cast<std::size_t>(shape[mode]);
  }
  std::size_t with(std::size_t e, std::size_t mode, std::size_t j) const {
    return e - index(e, mode) * stride(mode) + j * stride(mode);
  }
};

struct RefShampoo {
  double lr, momentum, weight_decay, epsilon;
  int update_freq;
  Indexer ix;
  std::vector<Matrix> h, root;
  std::vector<double> buf;
  int t = 0;

  void step(std::vector<double>& p, const std::vector<float>& grad) {
    const std::size_t n = p.size(), k = ix.shape.size();
    std::vector<double> g(n);
    for (std::size_t e = 0; e < n; ++e) g[e] = grad[e] + weight_decay * p[e];
    if (++t == 1) {
      for (std::size_t m = 0; m < k; ++m) {
        h.push_back(identity(static_cast<std::size_t>(ix.shape[m]), epsilon));
        root.push_back({});
      }
      buf.assign(n, 0.0);
    }
    // H_m += G_(m) G_(m)^T: the sum over elements pairs (e, e') that differ
    // only in index m.
    for (std::size_t m = 0; m < k; ++m) {
      for (std::size_t e = 0; e < n; ++e)
        for (std::size_t j = 0; j < static_cast<std::size_t>(ix.shape[m]); ++j)
          h[m][ix.index(e, m)][j] += g[e] * g[ix.with(e, m, j)];
      if ((t - 1) % update_freq == 0)
        root[m] = matrix_function(
            h[m], [&](double v, double) { return std::pow(std::max(v, epsilon), -1.0 / (2.0 * static_cast<double>(k))); });
    }
    std::vector<double> u = g;
    for (std::size_t m = 0; m < k; ++m) {
      std::vector<double> next(n, 0.0);
      for (std::size_t e = 0; e < n; ++e)
        for (std::size_t j = 0; j < static_cast<std::size_t>(ix.shape[m]); ++j)
          next[e] += root[m][ix.index(e, m)][j] * u[ix.with(e, m, j)];
      u = next;
    }
    for (std::size_t e = 0; e < n; ++e) {
      if (momentum > 0) u[e] = buf[e] = momentum * buf[e] + u[e];
      p[e] -= lr * u[e];
    }
  }
};

struct RefAdagradFull {
  double lr, lr_decay, weight_decay, initial, eps;
  std::size_t block;  // 0: whole
  int update_freq;
  std::vector<Matrix> h, root;
  int t = 0;

  void step(std::vector<double>& p, const std::vector<float>& grad) {
    const std::size_t n = p.size(), d = block == 0 ? n : std::min(block, n);
    ++t;
    const double clr = lr / (1 + (t - 1) * lr_decay);
    std::size_t b = 0;
    for (std::size_t start = 0; start < n; start += d, ++b) {
      const std::size_t len = std::min(d, n - start);
      if (t == 1) {
        h.push_back(identity(len, initial));
        root.push_back({});
      }
      std::vector<double> g(len);
      for (std::size_t i = 0; i < len; ++i) g[i] = grad[start + i] + weight_decay * p[start + i];
      for (std::size_t i = 0; i < len; ++i)
        for (std::size_t j = 0; j < len; ++j) h[b][i][j] += g[i] * g[j];
      if ((t - 1) % update_freq == 0)
        // The paper's (eps I + H^1/2)^-1 on H's range; zero on its null
        // space, where g has no component.
        root[b] = matrix_function(h[b], [&](double v, double resolution) {
          return v <= resolution ? 0.0 : 1.0 / (eps + std::sqrt(v));
        });
      for (std::size_t i = 0; i < len; ++i) {
        double u = 0;
        for (std::size_t j = 0; j < len; ++j) u += root[b][i][j] * g[j];
        p[start + i] -= clr * u;
      }
    }
  }
};

std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Runs `steps` steps of distopt's rule and of the reference on one tensor;
// returns max |p - p_ref| / max |p_ref - p_0|, the error relative to how far
// the parameters moved. Some gradients are zero tensors, one step has none.
template <class Ref>
double compare(const std::string& rule, const OptionMap& options, const Shape& shape, Ref ref, int steps) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  std::vector<float> w = random_floats(n, 3, 1.0f), g(n);
  std::vector<double> p(w.begin(), w.end());
  const std::vector<double> p0 = p;
  Optimizer opt(rule, std::vector<Param>{Param{"w", {w.data(), DType::f32, shape}, {g.data(), DType::f32, shape}, true}},
                options);
  for (int k = 0; k < steps; ++k) {
    if (k == 4) continue;  // no gradient: neither steps
    const std::vector<float> v =
        k == 2 ? std::vector<float>(n, 0.0f) : random_floats(n, 100 + static_cast<std::uint32_t>(k), 0.5f);
    std::copy(v.begin(), v.end(), g.begin());  // in place: the optimizer holds g's address
    opt.param(0).has_grad = true;
    opt.step();
    ref.step(p, g);
  }
  double err = 0, moved = 0;
  for (std::size_t i = 0; i < n; ++i) {
    err = std::max(err, std::abs(w[i] - p[i]));
    moved = std::max(moved, std::abs(p[i] - p0[i]));
  }
  EXPECT_GT(moved, 1e-3) << "the parameters must move, or the comparison proves nothing";
  std::printf("%s %s: %.3g\n", rule.c_str(), to_string(shape).c_str(), err / moved);
  return err / moved;
}

}  // namespace

TEST(Shampoo, MatchesADoublePrecisionReferenceAtEveryOrder) {
  struct Case {
    Shape shape;
    double lr, momentum, weight_decay, epsilon;
    int update_freq;
  };
  const std::vector<Case> cases = {
      {{6, 4}, 0.1, 0.0, 0.0, 1e-4, 1},       // the defaults on a matrix
      {{5, 7}, 0.05, 0.9, 0.01, 1e-3, 3},     // momentum, L2, stale roots
      {{9}, 0.1, 0.5, 0.0, 1e-2, 2},          // a vector: full-matrix root -1/2
      {{2, 3, 4}, 0.1, 0.0, 1e-3, 1e-4, 1},   // order 3: roots -1/6
      {{1, 8}, 0.2, 0.0, 0.0, 1e-1, 1},       // a dimension of one
      {{}, 0.1, 0.9, 0.1, 1e-4, 1},           // a scalar: no preconditioner
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("shape " + to_string(c.shape));
    const OptionMap options{{"lr", c.lr},
                            {"momentum", c.momentum},
                            {"weight_decay", c.weight_decay},
                            {"epsilon", c.epsilon},
                            {"update_freq", static_cast<double>(c.update_freq)}};
    RefShampoo ref{c.lr, c.momentum, c.weight_decay, c.epsilon, c.update_freq, {c.shape}, {}, {}, {}};
    EXPECT_LT(compare("shampoo", options, c.shape, ref, 12), 1e-4);
  }
}

TEST(AdagradFull, MatchesADoublePrecisionReferenceWholeAndInBlocks) {
  struct Case {
    Shape shape;
    double lr, lr_decay, weight_decay, initial, eps;
    std::size_t block;
    int update_freq;
  };
  const std::vector<Case> cases = {
      {{4, 3}, 0.01, 0.0, 0.0, 0.0, 1e-10, 0, 1},     // the defaults: one block of 12
      {{4, 3}, 0.05, 0.1, 0.01, 0.1, 1e-6, 0, 3},     // every option, stale roots
      {{10}, 0.01, 0.0, 0.0, 0.5, 1e-10, 4, 1},       // blocks of 4, 4 and a tail of 2
      {{3, 5}, 0.02, 0.0, 0.0, 0.1, 1e-8, 5, 2},      // blocks without a tail
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("shape " + to_string(c.shape) + " block " + std::to_string(c.block));
    const OptionMap options{{"lr", c.lr},
                            {"lr_decay", c.lr_decay},
                            {"weight_decay", c.weight_decay},
                            {"initial_accumulator_value", c.initial},
                            {"eps", c.eps},
                            {"block_size", static_cast<double>(c.block)},
                            {"update_freq", static_cast<double>(c.update_freq)}};
    RefAdagradFull ref{c.lr, c.lr_decay, c.weight_decay, c.initial, c.eps, c.block, c.update_freq, {}, {}};
    EXPECT_LT(compare("adagrad_full", options, c.shape, ref, 12), 1e-4);
  }
}

TEST(AdagradFull, OnBlocksOfOneElementIsTorchsAdagrad) {
  // distopt's adagrad is checked bit for bit against torch (tests/golden);
  // full-matrix Adagrad on 1 x 1 blocks is the same formula, in double.
  const Shape shape{40};
  const OptionMap common{{"lr", 0.1}, {"lr_decay", 0.01}, {"weight_decay", 0.01}, {"initial_accumulator_value", 0.1}};
  std::vector<float> a = random_floats(40, 7, 1.0f), b = a, g(40);
  OptionMap full = common;
  full["block_size"] = 1.0;
  Optimizer diag("adagrad", std::vector<Param>{Param{"w", {a.data(), DType::f32, shape}, {g.data(), DType::f32, shape}, true}},
                 common);
  Optimizer mat("adagrad_full",
                std::vector<Param>{Param{"w", {b.data(), DType::f32, shape}, {g.data(), DType::f32, shape}, true}}, full);
  for (int k = 0; k < 20; ++k) {
    const std::vector<float> v = random_floats(40, 200 + static_cast<std::uint32_t>(k), 1.0f);
    std::copy(v.begin(), v.end(), g.begin());
    diag.param(0).has_grad = mat.param(0).has_grad = true;
    diag.step();
    mat.step();
  }
  for (std::size_t i = 0; i < 40; ++i) EXPECT_NEAR(a[i], b[i], 1e-6 * std::max(1.0f, std::abs(a[i]))) << i;
}

TEST(MatrixRules, BadInputIsOneLineAndUpdatesNothing) {
  auto error_of = [](const std::string& rule, const OptionMap& options, const Shape& shape) -> std::string {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    std::vector<float> w(n, 1.0f), g(n, 1.0f);
    try {
      Optimizer opt(rule, std::vector<Param>{Param{"w", {w.data(), DType::f32, shape}, {g.data(), DType::f32, shape}, true}},
                    options);
      opt.step();
    } catch (const InvalidInput& e) {
      for (float v : w) EXPECT_EQ(v, 1.0f) << "a parameter changed";
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      return m;
    }
    return "";
  };
  // Above the size limit: the bytes and the remedies named.
  const std::string big = error_of("adagrad_full", {}, {256, 784});
  EXPECT_NE(big.find("[256, 784]"), std::string::npos) << big;
  EXPECT_NE(big.find("max_size=4096"), std::string::npos) << big;
  EXPECT_NE(big.find("block_size"), std::string::npos) << big;
  EXPECT_EQ(error_of("adagrad_full", {{"block_size", 64.0}}, {64, 784}), "");  // block-diagonal: accepted
  EXPECT_NE(error_of("adagrad_full", {{"max_size", 10.0}}, {11}).find("max_size=10"), std::string::npos);
  EXPECT_NE(error_of("shampoo", {{"max_precond_dim", 100.0}}, {101, 3}).find("dimension 0"), std::string::npos);
  EXPECT_NE(error_of("shampoo", {{"epsilon", 0.0}}, {3, 3}).find("epsilon"), std::string::npos);
  EXPECT_NE(error_of("shampoo", {{"update_freq", 0.0}}, {3, 3}).find("update_freq"), std::string::npos);
  EXPECT_NE(error_of("shampoo", {{"momentum", 1.0}}, {3, 3}).find("momentum"), std::string::npos);
  EXPECT_NE(error_of("adagrad_full", {{"block_size", -1.0}}, {3}).find("block_size"), std::string::npos);
  EXPECT_NE(error_of("adagrad_full", {{"update_freq", 1.5}}, {3}).find("update_freq"), std::string::npos);
  EXPECT_NE(error_of("adagrad_full", {{"eps", -1.0}}, {3}).find("epsilon"), std::string::npos);
}
