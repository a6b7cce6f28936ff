// Gossip topologies and push-sum averaging (docs/gossip.md).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>
#include <thread>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/gossip/compress.hpp"
#include "distopt/gossip/pairwise.hpp"
#include "distopt/gossip/push_sum.hpp"
#include "distopt/gossip/topology.hpp"

using namespace distopt;
using gossip::Topology;

namespace {

// Every topology at every world size it accepts, up to `max_world`.
std::vector<Topology> all_topologies(int max_world) {
  std::vector<Topology> out;
  for (int n = 1; n <= max_world; ++n)
    for (std::string_view name : gossip::topology_names()) {
      if (name == "bipartite-exponential" && n % 2 != 0) continue;
      if (name == "exponential-k") {
        for (int k = 2; k < n && k <= 3; ++k) out.emplace_back(name, n, k);
        continue;
      }
      out.emplace_back(name, n);
    }
  return out;
}

std::string label(const Topology& t) {
  return str(t.name(), " n=", t.world(), t.name() == "exponential-k" ? str(" k=", t.peers_per_iteration()) : "");
}

}  // namespace

TEST(Topology, EveryRanksInAndOutPeersAgree) {
  for (const Topology& t : all_topologies(17))
    for (std::uint64_t k = 0; k < 2 * t.period() + 1; ++k)
      for (int i = 0; i < t.world(); ++i) {
        const gossip::Peers p = t.peers(i, k);
        EXPECT_EQ(p.in.size(), p.in_weights.size());
        for (int j : p.out) {
          ASSERT_NE(j, i) << label(t);
          const gossip::Peers q = t.peers(j, k);
          const auto at = std::find(q.in.begin(), q.in.end(), i);
          ASSERT_NE(at, q.in.end()) << label(t) << " k=" << k << ": " << i << " sends to " << j << ", which does not expect it";
          EXPECT_EQ(q.in_weights[at - q.in.begin()], p.out_weight) << label(t);
        }
        for (int j : p.in) {
          const gossip::Peers q = t.peers(j, k);
          EXPECT_NE(std::find(q.out.begin(), q.out.end(), i), q.out.end()) << label(t) << ": " << i << " expects " << j;
        }
        std::vector<int> sorted = p.out;
        std::sort(sorted.begin(), sorted.end());
        EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << label(t) << ": a peer twice";
      }
}

TEST(Topology, MixingMatricesAreColumnStochasticAndDoublyStochastic) {
  // Column sums of 1: push-sum conserves mass. Row sums of 1 as well: the
  // same matrices serve D-PSGD's doubly stochastic mixing.
  for (const Topology& t : all_topologies(17)) {
    const auto n = static_cast<std::size_t>(t.world());
    for (std::uint64_t k = 0; k < t.period(); ++k) {
      const std::vector<double> w = t.mixing_matrix(k);
      for (std::size_t a = 0; a < n; ++a) {
        double col = 0, row = 0;
        for (std::size_t b = 0; b < n; ++b) {
          EXPECT_GE(w[b * n + a], 0.0);
          col += w[b * n + a];
          row += w[a * n + b];
        }
        EXPECT_NEAR(col, 1.0, 1e-15) << label(t) << " column " << a;
        EXPECT_NEAR(row, 1.0, 1e-15) << label(t) << " row " << a;
      }
    }
  }
}

TEST(Topology, TheGraphsOfTheSgpCode) {
  auto seq = [](const Topology& t, std::uint64_t iterations) {
    std::vector<std::vector<int>> out;
    for (std::uint64_t k = 0; k < iterations; ++k) out.push_back(t.distances(k));
    return out;
  };
  using V = std::vector<std::vector<int>>;
  // NPeerDynamicDirectedExponentialGraph: 2^(k mod m), m = floor(log2(n-1)) + 1.
  EXPECT_EQ(seq(Topology("exponential", 8), 4), (V{{1}, {2}, {4}, {1}}));
  EXPECT_EQ(seq(Topology("exponential", 6), 4), (V{{1}, {2}, {4}, {1}}));
  EXPECT_EQ(seq(Topology("exponential", 2), 2), (V{{1}, {1}}));
  // DynamicDirectedExponentialGraph: +1, -1, +2, -2, ..., duplicates removed (2m - 1 entries).
  EXPECT_EQ(seq(Topology("exponential-pm", 4), 4), (V{{1}, {3}, {2}, {1}}));
  EXPECT_EQ(Topology("exponential-pm", 8).period(), 5u);
  // With 2 peers per iteration: distances j 3^i, j = 1, 2, taken two at a time.
  EXPECT_EQ(seq(Topology("exponential-k", 9, 2), 3), (V{{1, 2}, {3, 6}, {1, 2}}));
  // DynamicBipartiteExponentialGraph: +-1, +-(1 + 2^i): odd distances only.
  EXPECT_EQ(seq(Topology("bipartite-exponential", 8), 5), (V{{1}, {7}, {3}, {5}, {1}}));
  EXPECT_TRUE(Topology("bipartite-exponential", 8).passive(2));
  EXPECT_FALSE(Topology("bipartite-exponential", 8).passive(3));
  EXPECT_EQ(Topology("static-exponential", 8).distances(5), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(Topology("ring", 5).distances(0), (std::vector<int>{1, 4}));
  EXPECT_EQ(Topology("ring", 2).distances(0), (std::vector<int>{1}));
  EXPECT_EQ(Topology("complete", 4).distances(0), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(Topology("complete", 1).distances(0).empty());
  const gossip::Peers p = Topology("ring", 5).peers(0, 0);
  EXPECT_EQ(p.out, (std::vector<int>{1, 4}));
  EXPECT_EQ(p.in, (std::vector<int>{4, 1}));
  EXPECT_DOUBLE_EQ(p.self_weight, 1.0 / 3);
}

TEST(Topology, PredictedRatesAreTheKnownOnes) {
  const double pi = std::acos(-1.0);
  EXPECT_NEAR(Topology("ring", 8).predicted_rate(), (1 + 2 * std::cos(2 * pi / 8)) / 3, 1e-12);
  EXPECT_NEAR(Topology("ring", 16).predicted_rate(), 0.949, 5e-4);
  EXPECT_NEAR(Topology("directed-ring", 8).predicted_rate(), std::cos(pi / 8), 1e-12);
  EXPECT_NEAR(Topology("static-exponential", 8).predicted_rate(), 0.5, 1e-12);
  EXPECT_NEAR(Topology("static-exponential", 16).predicted_rate(), 0.6, 1e-12);
  EXPECT_NEAR(Topology("exponential", 8).predicted_rate(), 0.0, 1e-12);   // exact after log2(8) rounds
  EXPECT_NEAR(Topology("exponential-pm", 8).predicted_rate(), 0.0, 1e-12);
  EXPECT_NEAR(Topology("exponential", 6).predicted_rate(), 0.6005, 1e-4);  // the spec's measured 0.60
  EXPECT_NEAR(Topology("complete", 5).predicted_rate(), 0.0, 1e-12);
}

TEST(Topology, PredictedRateMatchesThePowerIterationOfTheMixingMatrices) {
  // An independent computation: the spectral norm of (product of one
  // period's matrices - 11^T/n) by power iteration, to the power 1/period.
  // (The product is circulant, hence normal: norm = spectral radius.)
  for (const Topology& t : all_topologies(13)) {
    const int n = t.world();
    if (n < 3) continue;
    std::vector<double> prod(n * n, 0.0);
    for (int i = 0; i < n; ++i) prod[i * n + i] = 1;
    for (std::uint64_t k = 0; k < t.period(); ++k) {
      const std::vector<double> w = t.mixing_matrix(k);
      std::vector<double> next(n * n, 0.0);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
          for (int l = 0; l < n; ++l) next[i * n + j] += w[i * n + l] * prod[l * n + j];
      prod = next;
    }
    for (double& v : prod) v -= 1.0 / n;
    std::vector<double> v(n);
    Rng rng(7);
    for (double& e : v) e = rng.normal();
    double norm = 0;
    for (int it = 0; it < 2000; ++it) {
      std::vector<double> a(n, 0.0), b(n, 0.0);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) a[i] += prod[i * n + j] * v[j];
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) b[j] += prod[i * n + j] * a[i];
      double s = 0;
      for (double e : b) s += e * e;
      s = std::sqrt(s);
      if (s < 1e-300) {
        norm = 0;
        break;
      }
      norm = std::sqrt(s);
      for (int i = 0; i < n; ++i) v[i] = b[i] / s;
    }
    const double rate = std::pow(norm, 1.0 / static_cast<double>(t.period()));
    EXPECT_NEAR(t.predicted_rate(), rate, 1e-6) << label(t);
  }
}

TEST(Topology, BadInputIsOneClearLine) {
  try {
    Topology("hypercube", 4);
    FAIL();
  } catch (const InvalidInput& e) {
    EXPECT_EQ(std::string(e.what()),
              "unknown topology 'hypercube' (known: exponential, exponential-pm, exponential-k, static-exponential, "
              "ring, directed-ring, bipartite-exponential, complete)");
  }
  EXPECT_THROW(Topology("exponential-k", 4, 4), InvalidInput);
  EXPECT_THROW(Topology("exponential-k", 4, 0), InvalidInput);
  EXPECT_THROW(Topology("ring", 4, 2), InvalidInput);
  EXPECT_THROW(Topology("bipartite-exponential", 5), InvalidInput);
  EXPECT_NO_THROW(Topology("exponential-k", 4, 3));
}

namespace {

// Runs `rounds` of push-sum from random vectors on a threads world.
gossip::AverageReport average(const Topology& t, std::uint64_t rounds, std::size_t dim = 257) {
  gossip::AverageReport out;
  spawn(t.world(), [&](Communicator& c) {
    gossip::AverageReport r = gossip::average_random_vectors(c, t, rounds, dim, 11);
    if (c.rank() == 0) out = std::move(r);
  });
  return out;
}

}  // namespace

TEST(PushSum, ExactConsensusAfterLog2nRoundsWhenNIsAPowerOfTwo) {
  for (int n : {2, 4, 8, 16}) {
    const int m = std::bit_width(static_cast<unsigned>(n - 1));
    const gossip::AverageReport r = average(Topology("exponential", n), m);
    EXPECT_GT(r.errors[m - 1], 1e-3) << n << ": not exact one round earlier";
    EXPECT_LT(r.max_abs_error, 2e-6) << n;  // float rounding of values ~ N(0, 1)
    EXPECT_EQ(r.weight_sum_error, 0.0) << n;
    // The +-2^i cycle takes 2m - 1 rounds.
    const gossip::AverageReport pm = average(Topology("exponential-pm", n), 2 * m - 1);
    EXPECT_LT(pm.max_abs_error, 2e-6) << n;
  }
}

TEST(PushSum, OtherWorldsConvergeAtTheRateTheMixingMatrixPredicts) {
  for (int n : {6, 12}) {
    const Topology t("exponential", n);
    const gossip::AverageReport r = average(t, 40, 4096);
    // Whole periods, from the first period's end to the last one still far
    // above float rounding.
    const std::uint64_t p = t.period();
    std::uint64_t last = p;
    while (last + p < r.errors.size() && r.errors[last + p] > 1e-4 * r.errors[p]) last += p;
    ASSERT_GE(last, 3 * p) << n;
    const double measured = std::pow(r.errors[last] / r.errors[p], 1.0 / static_cast<double>(last - p));
    EXPECT_NEAR(measured / t.predicted_rate(), 1.0, 0.1) << n << ": measured " << measured << " predicted "
                                                         << t.predicted_rate();
  }
}

TEST(PushSum, GossipKeepsTheSumAndTheWeightsCountingMessagesInFlight) {
  // Invariants (a) and (b) of the spec: the sum of the numerators and of
  // the weights, counting what is in flight, never change.
  for (const Topology& t : {Topology("ring", 5), Topology("exponential", 7), Topology("exponential-k", 7, 2),
                            Topology("bipartite-exponential", 6), Topology("complete", 3), Topology("ring", 1)}) {
    spawn(t.world(), [&](Communicator& c) {
      const std::size_t dim = 33;
      std::vector<float> x(dim);
      Rng rng(3, c.rank());
      for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1));
      auto totals = [&](double w, double in_flight) {
        std::vector<double> s(dim + 1);
        for (std::size_t i = 0; i < dim; ++i) s[i] = x[i];
        s[dim] = w + in_flight;
        c.all_reduce(s.data(), s.data(), s.size(), ElemType::f64, ReduceOp::sum);
        return s;
      };
      double w = 1.0;
      const std::vector<double> before = totals(w, 0);
      gossip::PushSum g(c, t, dim);
      for (int round = 0; round < 9; ++round) {
        g.start(x, w);
        // Mid-round: the kept parts plus the weight in flight.
        EXPECT_NEAR(totals(w, g.weight_in_flight())[dim], t.world(), 1e-12) << label(t);
        g.finish(x, w);
      }
      const std::vector<double> after = totals(w, 0);
      EXPECT_NEAR(after[dim], t.world(), 1e-12) << label(t);
      for (std::size_t i = 0; i < dim; ++i) EXPECT_NEAR(after[i], before[i], 1e-5) << label(t) << " element " << i;
      EXPECT_EQ(g.iteration(), 9u);
    });
  }
}

TEST(PushSum, ASilentPeerIsATimeOutNamingIt) {
  const Topology t("directed-ring", 3);
  try {
    spawn(3, [&](Communicator& c) {
      if (c.rank() == 2) return;  // never gossips
      std::vector<float> x(8, 1.0f);
      double w = 1;
      gossip::PushSum g(c, t, x.size());
      g.mix(x, w);
    }, std::chrono::milliseconds(300));
    FAIL() << "no error";
  } catch (const CommTimeout& e) {
    // Rank 0 receives from rank 2 on the directed ring.
    EXPECT_NE(std::string(e.what()).find("recv on rank 0: timed out after 0.3 s waiting for rank 2"), std::string::npos)
        << e.what();
  }
}

TEST(PushSum, OneRankIsItsOwnAverage) {
  const Topology t("exponential", 1);
  spawn(1, [&](Communicator& c) {
    std::vector<float> x{1.5f, -2.0f};
    double w = 1;
    gossip::PushSum g(c, t, x.size());
    g.mix(x, w);
    EXPECT_EQ(x, (std::vector<float>{1.5f, -2.0f}));
    EXPECT_EQ(w, 1.0);
  });
}

// ---- AD-PSGD's pairwise averaging ----

TEST(Pairwise, EveryRoundIsAMatchingAndTheRoundsConnectEveryRank) {
  for (int n = 1; n <= 17; ++n) {
    std::vector<int> component(n);  // union-find over the pairs of 2n rounds
    std::iota(component.begin(), component.end(), 0);
    auto root = [&](int i) {
      while (component[i] != i) i = component[i];
      return i;
    };
    for (std::uint64_t r = 0; r < 2 * static_cast<std::uint64_t>(n); ++r) {
      int resting = 0;
      for (int i = 0; i < n; ++i) {
        const int p = gossip::pairwise_partner(i, n, r);
        if (p < 0) {
          ++resting;
          continue;
        }
        ASSERT_NE(p, i) << n;
        ASSERT_EQ(gossip::pairwise_partner(p, n, r), i) << "n=" << n << " round " << r << ": " << i << " -> " << p;
        if (n % 2 == 0) {
          EXPECT_NE(p % 2, i % 2) << "n=" << n << ": bipartite";
        }
        component[root(i)] = root(p);
      }
      EXPECT_EQ(resting, n == 1 ? 1 : n % 2) << "n=" << n << " round " << r;
      if (n % 2 == 1 && n > 1) {
        EXPECT_LT(gossip::pairwise_partner(static_cast<int>((2 * r) % n), n, r), 0) << n;
      }
    }
    for (int i = 0; i < n; ++i) EXPECT_EQ(root(i), root(0)) << "n=" << n << ": rank " << i << " never mixes with 0";
  }
}

namespace {

// Each rank's vector after `rounds` pairwise rounds from its own random
// start, with `update` run by the owner between allowing rounds; returns
// the all-reduced sums before and after and the spread after.
struct PairwiseRun {
  std::vector<double> sum_before, sum_after, added;
  double spread_before = 0, spread_after = 0;
};

PairwiseRun pairwise_run(Communicator& c, int rounds, std::size_t dim, bool owner_updates) {
  std::vector<float> x(dim);
  Rng rng(11, c.rank());
  for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1));
  auto sums = [&] {
    std::vector<double> s(x.begin(), x.end());
    c.all_reduce(s.data(), s.data(), s.size(), ElemType::f64, ReduceOp::sum);
    return s;
  };
  auto spread = [&](const std::vector<double>& sum) {
    double worst = 0;
    for (std::size_t i = 0; i < dim; ++i) worst = std::max(worst, std::abs(x[i] - sum[i] / c.size()));
    c.all_reduce(&worst, &worst, 1, ElemType::f64, ReduceOp::max);
    return worst;
  };
  PairwiseRun out;
  out.sum_before = sums();
  out.spread_before = spread(out.sum_before);
  out.added.assign(dim, 0.0);
  auto pair_comm = c.split(0, c.rank());
  std::mutex m;
  {
    gossip::AsyncPairwise g(*pair_comm, x, m);
    for (int r = 1; r <= rounds; ++r) {
      g.allow(static_cast<std::uint64_t>(r));
      if (owner_updates) {
        // A "gradient step" while rounds are in flight: kept whole.
        std::lock_guard lock(m);
        for (std::size_t i = 0; i < dim; ++i) {
          const float before = x[i];
          x[i] += 0.01f * static_cast<float>(c.rank() + 1);
          out.added[i] += static_cast<double>(x[i]) - before;
        }
      }
      if (r > 2) g.wait_for(static_cast<std::uint64_t>(r - 2));
    }
    g.finish();
    EXPECT_EQ(g.completed(), static_cast<std::uint64_t>(rounds));
  }
  c.all_reduce(out.added.data(), out.added.data(), dim, ElemType::f64, ReduceOp::sum);
  out.sum_after = sums();
  out.spread_after = spread(out.sum_after);
  return out;
}

}  // namespace

TEST(Pairwise, AveragingKeepsTheSumAndReachesConsensus) {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    spawn(n, [&](Communicator& c) {
      const PairwiseRun r = pairwise_run(c, 60, 257, false);
      for (std::size_t i = 0; i < r.sum_before.size(); ++i)
        ASSERT_NEAR(r.sum_after[i], r.sum_before[i], 1e-5 * n) << "n=" << n << " element " << i;
      if (n == 1) {
        EXPECT_EQ(r.spread_after, 0.0);
      } else {
        EXPECT_LT(r.spread_after, 1e-5 * r.spread_before) << "n=" << n;
      }
    });
  }
  // Four ranks on distances 1 and 3: exact after two rounds; eight after three.
  spawn(4, [&](Communicator& c) { EXPECT_LT(pairwise_run(c, 2, 64, false).spread_after, 1e-6); });
  spawn(8, [&](Communicator& c) {
    EXPECT_LT(pairwise_run(c, 3, 64, false).spread_after, 1e-6);
    EXPECT_GT(pairwise_run(c, 2, 64, false).spread_after, 1e-2);
  });
}

TEST(Pairwise, WhatTheOwnersAddWhileRoundsAreInFlightIsKeptWhole) {
  // The delta form: the sum after is the sum before plus every rank's
  // additions, however the additions and the rounds interleaved; so no
  // round was lost or half-applied at shutdown either.
  for (int n : {2, 3, 6}) {
    spawn(n, [&](Communicator& c) {
      const PairwiseRun r = pairwise_run(c, 200, 100, true);
      for (std::size_t i = 0; i < r.sum_before.size(); ++i)
        ASSERT_NEAR(r.sum_after[i], r.sum_before[i] + r.added[i], 2e-5 * n) << "n=" << n << " element " << i;
    });
  }
}

TEST(Pairwise, ASilentPartnerIsATimeOutNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  try {
    spawn(2, [&](Communicator& c) {
      auto pair_comm = c.split(0, c.rank());
      std::vector<float> x(16, 1.0f);
      std::mutex m;
      gossip::AsyncPairwise g(*pair_comm, x, m);
      if (c.rank() == 1) {
        // Allows nothing and stays until the others have timed out.
        std::this_thread::sleep_for(std::chrono::seconds(1));
        return;
      }
      g.allow(3);
      g.wait_for(3);
    }, std::chrono::milliseconds(300));
    FAIL() << "no error";
  } catch (const CommTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("adpsgd on rank 0: timed out after 0.3 s receiving from rank 1 in pairwise round 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(Pairwise, AnOwnerFailingMidRoundEndsEveryRankPromptly) {
  // Rank 3 throws with rounds allowed that its partners wait for: its own
  // gossip thread stops at once (no join on a round that cannot finish),
  // and the others are woken by the world's abort, not by a time-out.
  const auto start = std::chrono::steady_clock::now();
  try {
    spawn(4, [&](Communicator& c) {
      auto pair_comm = c.split(0, c.rank());
      std::vector<float> x(1 << 16, 1.0f);
      std::mutex m;
      gossip::AsyncPairwise g(*pair_comm, x, m);
      if (c.rank() == 3) {
        g.allow(1);
        throw IoError("rank 3 lost its disk");
      }
      g.allow(50);
      g.wait_for(50);
    }, std::chrono::seconds(60));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3 lost its disk"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// Compressed vectors on the wire (gossip/compress.hpp): the e4m3 format's
// own values (OCP 8-bit floating point, E4M3: bias 7, no infinities, the
// all-ones pattern is NaN), rounding to nearest even, the scaled blocks.
TEST(Compress, E4m3IsTheFormatsTable) {
  EXPECT_EQ(gossip::e4m3_to_float(0x38), 1.0f);      // exponent 7 = bias
  EXPECT_EQ(gossip::e4m3_to_float(0x7e), 448.0f);    // the largest
  EXPECT_EQ(gossip::e4m3_to_float(0x08), 0x1p-6f);   // the smallest normal
  EXPECT_EQ(gossip::e4m3_to_float(0x01), 0x1p-9f);   // the smallest subnormal
  EXPECT_EQ(gossip::e4m3_to_float(0xbc), -1.5f);
  EXPECT_TRUE(std::isnan(gossip::e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(gossip::e4m3_to_float(0xff)));
  // Every finite code comes back to itself, and the codes are in order.
  float previous = -1;
  for (int c = 0; c < 0x7f; ++c) {
    const float v = gossip::e4m3_to_float(static_cast<std::uint8_t>(c));
    EXPECT_GT(v, previous) << c;
    previous = v;
    EXPECT_EQ(gossip::float_to_e4m3(v), c) << v;
    EXPECT_EQ(gossip::float_to_e4m3(-v), c | 0x80) << v;
  }
  // Ties go to the even code; beyond 448 saturates; NaN and infinity are NaN.
  EXPECT_EQ(gossip::float_to_e4m3(1.0625f), 0x38);  // between 1 (0x38) and 1.125 (0x39)
  EXPECT_EQ(gossip::float_to_e4m3(1.1875f), 0x3a);  // between 1.125 and 1.25 (0x3a)
  EXPECT_EQ(gossip::float_to_e4m3(1.07f), 0x39);
  EXPECT_EQ(gossip::float_to_e4m3(0x1p-10f), 0x00);  // half the smallest subnormal: to even (0)
  EXPECT_EQ(gossip::float_to_e4m3(0x1.8p-9f), 0x02);  // 1.5 subnormal steps: to 2
  EXPECT_EQ(gossip::float_to_e4m3(0x1.ep-7f), 0x08);  // 7.5 steps: to 8, the smallest normal
  EXPECT_EQ(gossip::float_to_e4m3(460.0f), 0x7e);
  EXPECT_EQ(gossip::float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(gossip::float_to_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(gossip::float_to_e4m3(std::nanf("")), 0x7f);
  EXPECT_EQ(gossip::float_to_e4m3(-INFINITY), 0xff);
}

TEST(Compress, BlocksRoundWithinHalfAStepOfTheirScale) {
  const std::size_t n = 200;  // 4 blocks, the last of 8
  std::vector<float> v(n);
  Rng rng(5);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(rng.normal()) * (i < 64 ? 1e-3f : 3.0f);
  EXPECT_EQ(gossip::wire_bytes(gossip::WireDType::f32, n), 800u);
  EXPECT_EQ(gossip::wire_bytes(gossip::WireDType::bf16, n), 400u);
  EXPECT_EQ(gossip::wire_bytes(gossip::WireDType::fp8, n), 16u + 200u);
  EXPECT_EQ(gossip::wire_bytes(gossip::WireDType::int4, n), 16u + 100u);
  for (auto t : {gossip::WireDType::f32, gossip::WireDType::bf16, gossip::WireDType::fp8, gossip::WireDType::int4}) {
    SCOPED_TRACE(std::string(gossip::name_of(t)));
    std::vector<std::uint8_t> wire(gossip::wire_bytes(t, n));
    gossip::encode(t, v, wire.data());
    std::vector<float> back(n);
    gossip::decode(t, wire.data(), back);
    for (std::size_t b = 0; b < n; b += gossip::kWireBlock) {
      const std::size_t e = std::min(n, b + gossip::kWireBlock);
      float amax = 0;
      for (std::size_t i = b; i < e; ++i) amax = std::max(amax, std::fabs(v[i]));
      for (std::size_t i = b; i < e; ++i) {
        // Half a step: bf16's is 2^-8 of the value; fp8's 2^-4 of the value
        // (or, in the subnormals, 2^-10 of the scale); int4's half the scale.
        double bound = 0;
        if (t == gossip::WireDType::bf16) bound = std::fabs(v[i]) * 0x1p-8;
        if (t == gossip::WireDType::fp8) bound = std::max(std::fabs(v[i]) * 0x1p-4, amax / 448.0 * 0x1p-10);
        if (t == gossip::WireDType::int4) bound = amax / 7.0 / 2.0 * (1 + 1e-6);
        EXPECT_LE(std::fabs(double(back[i]) - v[i]), bound) << i;
      }
      if (t == gossip::WireDType::int4) {  // the largest is exact: +-7 times its scale
        std::size_t top = b;
        for (std::size_t i = b; i < e; ++i)
          if (std::fabs(v[i]) > std::fabs(v[top])) top = i;
        EXPECT_NEAR(back[top], v[top], std::fabs(v[top]) * 1e-6);
      }
    }
  }
  // int4 ties round to even; a block of zeros stays zeros.
  std::vector<float> ties(64, 0.0f);
  ties[0] = 7.0f;
  ties[1] = 2.5f;
  ties[2] = -3.5f;
  ties[3] = 0.5f;
  std::vector<std::uint8_t> wire(gossip::wire_bytes(gossip::WireDType::int4, 64));
  gossip::encode(gossip::WireDType::int4, ties, wire.data());
  std::vector<float> back(64);
  gossip::decode(gossip::WireDType::int4, wire.data(), back);
  EXPECT_EQ(back[0], 7.0f);
  EXPECT_EQ(back[1], 2.0f);
  EXPECT_EQ(back[2], -4.0f);
  EXPECT_EQ(back[3], 0.0f);
  EXPECT_EQ(back[4], 0.0f);
  for (auto t : {gossip::WireDType::fp8, gossip::WireDType::int4}) {  // scale 0
    std::vector<float> zeros(70, 0.0f);
    std::vector<std::uint8_t> w(gossip::wire_bytes(t, zeros.size()), 0xff);
    gossip::encode(t, zeros, w.data());
    std::vector<float> out(zeros.size(), 1.0f);
    gossip::decode(t, w.data(), out);
    EXPECT_EQ(out, zeros) << gossip::name_of(t);
  }
}

TEST(Compress, ANonFiniteValuePoisonsItsBlockOnly) {
  for (auto t : {gossip::WireDType::bf16, gossip::WireDType::fp8, gossip::WireDType::int4}) {
    std::vector<float> v(128, 1.0f);
    v[70] = INFINITY;
    std::vector<std::uint8_t> wire(gossip::wire_bytes(t, v.size()));
    gossip::encode(t, v, wire.data());
    std::vector<float> back(v.size());
    gossip::decode(t, wire.data(), back);
    EXPECT_EQ(back[0], 1.0f) << gossip::name_of(t);
    EXPECT_FALSE(std::isfinite(back[70])) << gossip::name_of(t);
    if (t != gossip::WireDType::bf16) {
      EXPECT_TRUE(std::isnan(back[64])) << gossip::name_of(t);
    }
  }
  gossip::WireDType t;
  EXPECT_TRUE(gossip::parse_wire_dtype("int4", &t));
  EXPECT_EQ(t, gossip::WireDType::int4);
  EXPECT_FALSE(gossip::parse_wire_dtype("int8", &t));
}
