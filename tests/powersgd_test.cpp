// PowerSGD (--grad-compression powersgd; src/parallel/powersgd.hpp,
// docs/sharding.md "PowerSGD"): its products against their definitions, a
// rank-r matrix sent exactly, the residuals adding up to what the
// approximation missed, every strategy and world alike, the warm-up
// uncompressed, the bytes of the theory, and bad options in one line.
#include "../src/parallel/powersgd.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/models/model.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "train_run.hpp"

namespace distopt {
namespace {

using parallel::GradCompression;
using parallel::detail::orthogonalize;
using parallel::detail::outer;
using parallel::detail::times;
using parallel::detail::transposed_times;

std::vector<float> noise(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(gen);
  return v;
}

TEST(PowerSgd, TheProductsAreTheirDefinitions) {
  for (auto [rows, cols, r] : {std::tuple{1, 1, 1}, {7, 5, 2}, {33, 70, 4}, {128, 9, 3}}) {
    SCOPED_TRACE(testing::Message() << rows << " x " << cols << " rank " << r);
    const std::vector<float> m = noise(std::size_t(rows * cols), 1), q = noise(std::size_t(cols * r), 2),
                             p = noise(std::size_t(rows * r), 3);
    std::vector<float> mq(std::size_t(rows * r)), mtp(std::size_t(cols * r)), pqt(std::size_t(rows * cols));
    times(m.data(), q.data(), mq.data(), rows, cols, r);
    transposed_times(m.data(), p.data(), mtp.data(), rows, cols, r);
    outer(p.data(), q.data(), pqt.data(), rows, cols, r);
    for (int i = 0; i < rows; ++i)
      for (int k = 0; k < r; ++k) {
        double want = 0;
        for (int j = 0; j < cols; ++j) want += double(m[i * cols + j]) * q[j * r + k];
        EXPECT_NEAR(mq[i * r + k], want, 1e-5 * (1 + std::abs(want)));
      }
    for (int j = 0; j < cols; ++j)
      for (int k = 0; k < r; ++k) {
        double want = 0;
        for (int i = 0; i < rows; ++i) want += double(m[i * cols + j]) * p[i * r + k];
        EXPECT_NEAR(mtp[j * r + k], want, 1e-5 * (1 + std::abs(want)));
      }
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) {
        double want = 0;
        for (int k = 0; k < r; ++k) want += double(p[i * r + k]) * q[j * r + k];
        EXPECT_NEAR(pqt[i * cols + j], want, 1e-5 * (1 + std::abs(want)));
      }
    // Orthonormal columns, where there are at most as many as rows.
    if (r <= rows) {
      std::vector<float> a = p;
      orthogonalize(a.data(), rows, r);
      for (int x = 0; x < r; ++x)
        for (int y = 0; y < r; ++y) {
          double dot = 0;
          for (int i = 0; i < rows; ++i) dot += double(a[i * r + x]) * a[i * r + y];
          EXPECT_NEAR(dot, x == y ? 1.0 : 0.0, 1e-5) << "columns " << x << ", " << y;
        }
    }
  }
  std::vector<float> zero(12, 0.0f);  // a column of norm 0 stays 0 (no NaN)
  orthogonalize(zero.data(), 6, 2);
  for (float z : zero) EXPECT_EQ(z, 0.0f);
}

// One PowerSGD round at one rank: a matrix of rank r comes back (up to
// rounding), whatever Q starts from.
TEST(PowerSgd, AMatrixOfTheRankComesBack) {
  const int rows = 40, cols = 30, r = 2;
  const std::vector<float> u = noise(rows * r, 4), v = noise(cols * r, 5);
  std::vector<float> m(rows * cols), q = noise(cols * r, 6), p(rows * r), back(rows * cols);
  outer(u.data(), v.data(), m.data(), rows, cols, r);
  orthogonalize(q.data(), cols, r);
  times(m.data(), q.data(), p.data(), rows, cols, r);
  orthogonalize(p.data(), rows, r);
  transposed_times(m.data(), p.data(), q.data(), rows, cols, r);
  outer(p.data(), q.data(), back.data(), rows, cols, r);
  for (int i = 0; i < rows * cols; ++i) EXPECT_NEAR(back[i], m[i], 1e-4 * (1 + std::abs(m[i]))) << i;
}

struct Stepped {
  std::vector<std::vector<float>> sent, residual;  // per rank: each gradient, each residual (padded)
  std::vector<float> delivered;                    // rank 0's reduced gradient (padded, ddp)
  std::vector<bool> of_a_param;                    // the padded elements that are parameters'
};

// One step of ddp with PowerSGD at `world` ranks on known gradients.
Stepped one_step(int world, int rank) {
  auto model = models::make_model("mlp", 20, 5, {24, 40, 8});
  const parallel::FlatLayout flat = parallel::flat_layout(*model);
  std::vector<float> initial(flat.elements, 0.5f);
  parallel::StrategyOptions o;
  o.bucket_elements = 300;
  o.grad_compression = GradCompression::powersgd;
  o.powersgd_rank = rank;
  o.powersgd_warmup = 0;
  Stepped out;
  out.sent.resize(world);
  out.residual.resize(world);
  std::mutex m;
  spawn(world, [&](Communicator& comm) {
    auto s = parallel::make_strategy("ddp", comm, flat, initial, {"sgd", {{"lr", 0.1}}}, o);
    const auto& layout = s->layout();
    std::vector<float> mine(layout.padded_elements(), 0.0f);
    for (std::size_t u = layout.units().size(); u-- > 0;) {  // backward's order
      std::span<float> g = s->access().grads(u);
      const std::vector<float> values = noise(g.size(), 100 + comm.rank() * 10 + unsigned(u));
      std::copy(values.begin(), values.end(), g.begin());
      std::copy(values.begin(), values.end(), mine.begin() + layout.units()[u].padded_offset);
      s->access().grads_done(u);
    }
    std::vector<float> delivered;
    s->step([&](Optimizer& opt, const parallel::GradShard&) {
      for (std::size_t i = 0; i < opt.num_params(); ++i) {
        const TensorView& g = opt.param(i).grad;
        delivered.insert(delivered.end(), g.as<float>(), g.as<float>() + g.numel());
      }
    });
    const parallel::Strategy::Feedback f = s->feedback();
    std::lock_guard lock(m);
    out.sent[comm.rank()] = mine;
    out.residual[comm.rank()].assign(f.residual.begin(), f.residual.end());
    if (comm.rank() == 0) {
      // The optimizer's views in slot order: back into the padded layout.
      out.delivered.assign(layout.padded_elements(), 0.0f);
      out.of_a_param.assign(layout.padded_elements(), false);
      std::size_t at = 0;
      for (std::size_t p = 0; p < layout.params().size(); ++p) {
        const std::size_t n = layout.params()[p].numel(), to = layout.padded_offset(p);
        std::copy_n(delivered.begin() + std::ptrdiff_t(at), n, out.delivered.begin() + std::ptrdiff_t(to));
        std::fill_n(out.of_a_param.begin() + std::ptrdiff_t(to), n, true);
        at += n;
      }
    }
  });
  return out;
}

// Error feedback: what was delivered and what the ranks keep add up to
// what they sent; a vector (bias) travels whole and keeps nothing.
TEST(PowerSgd, TheResidualsAddUpToWhatTheApproximationMissed) {
  for (int world : {1, 3}) {
    const Stepped st = one_step(world, 2);
    std::size_t kept = 0;
    for (std::size_t i = 0; i < st.delivered.size(); ++i) {
      if (!st.of_a_param[i]) continue;  // the gaps between parameters carry nothing
      double sent = 0, owed = 0;
      for (int r = 0; r < world; ++r) sent += st.sent[r][i], owed += st.residual[r][i];
      ASSERT_NEAR(st.delivered[i] + owed, sent, 1e-5 * (1 + std::abs(sent))) << "world " << world << " element " << i;
      kept += owed != 0;
    }
    EXPECT_GT(kept, st.delivered.size() / 2) << "the matrices keep a residual";
  }
}

train::TrainConfig config(const std::string& strategy, GradCompression c, std::size_t warmup) {
  train::TrainConfig t;
  t.model = "mlp";
  t.hidden = {24, 40, 8};
  t.optimizer = {"adamw", {}};
  t.epochs = 2;
  t.batch_size = 32;
  t.seed = 11;
  t.strategy = strategy;
  t.parallel.bucket_elements = 300;
  t.parallel.grad_compression = c;
  t.parallel.powersgd_rank = 2;
  t.parallel.powersgd_warmup = warmup;
  return t;
}

// Every strategy computes the same approximation: ddp, zero1, zero2 and
// zero3 give each other's bits at every world; a warm-up longer than the
// run is the uncompressed run; and PowerSGD trains about as well.
TEST(PowerSgd, EveryStrategyGivesTheSameBitsAndTheWarmUpIsUncompressed) {
  const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  for (int world : {1, 2, 3, 4}) {
    const train::TrainResult none = test_support::run_ranks(world, d, config("ddp", GradCompression::none, 0));
    std::string first;
    for (const char* strategy : {"ddp", "zero1", "zero2", "zero3"}) {
      const train::TrainResult r = test_support::run_ranks(world, d, config(strategy, GradCompression::powersgd, 3));
      if (first.empty()) first = r.param_hash;
      EXPECT_EQ(r.param_hash, first) << strategy << " world " << world;
      EXPECT_NEAR(r.test_accuracy, none.test_accuracy, 0.05) << strategy << " world " << world;
    }
    EXPECT_NE(first, none.param_hash) << "world " << world;
    EXPECT_EQ(test_support::run_ranks(world, d, config("zero2", GradCompression::powersgd, 1000)).param_hash,
              none.param_hash)
        << "world " << world;
  }
}

// The bytes of the theory: per step and bucket, the whole tensors and the
// P factors in one all-reduce and the Q factors in another, each all-reduce
// 2 (n - 1) / n of its bytes, in place of the gradients' reduction.
TEST(PowerSgd, TheReductionsBytesAreTheTheorys) {
  const data::Split d = data::make_synthetic_classification(20, 5, 400, 40, 3);
  const std::vector<std::size_t> widths{20, 256, 64, 5};
  for (const int r : {1, 4}) {
    double sent = 0;  // elements all-reduced per step: whole tensors, P and Q
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      const double rows = double(widths[l + 1]), cols = double(widths[l]), rank = std::min({rows, cols, double(r)});
      sent += rows * cols > 2 * (rows + cols) * rank ? (rows + cols) * rank : rows * cols;
      sent += rows;  // the bias
    }
    for (const char* strategy : {"ddp", "zero1", "zero3"})
      for (int world : {2, 4}) {
        train::TrainConfig c = config(strategy, GradCompression::none, 0);
        c.hidden = {256, 64};
        c.epochs = 1;
        c.parallel.bucket_elements = 1 << 20;
        c.parallel.powersgd_rank = r;
        const train::TrainResult plain = test_support::run_ranks(world, d, c);
        c.strategy = "ddp";
        const double padded = static_cast<double>(test_support::run_ranks(world, d, c).memory.grads) / 4;
        c.strategy = strategy;
        c.parallel.grad_compression = GradCompression::powersgd;
        const train::TrainResult low = test_support::run_ranks(world, d, c);
        const double reduction = std::string(strategy) == "ddp" ? 2 : 1;  // ddp all-reduces, zero1-3 reduce-scatter
        const double saving = double(plain.steps) * (world - 1.0) / world * 4 * (reduction * padded - 2 * sent);
        const double measured = double(plain.bytes_sent) - double(low.bytes_sent);
        EXPECT_NEAR(measured / saving, 1.0, 0.05) << strategy << " rank " << r << " world " << world << ": "
                                                  << plain.bytes_sent << " against " << low.bytes_sent;
      }
  }
}

TEST(PowerSgd, BadOptionsAreOneLine) {
  const data::Split d = data::make_synthetic_classification(20, 5, 64, 16, 3);
  train::TrainConfig c = config("zero1", GradCompression::powersgd, 0);
  for (const int rank : {0, -3, 65536}) {  // 65536: past the 16 bits the ranks compare
    c.parallel.powersgd_rank = rank;
    try {
      test_support::run_ranks(2, d, c);
      ADD_FAILURE() << "rank " << rank << " accepted";
    } catch (const InvalidInput& e) {
      EXPECT_EQ(e.what(), "--powersgd-rank must be in [1, 65535] (got " + std::to_string(rank) + ")");
    }
  }
  EXPECT_EQ(parallel::parse_grad_compression("powersgd"), GradCompression::powersgd);
}

}  // namespace
}  // namespace distopt
