// The gloo backend (include/distopt/comm/gloo.hpp). Each rank opens a world
// of its own -- its own rendezvous files, heartbeat, TCP pairs -- as a
// process would; here they are threads of the test, so that the results
// can be compared with the threads backend's in one place. The commands'
// checks with real processes (kill -9, SIGSTOP) are in cli_gloo_test.sh.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

#include "distopt/comm/gloo.hpp"
#include "distopt/comm/threads.hpp"
#include "free_port.hpp"

namespace distopt {
namespace {

using namespace std::chrono_literals;

std::string fresh_dir(const std::string& name) {
  const auto d = std::filesystem::temp_directory_path() / ("distopt-gloo-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(d);
  return d.string();
}

// A TCP rendezvous (rank 0's store) on a free port of the loopback.
std::string tcp_rendezvous() {
  return "tcp://127.0.0.1:" + std::to_string(free_port());
}

// Runs fn(world) for ranks 0..n-1 of a gloo world, each on a thread; a
// rank's exception fails the test.
void run_gloo(int n, const std::string& dir, std::chrono::milliseconds timeout, Elastic elastic,
              const std::function<void(GlooWorld&, int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        GlooOptions o;
        o.rendezvous = dir;
        o.rank = r;
        o.size = n;
        o.host = "127.0.0.1";
        o.timeout = timeout;
        o.elastic = elastic;
        auto world = open_gloo_world(o);
        fn(*world, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  std::filesystem::remove_all(dir);
}

std::vector<float> input(int rank, std::size_t count) {
  std::vector<float> x(count);
  for (std::size_t i = 0; i < count; ++i) x[i] = 0.1f * static_cast<float>(rank + 1) + 1e-3f * static_cast<float>(i) / 7.0f;
  return x;
}

// The same collectives on the threads backend: the reference bits.
struct Results {
  std::vector<float> reduced, scattered, gathered, broadcast, exchanged;
};
Results collectives(Communicator& c, const std::vector<std::size_t>& counts) {
  Results out;
  const std::size_t total = 1000;
  out.reduced = input(c.rank(), total);
  c.all_reduce(out.reduced.data(), out.reduced.data(), total, ElemType::f32, ReduceOp::sum);
  std::size_t sum = 0;
  for (std::size_t k : counts) sum += k;
  const std::vector<float> x = input(c.rank(), sum);
  out.scattered.resize(counts[static_cast<std::size_t>(c.rank())]);
  c.reduce_scatter_v(x.data(), out.scattered.data(), counts, ElemType::f32, ReduceOp::sum);
  out.gathered.resize(sum);
  c.all_gather_v(out.scattered.data(), out.gathered.data(), counts, ElemType::f32);
  out.broadcast = c.rank() == 1 ? input(7, 333) : std::vector<float>(333, 0.f);
  c.broadcast(out.broadcast.data(), 333, ElemType::f32, 1);
  const std::vector<float> pieces = input(c.rank(), 41 * static_cast<std::size_t>(c.size()));
  out.exchanged.resize(pieces.size());
  c.all_to_all(pieces.data(), out.exchanged.data(), 41, ElemType::f32);
  c.barrier();
  return out;
}

void collectives_bits(const std::string& rendezvous) {
  const int n = 3;
  const std::vector<std::size_t> counts = {5, 0, 17};  // uneven, one empty
  std::vector<Results> want(n), got(n);
  spawn(n, [&](Communicator& c) { want[static_cast<std::size_t>(c.rank())] = collectives(c, counts); });
  run_gloo(n, rendezvous, 20s, Elastic::off, [&](GlooWorld& w, int r) {
    EXPECT_EQ(w.comm().backend(), "gloo");
    EXPECT_EQ(w.comm().rank(), r);
    got[static_cast<std::size_t>(r)] = collectives(w.comm(), counts);
    w.finish();
  });
  for (int r = 0; r < n; ++r) {
    const auto& a = want[static_cast<std::size_t>(r)];
    const auto& b = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(a.reduced.size(), b.reduced.size());
    EXPECT_EQ(std::memcmp(a.reduced.data(), b.reduced.data(), a.reduced.size() * 4), 0) << "all_reduce, rank " << r;
    EXPECT_EQ(a.scattered, b.scattered) << "reduce_scatter_v, rank " << r;
    EXPECT_EQ(a.gathered, b.gathered) << "all_gather_v, rank " << r;
    EXPECT_EQ(a.broadcast, b.broadcast) << "broadcast, rank " << r;
    EXPECT_EQ(a.exchanged, b.exchanged) << "all_to_all, rank " << r;
  }
}

// Rank 0's TCP store, and every message on TCP (no shared-memory rings):
// what processes on several machines use.
class GlooTcp : public ::testing::Test {
 protected:
  void SetUp() override { ::setenv("DISTOPT_GLOO_SHM", "0", 1); }
  void TearDown() override { ::unsetenv("DISTOPT_GLOO_SHM"); }
};

TEST(Gloo, CollectivesHaveTheThreadsBackendsBits) {
  collectives_bits(fresh_dir("bits"));
}
TEST_F(GlooTcp, CollectivesHaveTheThreadsBackendsBits) {
  collectives_bits(tcp_rendezvous());
}

void point_to_point(const std::string& rendezvous) {
  run_gloo(3, rendezvous, 20s, Elastic::off, [&](GlooWorld& w, int r) {
    Communicator& c = w.comm();
    // A ring: each sends its rank to the next, with two tags in flight.
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    std::int32_t out[2] = {r, 100 + r}, in[2] = {-1, -1};
    auto s1 = c.isend(&out[1], 1, ElemType::i32, next, 9);
    auto s0 = c.isend(&out[0], 1, ElemType::i32, next, 4);
    auto r0 = c.irecv(&in[0], 1, ElemType::i32, prev, 4);
    auto r1 = c.irecv(&in[1], 1, ElemType::i32, prev, 9);
    r0->wait();
    r1->wait();
    s0->wait();
    EXPECT_TRUE(s1->test());
    EXPECT_EQ(in[0], prev);
    EXPECT_EQ(in[1], 100 + prev);
    // split: ranks 0 and 2 together, in reverse order; rank 1 alone.
    auto sub = c.split(r == 1 ? 1 : 0, -r);
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), r == 1 ? 1 : 2);
    EXPECT_EQ(sub->rank(), r == 2 ? 0 : 0 + (r == 0 ? 1 : 0));
    std::int64_t v = r, sum = 0;
    sub->all_reduce(&v, &sum, 1, ElemType::i64, ReduceOp::sum);
    EXPECT_EQ(sum, r == 1 ? 1 : 2);
    // Non-blocking collectives run in issue order on the progress thread.
    std::vector<float> a(64, static_cast<float>(r)), b(64, 1.f);
    auto ra = c.iall_reduce(a.data(), a.data(), 64, ElemType::f32, ReduceOp::sum);
    auto rb = c.iall_reduce(b.data(), b.data(), 64, ElemType::f32, ReduceOp::sum);
    rb->wait();
    ra->wait();
    EXPECT_EQ(a[63], 3.f);
    EXPECT_EQ(b[0], 3.f);
    w.finish();
  });
}

TEST(Gloo, PointToPointSplitAndNonBlockingCollectives) {
  point_to_point(fresh_dir("p2p"));
}
TEST_F(GlooTcp, PointToPointSplitAndNonBlockingCollectives) {
  point_to_point(tcp_rendezvous());
}

TEST(Gloo, ASilentRankIsNamedAtTheTimeOut) {
  std::atomic<bool> done{false};
  std::string what;
  std::chrono::duration<double> took{};
  run_gloo(2, fresh_dir("silent"), 1000ms, Elastic::off, [&](GlooWorld& w, int r) {
    if (r == 1) {  // connected, then silent until rank 0 gave up
      while (!done) std::this_thread::sleep_for(10ms);
      return;
    }
    float x = 1;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w.comm().all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
    } catch (const CommTimeout& e) {
      what = e.what();
    }
    took = std::chrono::steady_clock::now() - t0;
    done = true;
  });
  EXPECT_NE(what.find("reduce_scatter on rank 0: timed out after 1 s waiting for rank 1 (gloo backend)"),
            std::string::npos)
      << what;
  EXPECT_GT(took.count(), 0.9);
  EXPECT_LT(took.count(), 3.0);
}

void survivors_shrink(const std::string& rendezvous) {
  // Rank 2 of 4 leaves (its world closed: connections closed, heartbeat
  // stopped, as a killed process); the others get RankLost, re-form in
  // their old order, and sum again. A group of less than half stops.
  std::vector<int> size_after(4, -1), rank_after(4, -1);
  std::vector<float> sums(4, -1);
  run_gloo(4, rendezvous, 5000ms, Elastic::on, [&](GlooWorld& w, int r) {
    float x = 1;
    w.comm().all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
    ASSERT_EQ(x, 4.f);
    if (r == 2) return;  // gone
    try {
      for (;;) w.comm().all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
    } catch (const RankLost&) {
    }
    auto next = w.comm().shrink();
    size_after[r] = next->size();
    rank_after[r] = next->rank();
    float y = static_cast<float>(r);
    next->all_reduce(&y, &y, 1, ElemType::f32, ReduceOp::sum);
    sums[r] = y;
    EXPECT_EQ(w.members(), (std::vector<int>{0, 1, 3}));
    w.finish();
  });
  EXPECT_EQ(size_after, (std::vector<int>{3, 3, -1, 3}));
  EXPECT_EQ(rank_after, (std::vector<int>{0, 1, -1, 2}));
  EXPECT_EQ(sums, (std::vector<float>{4, 4, -1, 4}));
}

TEST(Gloo, SurvivorsOfALostRankShrinkAndGoOn) {
  survivors_shrink(fresh_dir("shrink"));
}
TEST_F(GlooTcp, SurvivorsOfALostRankShrinkAndGoOn) {
  survivors_shrink(tcp_rendezvous());
}

TEST(Gloo, AFailureFoundByOneThreadWakesAnothersWait) {
  // Ranks 0 and 1 wait on the main thread for a message the other never
  // sends, while their progress thread runs an all-reduce that finds rank
  // 2 gone: the main thread's wait ends with RankLost at once, not at the
  // time-out (closing the pairs alone would not wake it).
  std::vector<double> waited(2, -1);
  run_gloo(3, fresh_dir("wake"), 8000ms, Elastic::on, [&](GlooWorld& w, int r) {
    Communicator& c = w.comm();
    c.barrier();
    if (r == 2) return;  // gone
    std::int32_t never = 0;
    auto req = c.irecv(&never, 1, ElemType::i32, 1 - r, 5);
    float x = 1;
    auto sum = c.iall_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THROW(req->wait(), RankLost);
    waited[static_cast<std::size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_THROW(sum->wait(), RankLost);
  });
  for (double t : waited) EXPECT_LT(t, 3.0) << "the wait was not woken";
}

TEST(Gloo, AMemberThatLeavesWakesAWaitOnAMessageInTransfer) {
  // Rank 1 streams large messages to rank 2 and, with one on its way, leaves
  // the group to re-form it, as a rank that lost a peer does (its
  // connections reset). gloo wakes the waits queued on a broken pair, not
  // the one whose message it was reading: rank 2 learns that rank 1 left
  // from the rendezvous instead, at once and not at the time-out. All three
  // re-form and sum; three rounds (in one, the message may have arrived
  // whole, and rank 2's next receive fails at once anyway).
  constexpr int kRounds = 3;
  constexpr std::size_t kCount = std::size_t{16} << 20;  // 64 MiB of f32
  std::array<std::atomic<int>, kRounds> received{};
  std::array<std::atomic<std::int64_t>, kRounds> left_at{};
  std::vector<double> waited(kRounds, -1);
  std::vector<float> sums(3 * kRounds, -1);
  const auto ns = [] { return std::chrono::steady_clock::now().time_since_epoch().count(); };
  run_gloo(3, fresh_dir("intransfer"), 20000ms, Elastic::on, [&](GlooWorld& w, int r) {
    std::vector<float> big(kCount, static_cast<float>(r));
    std::unique_ptr<Communicator> owned;
    Communicator* c = &w.comm();
    for (int round = 0; round < kRounds; ++round) {
      c->barrier();
      std::unique_ptr<Communicator> next;
      if (r == 1) {
        for (int k = 0; k < 2; ++k) c->send(big.data(), kCount, ElemType::f32, 2, k);
        auto on_its_way = c->isend(big.data(), kCount, ElemType::f32, 2, 2);
        while (received[round] < 2) std::this_thread::yield();
        left_at[round] = ns();
        next = c->shrink();
      } else if (r == 2) {
        try {
          for (int k = 0;; ++k) {
            c->recv(big.data(), kCount, ElemType::f32, 1, k);
            ++received[round];
          }
        } catch (const RankLost&) {
          waited[round] = static_cast<double>(ns() - left_at[round]) * 1e-9;
        }
        next = c->shrink();
      } else {
        EXPECT_THROW(c->barrier(), RankLost);
        next = c->shrink();
      }
      float y = static_cast<float>(r);
      next->all_reduce(&y, &y, 1, ElemType::f32, ReduceOp::sum);
      sums[static_cast<std::size_t>(3 * round + r)] = y;
      owned = std::move(next);
      c = owned.get();
    }
    w.finish();
  });
  for (int round = 0; round < kRounds; ++round) {
    EXPECT_GE(waited[round], 0.0) << "round " << round;
    EXPECT_LT(waited[round], 5.0) << "round " << round << ": rank 2 waited for the time-out";
  }
  EXPECT_EQ(sums, std::vector<float>(3 * kRounds, 3.f));
}

// A process that joins the gloo run in `dir` after 0.3 s: its world's size
// and its rank there go to size[at] and rank[at], its sum of 10 with the
// others' values to sum[at].
std::thread joining_process(const std::string& dir, std::size_t at, std::vector<int>& size, std::vector<int>& rank,
                            std::vector<float>& sum) {
  return std::thread([=, &size, &rank, &sum] {
    std::this_thread::sleep_for(300ms);
    try {
      GlooOptions o;
      o.rendezvous = dir;
      o.host = "127.0.0.1";
      o.timeout = 10s;
      o.elastic = Elastic::on;
      o.join = true;
      auto world = open_gloo_world(o);
      size[at] = world->comm().size();
      rank[at] = world->comm().rank();
      float y = 10;
      world->comm().all_reduce(&y, &y, 1, ElemType::f32, ReduceOp::sum);
      sum[at] = y;
      world->finish();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "joiner: " << e.what();
    }
  });
}

// Collective: waits (at most 5 s) until comm's rank 0 sees processes
// waiting to join; their number, on every rank.
std::int32_t joins_seen(Communicator& comm) {
  std::int32_t joins = 0;
  for (int round = 0; joins == 0 && round < 1000; ++round) {
    joins = comm.rank() == 0 ? comm.pending_joins() : 0;
    comm.broadcast(&joins, 1, ElemType::i32, 0);
    if (joins == 0) std::this_thread::sleep_for(5ms);
  }
  return joins;
}

// Three ranks sum until rank 0 sees a process waiting to join; they agree
// on it (rank 0's count, broadcast) and grow; the fourth gets rank 3. The
// ranks are given `ranks_at`, the joiner `joiner_at`: the same rendezvous.
void join_between(const std::string& joiner_at, const std::string& ranks_at) {
  std::vector<int> size_after(4, -1), rank_after(4, -1);
  std::vector<float> sums(4, -1);
  std::thread joiner = joining_process(joiner_at, 3, size_after, rank_after, sums);
  run_gloo(3, ranks_at, 10s, Elastic::on, [&](GlooWorld& w, int r) {
    EXPECT_EQ(w.comm().pending_joins(), 0);
    std::int32_t joins = joins_seen(w.comm());
    ASSERT_EQ(joins, 1);
    auto next = w.comm().grow(joins);
    size_after[r] = next->size();
    rank_after[r] = next->rank();
    float y = static_cast<float>(r);
    next->all_reduce(&y, &y, 1, ElemType::f32, ReduceOp::sum);
    sums[r] = y;
    EXPECT_EQ(w.members(), (std::vector<int>{0, 1, 2, 3}));
    w.finish();
  });
  joiner.join();
  EXPECT_EQ(size_after, (std::vector<int>{4, 4, 4, 4}));
  EXPECT_EQ(rank_after, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(sums, (std::vector<float>{13, 13, 13, 13}));
}

TEST(Gloo, AProcessJoinsBetweenTwoCollectives) {
  const std::string dir = fresh_dir("join");
  join_between(dir, dir + "/");
}
TEST_F(GlooTcp, AProcessJoinsBetweenTwoCollectives) {
  const std::string at = tcp_rendezvous();
  join_between(at, at);
}

TEST(Gloo, ARankLostWhileAJoinWaitsLeavesTheSurvivorsWhoAdmitItNext) {
  // Four ranks see a process waiting to join; rank 2 is lost in that step.
  // Ranks 0 and 1 grow, rank 3 (which waited on rank 2) shrinks: all three form
  // the survivors' group, admitting no one; the joiner waits on, and the
  // survivors then admit it as rank 3.
  const std::string dir = fresh_dir("lostjoin");
  std::vector<int> size_mid(4, -1), size_after(5, -1), rank_after(5, -1);
  std::vector<float> sums(5, -1);
  std::thread joiner = joining_process(dir, 4, size_after, rank_after, sums);
  run_gloo(4, dir + "/", 10s, Elastic::on, [&](GlooWorld& w, int r) {
    std::int32_t joins = joins_seen(w.comm());
    ASSERT_EQ(joins, 1);
    if (r == 2) return;  // gone
    std::unique_ptr<Communicator> mid;
    if (r == 3) {  // it waits on rank 2
      float x = 1;
      EXPECT_THROW(w.comm().irecv(&x, 1, ElemType::f32, 2, 7)->wait(), RankLost);
      mid = w.comm().shrink();
    } else {
      mid = w.comm().grow(joins);
    }
    size_mid[r] = mid->size();
    EXPECT_EQ(w.members(), (std::vector<int>{0, 1, 3}));
    joins = joins_seen(*mid);
    ASSERT_EQ(joins, 1);
    auto next = mid->grow(joins);
    size_after[r] = next->size();
    rank_after[r] = next->rank();
    float y = static_cast<float>(r + 1);
    next->all_reduce(&y, &y, 1, ElemType::f32, ReduceOp::sum);
    sums[r] = y;
    EXPECT_EQ(w.members(), (std::vector<int>{0, 1, 3, 4}));
    w.finish();
  });
  joiner.join();
  EXPECT_EQ(size_mid, (std::vector<int>{3, 3, -1, 3}));
  EXPECT_EQ(size_after, (std::vector<int>{4, 4, -1, 4, 4}));
  EXPECT_EQ(rank_after, (std::vector<int>{0, 1, -1, 2, 3}));
  EXPECT_EQ(sums, (std::vector<float>{17, 17, -1, 17, 17}));
}

TEST(Gloo, AJoinNobodyAdmitsIsWithdrawnAtTheTimeOut) {
  std::string what;
  const std::string dir = fresh_dir("nojoin");
  run_gloo(2, dir, 10s, Elastic::on, [&](GlooWorld& w, int r) {
    if (r == 0) {
      GlooOptions o;
      o.rendezvous = dir;
      o.host = "127.0.0.1";
      o.timeout = 500ms;
      o.join = true;
      try {
        open_gloo_world(o);
      } catch (const CommTimeout& e) {
        what = e.what();
      }
      EXPECT_EQ(w.comm().pending_joins(), 0);  // withdrawn
    }
    w.comm().barrier();
    w.finish();
  });
  EXPECT_NE(what.find("the run did not admit this process within 0.5 s"), std::string::npos) << what;
}

TEST(Gloo, AMinorityOfSurvivorsStops) {
  std::string what;
  run_gloo(2, fresh_dir("minority"), 5000ms, Elastic::on, [&](GlooWorld& w, int r) {
    float x = 1;
    w.comm().all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
    if (r == 1) return;
    try {
      w.comm().all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
    } catch (const RankLost&) {
    }
    try {
      w.comm().shrink();
    } catch (const CommError& e) {
      what = e.what();
    }
  });
  EXPECT_NE(what.find("only 1 of the 2 ranks"), std::string::npos) << what;
  EXPECT_NE(what.find("more than half"), std::string::npos) << what;
}

TEST(Gloo, BadOptionsAreNamed) {
  const auto message = [](GlooOptions o) {
    try {
      open_gloo_world(o);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string bad = fresh_dir("bad"), alone = fresh_dir("bad-alone");
  GlooOptions o;
  o.rendezvous = bad;
  o.size = 2;
  o.rank = 2;
  EXPECT_NE(message(o).find("rank 2 is not a rank of a world of 2"), std::string::npos);
  o.rank = 0;
  o.host = "no.such.host.invalid";
  EXPECT_NE(message(o).find("the host no.such.host.invalid has no address here"), std::string::npos) << message(o);
  o.host = "127.0.0.1";
  o.rendezvous = alone;
  o.timeout = 300ms;
  EXPECT_NE(message(o).find("timed out after 0.3 s waiting for rank(s) 1 to start in"), std::string::npos)
      << message(o);
  o.rendezvous = "/dev/null/x";
  EXPECT_NE(message(o).find("not a directory, and cannot be created"), std::string::npos) << message(o);
  std::filesystem::remove_all(bad);
  std::filesystem::remove_all(alone);
}

}  // namespace
}  // namespace distopt
