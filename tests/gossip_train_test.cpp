// The gossip strategies in training: the equivalences FairScale's SlowMo
// suite checks, push-sum's conservation, and every strategy at odd world
// sizes with the library's optimizers, clipping, schedulers and averaging.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/gossip/compress.hpp"
#include "distopt/models/model.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "train_run.hpp"

using namespace distopt;

namespace {

const data::Split& data_set() {
  static const data::Split d = data::make_synthetic_classification(16, 4, 960, 240, 9);
  return d;
}

train::TrainConfig base(std::string strategy, OptionMap sgd) {
  train::TrainConfig c;
  c.model = "mlp";
  c.hidden = {24, 12};
  c.strategy = std::move(strategy);
  c.optimizer = {"sgd", std::move(sgd)};
  c.batch_size = 48;  // 20 batches of 48, divisible by every world below
  c.seed = 4;
  c.epochs = 1;
  return c;
}

// Every rank reports the average model, so their hashes agree.
train::TrainResult run(int world, const train::TrainConfig& c) { return test_support::run_ranks(world, data_set(), c); }

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / (1e-3 + std::abs(double(b[i]))));
  return worst;
}

// |a - b| / |b| over the whole vectors (2-norms).
double norm_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

}  // namespace

TEST(GossipTraining, SlowMoWithTauOneIsSgdWithTheOuterLrAndMomentum) {
  // FairScale's test: base SGD with lr 1 and no momentum, averaged exactly
  // every step, then SlowMo's u <- beta u + (x_old - x_avg), x_old -= alpha u:
  // single-process SGD (ddp) with lr alpha and momentum beta.
  train::TrainConfig slowmo = base("slowmo", {{"lr", 1.0}});
  slowmo.parallel.gossip.slowmo_frequency = 1;
  slowmo.parallel.gossip.slowmo_momentum = 0.5;
  slowmo.parallel.gossip.slowmo_lr = 0.05;
  const train::TrainConfig ddp = base("ddp", {{"lr", 0.05}, {"momentum", 0.5}});
  const train::TrainResult a = run(4, slowmo), b = run(4, ddp);
  EXPECT_LT(max_rel_diff(a.params, b.params), 1e-4);
  // ... and the test can tell: another beta is far off.
  slowmo.parallel.gossip.slowmo_momentum = 0.4;
  EXPECT_GT(max_rel_diff(run(4, slowmo).params, b.params), 1e-3);
}

TEST(GossipTraining, LocalSgdIsAManualAverageEveryFSteps) {
  // SlowMo off (alpha 1, beta 0, tau beyond the run): local SGD averaging
  // the parameters every 3 steps, against the same computed here by hand.
  const int n = 3, f = 3, steps = 12;
  const double lr = 0.1;
  train::TrainConfig c = base("slowmo", {{"lr", lr}});
  c.parallel.gossip.localsgd_frequency = f;
  c.parallel.gossip.slowmo_frequency = 1000;
  c.parallel.gossip.slowmo_momentum = 0.0;
  c.parallel.gossip.slowmo_lr = 1.0;
  c.max_steps = steps;
  const train::TrainResult got = run(n, c);

  const data::Split& d = data_set();
  auto model = models::make_model(c.model, d.train.features, d.train.classes, c.hidden);
  std::vector<float> init(model->buffer_elements());
  model->init(init, c.seed);
  std::vector<std::vector<float>> p(n, init);
  data::BatchSampler sampler(d.train.size(), c.batch_size, c.seed, false);
  sampler.set_epoch(0);
  std::vector<float> g(init.size()), xb, yb;
  for (int k = 0; k < steps; ++k) {
    for (int r = 0; r < n; ++r) {
      const auto local = sampler.local_batch(k, r, n);
      xb.clear();
      yb.clear();
      for (std::uint32_t i : local) {
        xb.insert(xb.end(), d.train.sample(i), d.train.sample(i) + d.train.features);
        yb.push_back(d.train.y[i]);
      }
      model->forward_backward(p[r], xb.data(), yb.data(), local.size(), 1.0f / float(c.batch_size), g);
      for (std::size_t i = 0; i < g.size(); ++i) p[r][i] -= static_cast<float>(lr) * (g[i] * float(n));
    }
    if ((k + 1) % f == 0)
      for (std::size_t i = 0; i < init.size(); ++i) {
        float s = 0;
        for (int r = 0; r < n; ++r) s += p[r][i];
        for (int r = 0; r < n; ++r) p[r][i] = s / float(n);
      }
  }
  std::vector<float> want;
  for (const ParamSlot& s : model->params()) want.insert(want.end(), p[0].begin() + s.offset, p[0].begin() + s.offset + s.numel());
  EXPECT_LT(max_rel_diff(got.params, want), 1e-4);
}

// DiLoCo (src/parallel/gossip/diloco.cpp). The outer step subtracts the
// averaged pseudo-gradient: theta - mean_r(theta - theta_r) equals the
// plain average mean_r(theta_r) in exact arithmetic, not in float (a - (a
// - b) need not be b), so these equivalences hold to rounding, not to the
// bit.
train::TrainConfig diloco(int sync_every, double outer_lr, double outer_momentum) {
  train::TrainConfig c = base("diloco", {{"lr", 0.1}});
  c.parallel.gossip.sync_every = sync_every;
  c.parallel.gossip.outer_optimizer = "sgd";
  c.parallel.gossip.outer_lr = outer_lr;
  c.parallel.gossip.outer_momentum = outer_momentum;
  return c;
}

TEST(GossipTraining, DilocoSyncingEveryStepWithOuterLrOneIsDdp) {
  // H = 1, inner SGD without momentum, outer SGD lr 1 without momentum:
  // each step every rank moves by its own gradient, the moves are averaged
  // and applied to the common model -- ddp's step.
  const train::TrainConfig ddp = base("ddp", {{"lr", 0.1}});
  for (int n : {2, 3, 4}) {
    const train::TrainResult a = run(n, diloco(1, 1.0, 0.0)), b = run(n, ddp);
    EXPECT_LT(norm_rel_diff(a.params, b.params), 1e-6) << n;
    EXPECT_LT(max_rel_diff(a.params, b.params), 1e-5) << n;
    EXPECT_LT(a.consensus_distance, 1e-12) << n;
  }
  // ... and the test can tell: an outer lr of 0.9 is far off.
  EXPECT_GT(norm_rel_diff(run(2, diloco(1, 0.9, 0.0)).params, run(2, ddp).params), 1e-4);
}

TEST(GossipTraining, DilocoWithOuterLrOneIsLocalSgd) {
  // Outer SGD lr 1 without momentum at H = 3: local SGD averaging every 3
  // steps (slowmo's localsgd base with SlowMo off), to rounding.
  train::TrainConfig local = base("slowmo", {{"lr", 0.1}});
  local.parallel.gossip.localsgd_frequency = 3;
  local.parallel.gossip.slowmo_frequency = 1000;
  local.parallel.gossip.slowmo_momentum = 0.0;
  local.parallel.gossip.slowmo_lr = 1.0;
  for (int n : {2, 4}) {
    const train::TrainResult a = run(n, diloco(3, 1.0, 0.0)), b = run(n, local);
    EXPECT_LT(norm_rel_diff(a.params, b.params), 1e-6) << n;
    EXPECT_LT(max_rel_diff(a.params, b.params), 1e-5) << n;
  }
  // The paper's outer Nesterov SGD (lr 0.7, momentum 0.9) is another method.
  EXPECT_GT(norm_rel_diff(run(2, diloco(3, 0.7, 0.9)).params, run(2, local).params), 1e-4);
}

TEST(GossipTraining, DilocoCommunicatesOncePerSync) {
  // One all-reduce of the model per H steps and nothing between: over 20
  // steps, H = 1, 5 and 10 sync 20, 4 and 2 times, so beyond the run's
  // fixed bytes (setup, evaluation) the differences are 18 and 2 syncs.
  train::TrainConfig c = diloco(1, 0.7, 0.9);
  c.max_steps = 20;
  std::uint64_t bytes[3];
  int k = 0;
  for (int h : {1, 5, 10}) {
    c.parallel.gossip.sync_every = h;
    bytes[k++] = run(2, c).bytes_sent;
  }
  ASSERT_GT(bytes[1], bytes[2]);
  EXPECT_EQ(bytes[0] - bytes[2], 9 * (bytes[1] - bytes[2]));
}

// Streaming DiLoCo and compressed pseudo-gradients, driven by hand: a model
// of 4 units of 64 parameters, each rank's gradient a fixed rank-dependent
// vector, inner SGD lr 0.1, outer SGD lr 1 without momentum (so a synced
// fragment is the ranks' average at its sync step). Each step records every
// rank's padded parameters (own_params) and the bytes the step sent.
parallel::FlatLayout four_units() {
  parallel::FlatLayout out;
  for (std::size_t u = 0; u < 4; ++u) {
    out.params.push_back({str("layer", u, ".weight"), u * 64, {64}});
    out.units.push_back({str("layer", u), u * 64, u * 64 + 64});
  }
  out.elements = 256;
  return out;
}

struct Driven {
  std::vector<std::vector<std::vector<float>>> params;  // [step][rank]: after the step (step 0: the start)
  std::vector<std::uint64_t> bytes;                       // [step] rank 0's bytes of the step
  std::vector<std::size_t> unit_at;                      // padded offset of each unit
};

// grad(rank, i, p): the rank's gradient of parameter i (unit u's i-th at u * 64 + i)
// where the rank's model holds p.
Driven drive(int world, const parallel::GossipOptions& g, int steps,
             const std::function<float(int rank, std::size_t i, float p)>& grad, double lr = 0.1,
             float init_scale = 0.01f) {
  const parallel::FlatLayout layout = four_units();
  Driven out;
  out.params.assign(static_cast<std::size_t>(steps) + 1, std::vector<std::vector<float>>(world));
  out.bytes.assign(static_cast<std::size_t>(steps) + 1, 0);
  spawn(world, [&](Communicator& comm) {
    std::vector<float> init(layout.elements);
    for (std::size_t i = 0; i < init.size(); ++i) init[i] = init_scale * static_cast<float>(i % 7);
    parallel::StrategyOptions o;
    o.gossip = g;
    auto s = parallel::make_strategy("diloco", comm, layout, init, {"sgd", {{"lr", lr}}}, o);
    const auto r = static_cast<std::size_t>(comm.rank());
    if (r == 0)
      for (const auto& u : s->layout().units()) out.unit_at.push_back(u.padded_offset);
    auto record = [&](std::size_t k) {
      const std::span<const float> own = s->own_params();
      out.params[k][r].assign(own.begin(), own.end());
    };
    record(0);
    for (int k = 1; k <= steps; ++k) {
      const std::uint64_t b0 = s->bytes_sent();
      const std::span<const float> now = s->own_params();
      const std::vector<float> own(now.begin(), now.end());
      for (std::size_t u = 0; u < 4; ++u) {
        std::span<float> gr = s->access().grads(u);
        const std::size_t at = s->layout().units()[u].padded_offset;
        for (std::size_t i = 0; i < gr.size(); ++i) gr[i] = grad(comm.rank(), u * 64 + i, own[at + i]);
        s->access().grads_done(u);
      }
      s->step();
      if (r == 0) out.bytes[static_cast<std::size_t>(k)] = s->bytes_sent() - b0;
      record(static_cast<std::size_t>(k));
    }
  });
  return out;
}

// The same with a gradient that does not depend on the parameters.
Driven drive(int world, const parallel::GossipOptions& g, int steps,
             const std::function<float(int rank, std::size_t i)>& grad, double lr = 0.1, float init_scale = 0.01f) {
  return drive(world, g, steps, [&](int r, std::size_t i, float) { return grad(r, i); }, lr, init_scale);
}

parallel::GossipOptions plain_outer(int sync_every) {
  parallel::GossipOptions g;
  g.sync_every = sync_every;
  g.outer_lr = 1.0;
  g.outer_momentum = 0.0;
  return g;
}

float rank_grad(int rank, std::size_t i) { return 0.01f * static_cast<float>(rank + 1) * static_cast<float>(1 + i % 5); }

TEST(GossipTraining, StreamingDilocoSyncsEachFragmentAtItsStep) {
  // P = 2 (fragment 0: units 0 and 2; fragment 1: units 1 and 3), H = 4,
  // tau = 1: fragment 0 starts at 2 and 6 and lands at 3 and 7, fragment
  // 1 starts at 4 and 8 and lands at 5 (and 9). After landing, a fragment
  // is the ranks' average at its start step (alpha 0), or with alpha 0.5
  // the mean of that and the rank's own value at the landing step.
  for (double alpha : {0.0, 0.5}) {
    parallel::GossipOptions g = plain_outer(4);
    g.fragments = 2;
    g.sync_delay = 1;
    g.fragment_alpha = alpha;
    const int n = 3;
    const Driven d = drive(n, g, 8, rank_grad);
    auto unit = [&](std::size_t step, int rank, std::size_t u) {
      const auto& p = d.params[step][static_cast<std::size_t>(rank)];
      return std::vector<float>(p.begin() + d.unit_at[u], p.begin() + d.unit_at[u] + 64);
    };
    auto mean = [&](std::size_t step, std::size_t u) {
      std::vector<float> m(64, 0.0f);
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < 64; ++i) m[i] += unit(step, r, u)[i] / n;
      return m;
    };
    auto agree = [&](std::size_t step, std::size_t u) { return unit(step, 0, u) == unit(step, 1, u); };
    for (std::size_t step = 1; step <= 8; ++step) {
      SCOPED_TRACE(str("alpha ", alpha, " step ", step));
      // Fragment 0 lands at 3 and 7, fragment 1 at 5; with alpha 0 a landed
      // fragment is the same on every rank until the next inner step.
      const bool f0 = step == 3 || step == 7, f1 = step == 5;
      for (std::size_t u = 0; u < 4; ++u) {
        const bool landed = u % 2 == 0 ? f0 : f1;
        EXPECT_EQ(agree(step, u), landed && alpha == 0) << u;
        if (!landed) continue;
        const std::vector<float> global = mean(step - 1, u);  // the average at the start step
        for (int r = 0; r < n; ++r) {
          std::vector<float> want = global;
          if (alpha > 0) {
            // The rank's own value at the landing step: one inner step on
            // from its value at the start (its gradient times n).
            const std::vector<float> before = unit(step - 1, r, u);
            for (std::size_t i = 0; i < 64; ++i)
              want[i] = 0.5f * global[i] +
                        0.5f * (before[i] - 0.1f * rank_grad(r, u * 64 + i) * static_cast<float>(n));
          }
          EXPECT_LT(max_rel_diff(unit(step, r, u), want), 1e-5) << "unit " << u << " rank " << r;
        }
      }
    }
  }
}

TEST(GossipTraining, StreamingDilocoFollowsAReferenceOverManySyncs) {
  // Streaming DiLoCo written out here, step by step, against the strategy
  // over several syncs of each fragment: 3 ranks, each with its own
  // quadratic (gradient c_r (p - t_r), so the ranks drift apart and what a
  // sync lands matters for what follows), inner SGD lr 0.1 (the strategy
  // takes each rank's gradient times n), outer Nesterov SGD lr 0.7 with
  // momentum 0.5, one per fragment (torch's: buf = d at its first step, then
  // mu buf + d; the step is d + mu buf). H = 4, P = 1 and 2, tau = 0 and 1,
  // alpha = 0 and 0.5; with tau = 1 also with carry (a landed fragment is
  // global + the rank's change since the sync step, then mixed by alpha).
  const int n = 3, H = 4, steps = 15;
  const float lr = 0.1f, outer_lr = 0.7f, mu = 0.5f;
  auto grad = [](int r, std::size_t i, float p) {
    const float c = 0.5f + 0.25f * static_cast<float>(r);
    const float target = 0.1f * static_cast<float>(r + 1) * static_cast<float>(1 + i % 3);
    return c * (p - target);
  };
  for (int P : {1, 2})
    for (int tau : {0, 1})
      for (double alpha : {0.0, 0.5})
        for (bool carry : {false, true}) {
          if (carry && tau == 0) continue;
          SCOPED_TRACE(str("P ", P, " tau ", tau, " alpha ", alpha, " carry ", carry));
          parallel::GossipOptions g;
          g.sync_every = H;
          g.outer_lr = outer_lr;
          g.outer_momentum = mu;
          g.fragments = P;
          g.sync_delay = tau;
          g.fragment_alpha = alpha;
          g.fragment_carry = carry;
          const Driven d = drive(n, g, steps, grad, lr);
          // x[r][u][i]; the global model, the outer momentum and the averaged
          // pseudo-gradient in flight per unit (a fragment's units share its
          // schedule).
          std::vector<std::vector<std::vector<float>>> x(n, std::vector<std::vector<float>>(4));
          for (int r = 0; r < n; ++r)
            for (std::size_t u = 0; u < 4; ++u) {
              const auto& p0 = d.params[0][static_cast<std::size_t>(r)];
              x[r][u].assign(p0.begin() + d.unit_at[u], p0.begin() + d.unit_at[u] + 64);
            }
          std::vector<std::vector<float>> global = x[0], buf(4), flight(4);
          std::vector<std::vector<std::vector<float>>> at_sync(n, std::vector<std::vector<float>>(4));
          const auto a = static_cast<float>(alpha);
          // The outer step of unit u with the average in flight; every rank
          // restarts from it (with carry, plus its change since the sync).
          auto outer_step = [&](std::size_t u) {
            const std::vector<float>& dlt = flight[u];
            if (buf[u].empty()) buf[u] = dlt;
            else
              for (std::size_t i = 0; i < 64; ++i) buf[u][i] = mu * buf[u][i] + dlt[i];
            for (std::size_t i = 0; i < 64; ++i) global[u][i] -= outer_lr * (dlt[i] + mu * buf[u][i]);
            for (int r = 0; r < n; ++r)
              for (std::size_t i = 0; i < 64; ++i) {
                const float from = carry ? global[u][i] + (x[r][u][i] - at_sync[r][u][i]) : global[u][i];
                x[r][u][i] = (1 - a) * from + a * x[r][u][i];
              }
          };
          for (int k = 1; k <= steps; ++k) {
            for (int r = 0; r < n; ++r)
              for (std::size_t u = 0; u < 4; ++u)
                for (std::size_t i = 0; i < 64; ++i)
                  x[r][u][i] -= lr * (grad(r, u * 64 + i, x[r][u][i]) * static_cast<float>(n));
            for (std::size_t u = 0; u < 4; ++u) {
              const int first =
                  static_cast<int>(((u % static_cast<std::size_t>(P)) + 1) * H / static_cast<std::size_t>(P));
              const bool syncs = k >= first && (k - first) % H == 0;
              const bool lands = k - tau >= first && (k - tau - first) % H == 0;
              if (tau > 0 && lands) outer_step(u);  // what started tau steps ago
              if (!syncs) continue;
              for (int r = 0; r < n; ++r) at_sync[r][u] = x[r][u];
              flight[u].assign(64, 0.0f);
              for (int r = 0; r < n; ++r)
                for (std::size_t i = 0; i < 64; ++i) flight[u][i] += global[u][i] - x[r][u][i];
              for (float& v : flight[u]) v /= static_cast<float>(n);
              if (tau == 0) outer_step(u);
            }
            for (int r = 0; r < n; ++r)
              for (std::size_t u = 0; u < 4; ++u) {
                const auto& got = d.params[static_cast<std::size_t>(k)][static_cast<std::size_t>(r)];
                const std::vector<float> unit(got.begin() + d.unit_at[u], got.begin() + d.unit_at[u] + 64);
                EXPECT_LT(max_rel_diff(unit, x[r][u]), 1e-5) << "step " << k << " rank " << r << " unit " << u;
              }
          }
        }
}

TEST(GossipTraining, StreamingDilocoCutsThePeakBytesOfASyncByP) {
  // tau = 0: a fragment's average completes inside its step, so the bytes
  // of each step are those of its syncs. H = 8: P = 1 sends the whole model
  // at step 8; P = 4 one unit at each of steps 2, 4, 6 and 8 (a quarter each)
  // and the same in all.
  const Driven one = drive(2, plain_outer(8), 8, rank_grad);
  parallel::GossipOptions g = plain_outer(8);
  g.fragments = 4;
  const Driven four = drive(2, g, 8, rank_grad);
  for (std::size_t k = 1; k <= 8; ++k) {
    EXPECT_EQ(one.bytes[k] > 0, k == 8) << k;
    EXPECT_EQ(four.bytes[k] > 0, k % 2 == 0) << k;
    if (k % 2 == 0) {
      EXPECT_EQ(four.bytes[k] * 4, one.bytes[8]) << k;
    }
  }
  EXPECT_GT(one.bytes[8], 0u);
  // The fragment synced at 8 (unit 3) is the same on both ranks.
  const std::size_t at = four.unit_at[3];
  EXPECT_TRUE(std::equal(four.params[8][0].begin() + at, four.params[8][0].begin() + at + 64,
                         four.params[8][1].begin() + at));
  EXPECT_FALSE(std::equal(four.params[8][0].begin(), four.params[8][0].begin() + 64, four.params[8][1].begin()));
}

TEST(GossipTraining, CompressedPseudoGradientsSendFewerBytesAndErrorFeedbackKeepsTheSum) {
  // H = 1, P = 1, tau = 0; both ranks move by the same vector v each step
  // (their inner gradient times n times lr 1), so the averaged
  // pseudo-gradient is what the wire keeps of v: a block of 64 holding 7
  // and 63 times 0.4 has the int4 scale 1, and 0.4 rounds to 0. Without
  // error feedback those never move; with it they move by 10 * 0.4 over 10
  // syncs, to half a step (0.5).
  auto v = [](int, std::size_t i) { return (i % 64 == 0 ? 7.0f : 0.4f) / 2.0f; };
  parallel::GossipOptions g = plain_outer(1);
  g.outer_momentum = 0.0;
  auto drive_lr1 = [&](const parallel::GossipOptions& o) {
    const Driven d = drive(2, o, 10, v, /*lr=*/1.0, /*init_scale=*/0.0f);
    std::uint64_t bytes = 0;
    for (std::uint64_t b : d.bytes) bytes += b;
    const std::vector<float>& p = d.params[10][0];
    return std::make_pair(std::vector<float>(p.begin() + d.unit_at[0], p.begin() + d.unit_at[0] + 64),
                          static_cast<float>(bytes));
  };
  const auto [f32, f32_bytes] = drive_lr1(g);
  g.outer_dtype = "int4";
  const auto [plain, int4_bytes] = drive_lr1(g);
  g.outer_error_feedback = true;
  const auto [fed, fed_bytes] = drive_lr1(g);
  EXPECT_NEAR(f32[0], -70.0f, 1e-3);
  EXPECT_NEAR(f32[1], -4.0f, 1e-4);
  EXPECT_EQ(plain[0], -70.0f);
  EXPECT_EQ(plain[1], 0.0f);  // lost every time
  EXPECT_NEAR(fed[1], -4.0f, 0.5f);
  // Bytes: an f32 all-reduce of 256 values at 2 ranks sends 1024 per sync;
  // the int4 all-gather sends the rank's 4 scales and 128 bytes of codes.
  EXPECT_EQ(f32_bytes, 10 * 1024.0f);
  EXPECT_EQ(int4_bytes, 10.0f * static_cast<float>(gossip::wire_bytes(gossip::WireDType::int4, 256)));
  EXPECT_EQ(fed_bytes, int4_bytes);
}

TEST(GossipTraining, SgpOnTheCompleteGraphIsAllReduceSgd) {
  // Mixing with every rank after every step averages exactly: the same as
  // all-reducing the gradients, up to the order of the sums (momentum is
  // linear, so local buffers average to ddp's).
  train::TrainConfig sgp = base("sgp", {{"lr", 0.05}, {"momentum", 0.9}});
  sgp.parallel.gossip.topology = "complete";
  const train::TrainConfig ddp = base("ddp", {{"lr", 0.05}, {"momentum", 0.9}});
  for (int n : {2, 3, 4}) {
    const train::TrainResult a = run(n, sgp), b = run(n, ddp);
    EXPECT_LT(max_rel_diff(a.params, b.params), 1e-4) << n;
    EXPECT_LT(a.consensus_distance, 1e-9) << n;
  }
}

TEST(GossipTraining, SgpWithLrZeroKeepsTheAverageAndReachesConsensus) {
  // Ranks start from different parameters; with lr 0 gossip alone must keep
  // their average and, on the exponential graph with 4 ranks, reach it
  // exactly in log2(4) = 2 rounds.
  const data::Split& d = data_set();
  auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 12});
  const parallel::FlatLayout layout = parallel::flat_layout(*model);
  spawn(4, [&](Communicator& comm) {
    std::vector<float> init(layout.elements);
    model->init(init, 100 + static_cast<std::uint64_t>(comm.rank()));
    auto s = parallel::make_strategy("sgp", comm, layout, init, {"sgd", {{"lr", 0.0}}});
    const std::vector<float> before = s->gather_params();
    const double d0 = s->consensus_distance();
    EXPECT_GT(d0, 1e-3);
    for (int round = 0; round < 2; ++round) {
      for (std::size_t u = 0; u < layout.units.size(); ++u) {
        auto g = s->access().grads(u);
        std::fill(g.begin(), g.end(), 0.0f);
        s->access().grads_done(u);
      }
      s->step();
    }
    EXPECT_LT(s->consensus_distance(), 1e-12 * d0 + 1e-12);
    const std::vector<float> after = s->gather_params();
    EXPECT_LT(max_rel_diff(after, before), 1e-5);  // float rounding of the halvings and sums
  });
}

TEST(GossipTraining, AdPsgdWithLrZeroKeepsTheAverageAndReachesConsensus) {
  // As for sgp: different starts, lr 0, the pairwise averages alone. Four
  // ranks reach the average exactly after two rounds; three (one resting
  // per round) approach it geometrically.
  const data::Split& d = data_set();
  auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 12});
  const parallel::FlatLayout layout = parallel::flat_layout(*model);
  for (int n : {3, 4}) {
    spawn(n, [&](Communicator& comm) {
      std::vector<float> init(layout.elements);
      model->init(init, 100 + static_cast<std::uint64_t>(comm.rank()));
      parallel::StrategyOptions o;
      o.gossip.synch_freq = 1;
      auto s = parallel::make_strategy("adpsgd", comm, layout, init, {"sgd", {{"lr", 0.0}}}, o);
      const std::vector<float> before = s->gather_params();
      const double d0 = s->consensus_distance();
      EXPECT_GT(d0, 1e-3);
      const int steps = n == 4 ? 2 : 30;
      for (int step = 0; step < steps; ++step) {
        for (std::size_t u = 0; u < layout.units.size(); ++u) {
          auto g = s->access().grads(u);
          std::fill(g.begin(), g.end(), 0.0f);
          s->access().grads_done(u);
        }
        s->step();
      }
      EXPECT_LT(s->consensus_distance(), (n == 4 ? 1e-12 : 1e-9) * d0) << n;  // waits for every round allowed
      EXPECT_LT(max_rel_diff(s->gather_params(), before), 1e-5) << n;
    });
  }
}

TEST(GossipTraining, AdPsgdOnOneRankIsPlainSgd) {
  // No partner, no gossip thread: the same bits as ddp on one rank.
  const train::TrainConfig c = base("adpsgd", {{"lr", 0.05}, {"momentum", 0.9}});
  const train::TrainResult a = run(1, c), b = run(1, base("ddp", {{"lr", 0.05}, {"momentum", 0.9}}));
  EXPECT_EQ(a.params, b.params);
}

TEST(GossipTraining, AFailingRankEndsEveryGossipRankWithItsError) {
  // Rank 1 fails between steps, with gossip in flight (osgp's rounds,
  // dpsgd's exchange, adpsgd's gossip thread): every rank ends, promptly,
  // with rank 1's error, and no thread is left running.
  const data::Split& d = data_set();
  auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 12});
  const parallel::FlatLayout layout = parallel::flat_layout(*model);
  for (const char* strategy : {"sgp", "osgp", "dpsgd", "adpsgd", "slowmo"}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      spawn(4, [&](Communicator& comm) {
        comm.set_timeout(std::chrono::seconds(30));
        std::vector<float> init(layout.elements);
        model->init(init, 1);
        parallel::StrategyOptions o;
        o.gossip.synch_freq = 2;
        o.gossip.slowmo_base = "sgp";
        auto s = parallel::make_strategy(strategy, comm, layout, init, {"sgd", {{"lr", 0.1}}}, o);
        for (int step = 0; step < 6; ++step) {
          if (step == 3 && comm.rank() == 1) throw IoError("rank 1 lost its disk");
          for (std::size_t u = 0; u < layout.units.size(); ++u) {
            auto g = s->access().grads(u);
            std::fill(g.begin(), g.end(), 0.01f);
            s->access().grads_done(u);
          }
          s->step();
          (void)s->consensus_distance();  // a collective per step, as the trainer's loss gather
        }
      });
      ADD_FAILURE() << "no error under " << strategy;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 lost its disk"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << strategy << ": no hang";
  }
}

TEST(GossipTraining, EveryStrategyLearnsAtOddWorldsWithAdamClippingSchedulesAndSwaOrEma) {
  const train::TrainResult ddp = run(3, base("ddp", {{"lr", 0.1}}));
  for (std::string strategy : {"sgp", "osgp", "dpsgd", "adpsgd", "slowmo"}) {
    for (int n : {1, 3, 5}) {
      if (strategy == "dpsgd" && n % 2 != 0 && n > 1) continue;  // its bipartite graph needs an even world
      train::TrainConfig c = base(strategy, {});
      c.optimizer = {"adam", {{"lr", 3e-3}}};
      c.epochs = 3;
      c.clip_grad_norm = 5.0;
      c.scheduler = SchedulerSpec{"steplr", {{"step_size", 10.0}, {"gamma", 0.9}}, {}};
      if (n == 3) {
        c.swa_start = 2;  // SWA over epochs 2 and 3
      } else {
        c.ema_decay = 0.9;
      }
      if (strategy == "osgp" || strategy == "adpsgd") c.parallel.gossip.synch_freq = 1;
      const train::TrainResult r = run(n, c);
      EXPECT_GT(r.test_accuracy, 0.6) << strategy << " n=" << n;
      ASSERT_TRUE(r.averaged) << strategy;
      EXPECT_GT(r.averaged->test_accuracy, 0.5) << strategy << " n=" << n;
      if (n == 1) {
        EXPECT_EQ(r.consensus_distance, 0.0) << strategy;
      }
    }
  }
  // dpsgd on odd worlds: another topology.
  train::TrainConfig c = base("dpsgd", {{"lr", 0.1}});
  c.parallel.gossip.topology = "ring";
  EXPECT_GT(run(5, c).test_accuracy, 0.5 * ddp.test_accuracy);
}

TEST(GossipTraining, BadOptionsAreOneLineErrors) {
  train::TrainConfig c = base("sgp", {{"lr", 0.1}});
  c.parallel.gossip.topology = "hypercube";
  EXPECT_THROW(run(2, c), InvalidInput);
  c = base("dpsgd", {{"lr", 0.1}});
  try {
    run(3, c);
    FAIL();
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("bipartite-exponential needs an even world size (got 3)"), std::string::npos);
  }
  c = base("sgp", {{"lr", 0.1}});
  c.parallel.param_dtype = DType::bf16;
  EXPECT_THROW(run(2, c), InvalidInput);
  c = base("slowmo", {{"lr", 0.1}});
  c.parallel.gossip.slowmo_momentum = 1.0;
  EXPECT_THROW(run(2, c), InvalidInput);
  c = base("adpsgd", {{"lr", 0.1}});
  c.parallel.gossip.topology = "ring";
  EXPECT_THROW(run(2, c), InvalidInput);
}
