// The threads backend and the Communicator contract, swept over world sizes
// 1-8, element counts 0, 1, 7, 4096 and 2^20+3, every element type and op.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm_values.hpp"
#include "distopt/comm/threads.hpp"

namespace distopt {
namespace {

using testing::expected;
using testing::filled;
using testing::get;
using testing::value;
using namespace std::chrono_literals;

const std::vector<std::size_t> kCounts = {0, 1, 7, 4096, (std::size_t{1} << 20) + 3};

std::vector<ReduceOp> ops_for(ElemType t) {
  if (is_floating(t)) return {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
  return {ReduceOp::sum, ReduceOp::max, ReduceOp::min};
}

// Large counts only for a few types, to keep the suite fast.
bool wanted(ElemType t, std::size_t count) {
  return count < 100000 || t == ElemType::f32 || t == ElemType::bf16 || t == ElemType::i64;
}

class Worlds : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Threads, Worlds, ::testing::Range(1, 9));

TEST_P(Worlds, AllReduceEveryTypeOpAndCount) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    for (ElemType t : testing::all_types())
      for (std::size_t count : kCounts) {
        if (!wanted(t, count)) continue;
        for (ReduceOp op : ops_for(t))
          for (bool in_place : {false, true}) {
            auto send = filled(t, count, c.rank());
            std::vector<unsigned char> out(count * size_of(t) + 1, 0xee);
            void* recv = in_place ? send.data() : out.data();
            c.all_reduce(send.data(), recv, count, t, op);
            for (std::size_t i = 0; i < count; ++i)
              if (get(t, recv, i) != expected(op, n, i))
                FAIL() << "rank " << c.rank() << " " << name_of(t) << " " << name_of(op) << " count " << count
                       << (in_place ? " in place" : "") << " [" << i << "] = " << get(t, recv, i) << ", want "
                       << expected(op, n, i);
          }
      }
  });
}

TEST_P(Worlds, ReduceScatterAllGatherBroadcast) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    for (ElemType t : testing::all_types())
      for (std::size_t per : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}}) {
        // reduce_scatter: piece r of the sum lands on rank r.
        auto send = filled(t, per * n, c.rank());
        std::vector<unsigned char> piece(per * size_of(t) + 1);
        c.reduce_scatter(send.data(), piece.data(), per, t, ReduceOp::sum);
        for (std::size_t i = 0; i < per; ++i)
          ASSERT_EQ(get(t, piece.data(), i), expected(ReduceOp::sum, n, c.rank() * per + i)) << name_of(t);
        // all_gather: rank order.
        auto mine = filled(t, per, c.rank());
        std::vector<unsigned char> all(per * n * size_of(t) + 1);
        c.all_gather(mine.data(), all.data(), per, t);
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < per; ++i) ASSERT_EQ(get(t, all.data(), r * per + i), value(r, i));
        // broadcast from every root.
        for (int root = 0; root < n; ++root) {
          auto buf = filled(t, per, c.rank());
          c.broadcast(buf.data(), per, t, root);
          for (std::size_t i = 0; i < per; ++i) ASSERT_EQ(get(t, buf.data(), i), value(root, i));
        }
      }
  });
}

// The in-place forms the sharded strategies use: reduce_scatter into the
// rank's own piece of its input, all_gather from the rank's own piece of
// its output -- together an in-place all_reduce.
TEST_P(Worlds, ReduceScatterAndAllGatherInPlace) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    for (ElemType t : testing::all_types())
      for (std::size_t per : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}}) {
        auto buf = filled(t, per * n, c.rank());
        char* own = reinterpret_cast<char*>(buf.data()) + c.rank() * per * size_of(t);
        c.reduce_scatter(buf.data(), own, per, t, ReduceOp::sum);
        for (std::size_t i = 0; i < per; ++i)
          ASSERT_EQ(get(t, own, i), expected(ReduceOp::sum, n, c.rank() * per + i)) << name_of(t);
        c.all_gather(own, buf.data(), per, t);
        for (std::size_t i = 0; i < per * n; ++i)
          ASSERT_EQ(get(t, buf.data(), i), expected(ReduceOp::sum, n, i)) << name_of(t) << " [" << i << "]";
      }
  });
}

// all_to_all: rank s's piece d lands as rank d's piece s, blocking or not,
// and a rank counts the n - 1 pieces the others take from it.
TEST_P(Worlds, AllToAllSendsEachPieceToItsRank) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    auto value = [](int from, int to, std::size_t i) { return std::uint8_t(31 * from + 7 * to + i); };
    for (std::size_t per : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{5000}}) {
      std::vector<std::uint8_t> send(per * n), recv(per * n, 0xee), again(per * n, 0xee);
      for (int d = 0; d < n; ++d)
        for (std::size_t i = 0; i < per; ++i) send[d * per + i] = value(c.rank(), d, i);
      const std::uint64_t before = c.bytes_sent();
      c.all_to_all(send.data(), recv.data(), per, ElemType::u8);
      ASSERT_EQ(c.bytes_sent() - before, per * static_cast<std::size_t>(n - 1));
      c.iall_to_all(send.data(), again.data(), per, ElemType::u8)->wait();
      for (int s = 0; s < n; ++s)
        for (std::size_t i = 0; i < per; ++i) {
          ASSERT_EQ(recv[s * per + i], value(s, c.rank(), i)) << "from " << s << " [" << i << "]";
          ASSERT_EQ(again[s * per + i], value(s, c.rank(), i)) << "from " << s << " [" << i << "]";
        }
    }
  });
}

TEST_P(Worlds, AllGatherVWithUnevenCountsInPlace) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    std::vector<std::size_t> counts(n);
    std::size_t total = 0;
    for (int r = 0; r < n; ++r) total += counts[r] = static_cast<std::size_t>(r * 3 % 5);  // includes zeros
    std::vector<float> buf(total + 1, -1.0f);
    std::size_t off = 0;
    for (int r = 0; r < c.rank(); ++r) off += counts[r];
    for (std::size_t i = 0; i < counts[c.rank()]; ++i) buf[off + i] = static_cast<float>(c.rank() * 100 + i);
    c.all_gather_v(buf.data() + off, buf.data(), counts, ElemType::f32);
    std::size_t k = 0;
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < counts[r]; ++i) ASSERT_EQ(buf[k++], static_cast<float>(r * 100 + i));
  });
}

// Determinism contract (a): all_reduce == all_gather(reduce_scatter), bit for
// bit, and both equal a sum taken in rank order ((x0 + x1) + x2) + ...
TEST_P(Worlds, AllReduceIsReduceScatterThenAllGatherBitwise) {
  const int n = GetParam();
  for (std::size_t per : {std::size_t{7}, std::size_t{4099}}) {
    const std::size_t count = per * n;
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(testing::noisy(count, r));
    std::vector<float> ordered(count);
    for (std::size_t i = 0; i < count; ++i) {
      float s = inputs[0][i];
      for (int r = 1; r < n; ++r) s = s + inputs[r][i];
      ordered[i] = s;
    }
    spawn(n, [&](Communicator& c) {
      std::vector<float> a(count), piece(per), b(count);
      c.all_reduce(inputs[c.rank()].data(), a.data(), count, ElemType::f32, ReduceOp::sum);
      c.reduce_scatter(inputs[c.rank()].data(), piece.data(), per, ElemType::f32, ReduceOp::sum);
      c.all_gather(piece.data(), b.data(), per, ElemType::f32);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), count * 4), 0);
      ASSERT_EQ(std::memcmp(a.data(), ordered.data(), count * 4), 0);
    });
  }
}

TEST_P(Worlds, SendRecvRingAndTags) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    std::vector<std::int64_t> out = {c.rank(), 10 + c.rank()}, in(2), in2(1);
    std::int64_t tagged = 1000 + c.rank();
    c.isend(&tagged, 1, ElemType::i64, next, 7);
    c.send(out.data(), 2, ElemType::i64, next, 0);
    c.recv(in.data(), 2, ElemType::i64, prev, 0);  // tag 0 first although tag 7 arrived earlier
    auto r = c.irecv(in2.data(), 1, ElemType::i64, prev, 7);
    r->wait();
    EXPECT_TRUE(r->test());
    EXPECT_EQ(in[0], prev);
    EXPECT_EQ(in[1], 10 + prev);
    EXPECT_EQ(in2[0], 1000 + prev);
  });
}

TEST_P(Worlds, NonBlockingCollectivesKeepIssueOrder) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    std::vector<float> a(5000, 1.0f + c.rank()), b(3, 2.0f), d(64, 0.0f);
    auto ra = c.iall_reduce(a.data(), a.data(), a.size(), ElemType::f32, ReduceOp::sum);
    auto rb = c.ibroadcast(d.data(), d.size(), ElemType::f32, n - 1);
    c.all_reduce(b.data(), b.data(), b.size(), ElemType::f32, ReduceOp::max);  // waits for the two above
    ra->wait();
    rb->wait();
    EXPECT_EQ(a[4999], n * (n + 1) / 2.0f);
    EXPECT_EQ(b[0], 2.0f);
    EXPECT_TRUE(ra->test());
  });
}

TEST_P(Worlds, SplitIntoEvenAndOddRanks) {
  const int n = GetParam();
  spawn(n, [&](Communicator& c) {
    // Reverse order inside each color through the key; rank 0 opts out when n > 2.
    const int color = (n > 2 && c.rank() == 0) ? -1 : c.rank() % 2;
    auto sub = c.split(color, -c.rank());
    if (color < 0) {
      EXPECT_EQ(sub, nullptr);
      return;
    }
    int members = 0, highest = -1;
    for (int r = 0; r < n; ++r)
      if (!(n > 2 && r == 0) && r % 2 == color) {
        ++members;
        highest = std::max(highest, r);
      }
    ASSERT_EQ(sub->size(), members);
    // key = -rank: the highest parent rank becomes rank 0.
    std::int32_t first = sub->rank() == 0 ? c.rank() : -1;
    sub->all_reduce(std::span<std::int32_t>(&first, 1), ReduceOp::max);
    EXPECT_EQ(first, highest);
    std::int32_t one = 1;
    sub->all_reduce(std::span<std::int32_t>(&one, 1), ReduceOp::sum);
    EXPECT_EQ(one, members);
  });
}

TEST(Failure, ThrowingRankWakesTheOthersQuickly) {
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int> aborted{0};
  try {
    spawn(4, [&](Communicator& c) {
      std::vector<float> x(100, 1.0f);
      c.all_reduce(x.data(), x.data(), x.size(), ElemType::f32, ReduceOp::sum);
      if (c.rank() == 2) throw std::runtime_error("rank two gave up");
      try {
        c.all_reduce(x.data(), x.data(), x.size(), ElemType::f32, ReduceOp::sum);
      } catch (const CommAborted& e) {
        EXPECT_NE(std::string(e.what()).find("aborted because rank 2 failed: rank two gave up"), std::string::npos)
            << e.what();
        ++aborted;
        throw;
      }
    }, 60s);
    FAIL() << "spawn did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank two gave up");  // the root cause, not a consequence
  }
  EXPECT_EQ(aborted.load(), 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);  // woken, not timed out (60 s)
}

TEST(Failure, AbsentRankTimesOutNamingIt) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    spawn(3, [&](Communicator& c) {
      if (c.rank() == 1) return;  // never joins
      std::vector<float> x(10, 1.0f);
      c.all_reduce(x.data(), x.data(), x.size(), ElemType::f32, ReduceOp::sum);
    }, 300ms);
    FAIL() << "no time-out";
  } catch (const CommTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("reduce_scatter on rank"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after 0.3 s waiting for rank(s) 1"), std::string::npos) << e.what();
  }
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 5s);
}

TEST(Failure, RecvTimesOutNamingThePeer) {
  try {
    spawn(2, [&](Communicator& c) {
      if (c.rank() == 0) return;
      int x;
      c.recv(&x, 1, ElemType::i32, 0, 3);
    }, 200ms);
    FAIL();
  } catch (const CommTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("recv on rank 1: timed out after 0.2 s waiting for rank 0 (tag 3"),
              std::string::npos) << e.what();
  }
}

TEST(Failure, QueuedCollectivesFailAtOnceAfterATimeout) {
  // Rank 1 never joins. Rank 0 queues five non-blocking all-reduces: the
  // first times out, the other four fail with the same error at once
  // instead of waiting out a time-out each.
  const auto t0 = std::chrono::steady_clock::now();
  int failed = 0;
  try {
    spawn(2, [&](Communicator& c) {
      if (c.rank() == 1) return;
      std::vector<float> x(5 * 8, 1.0f);
      std::vector<std::unique_ptr<Request>> reqs;
      for (int i = 0; i < 5; ++i) reqs.push_back(c.iall_reduce(x.data() + 8 * i, x.data() + 8 * i, 8, ElemType::f32, ReduceOp::sum));
      for (auto& r : reqs) {
        try {
          r->wait();
        } catch (const CommTimeout& e) {
          EXPECT_NE(std::string(e.what()).find("waiting for rank(s) 1"), std::string::npos) << e.what();
          ++failed;
        }
      }
      // A new collective on the broken communicator fails at once too.
      EXPECT_THROW(c.barrier(), CommTimeout);
    }, 400ms);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank 0 caught every error, yet spawn threw " << e.what();
  }
  EXPECT_EQ(failed, 5);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1500ms) << "each queued collective waited for its own time-out";
}

TEST(Failure, ARankStuckOutsideTheCommunicatorIsAbandonedNotWaitedFor) {
  // Rank 1 hangs in its own code, where no abort can reach it; rank 0 times
  // out waiting for it. spawn reports both within the time-out plus
  // kAbandonAfter instead of joining rank 1 forever.
  const auto t0 = std::chrono::steady_clock::now();
  try {
    spawn(2, [](Communicator& c) {
      if (c.rank() == 1) std::this_thread::sleep_for(20s);
      c.barrier();
    }, 300ms);
    FAIL() << "no error";
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 failed: barrier on rank 0: timed out after 0.3 s waiting for rank(s) 1"),
              std::string::npos) << what;
    EXPECT_NE(what.find("rank(s) 1 did not stop within 2 s and were abandoned"), std::string::npos) << what;
  }
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(elapsed, 300ms + kAbandonAfter);
  EXPECT_LT(elapsed, 300ms + kAbandonAfter + 3s);
}

TEST(Timeout, DefaultComesFromTheEnvironmentAndBadValuesAreNamed) {
  ::unsetenv("DISTOPT_COMM_TIMEOUT");
  EXPECT_EQ(Communicator::default_timeout(), Communicator::kDefaultTimeout);
  ::setenv("DISTOPT_COMM_TIMEOUT", "2.5", 1);
  EXPECT_EQ(Communicator::default_timeout(), 2500ms);
  EXPECT_EQ(make_threads_world(2)[1]->timeout(), 2500ms);
  for (const char* bad : {"0", "-1", "abc", "5s", "nan", "inf", "1e99"}) {
    ::setenv("DISTOPT_COMM_TIMEOUT", bad, 1);
    try {
      (void)Communicator::default_timeout();
      ADD_FAILURE() << bad << " accepted";
    } catch (const InvalidInput& e) {
      EXPECT_EQ(std::string(e.what()), std::string("DISTOPT_COMM_TIMEOUT: '") + bad +
                                           "' is not a number of seconds in (0, one year]");
    }
  }
  ::unsetenv("DISTOPT_COMM_TIMEOUT");
  EXPECT_EQ(Communicator::parse_timeout("0.0001", "--comm-timeout"), 1ms);  // at least 1 ms
}

TEST(BadInput, Rejected) {
  spawn(2, [&](Communicator& c) {
    int x = 1;
    EXPECT_THROW(c.all_reduce(&x, &x, 1, ElemType::i32, ReduceOp::avg), InvalidInput);
    EXPECT_THROW(c.broadcast(&x, 1, ElemType::i32, 2), InvalidInput);
    EXPECT_THROW(c.send(&x, 1, ElemType::i32, -1), InvalidInput);
    std::size_t counts[1] = {1};
    EXPECT_THROW(c.all_gather_v(&x, &x, counts, ElemType::i32), InvalidInput);
    // A message of the wrong size is an error on the receiver.
    if (c.rank() == 0) {
      std::int64_t big = 5;
      c.send(&big, 1, ElemType::i64, 1);
    } else {
      EXPECT_THROW(c.recv(&x, 1, ElemType::i32, 0), CommError);
    }
  });
  EXPECT_THROW(make_threads_world(0), InvalidInput);
}

TEST(Pieces, CoverTheBufferInOrder) {
  for (int n = 1; n <= 9; ++n)
    for (std::size_t count : {0u, 1u, 7u, 100u, 1025u}) {
      std::size_t next = 0;
      for (int r = 0; r < n; ++r) {
        const Piece p = piece_of(count, n, r);
        EXPECT_EQ(p.offset, next);
        EXPECT_LE(p.count, count / n + 1);
        next += p.count;
      }
      EXPECT_EQ(next, count);
    }
}

}  // namespace
}  // namespace distopt

namespace distopt {
namespace {

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(LinkEmulator, AMessageArrivesAfterItsBytesCrossedTheLinkAndTheLatency) {
  // 1 MB at 80 Mbit/s takes 0.1 s on the link; plus 0.05 s latency. The
  // receiver's lower bounds are measured from the sender's clock reading
  // before it sent (the ranks are threads of this process): the ranks leave
  // a barrier up to several ms apart on a loaded runner, so the receiver's
  // own reading would make the bound depend on that skew.
  std::atomic<std::chrono::steady_clock::rep> sent_at{0};
  auto sender_start = [&] {
    return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(sent_at.load()));
  };
  spawn(2, [&](Communicator& c) {
    c.set_link_model({80e6, 0.05});
    std::vector<unsigned char> buf(1'000'000, 7);
    c.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    if (c.rank() == 0) {
      sent_at.store(t0.time_since_epoch().count());
      c.send(buf.data(), buf.size(), ElemType::u8, 1, 3);
      // The lower bounds are the model's; the upper ones only say "not the
      // model's time twice over", loose enough for a loaded 2-core runner.
      EXPECT_GE(since(t0), 0.1);  // the sender's link was busy
      EXPECT_LT(since(t0), 0.4);
    } else {
      std::vector<unsigned char> got(buf.size());
      c.recv(got.data(), got.size(), ElemType::u8, 0, 3);
      EXPECT_GE(since(sender_start()), 0.15);
      EXPECT_LT(since(t0), 0.6);
      EXPECT_EQ(got, buf);
    }
    // Two messages in a row queue on the link: the second leaves 0.2 s in.
    c.barrier();
    const auto t1 = std::chrono::steady_clock::now();
    if (c.rank() == 0) {
      sent_at.store(t1.time_since_epoch().count());
      auto a = c.isend(buf.data(), buf.size(), ElemType::u8, 1, 4);
      auto b = c.isend(buf.data(), buf.size(), ElemType::u8, 1, 5);
      a->wait();
      b->wait();
      EXPECT_GE(since(t1), 0.2);
    } else {
      std::vector<unsigned char> got(buf.size());
      c.recv(got.data(), got.size(), ElemType::u8, 0, 5);
      // Queued: 0.25 s (unqueued it would be 0.15).
      EXPECT_GE(since(sender_start()), 0.25);
      c.recv(got.data(), got.size(), ElemType::u8, 0, 4);
    }
    EXPECT_EQ(c.bytes_sent(), c.rank() == 0 ? 3'000'000u : 0u) << "the arrival stamps are not counted";
  });
}

TEST(LinkEmulator, ACollectiveTakesItsBytesOverTheLink) {
  // all_reduce of 4 MB at 2 ranks: each rank sends 2 MB + 2 MB = 4 MB,
  // 0.1 s at 320 Mbit/s. Unshaped it is far faster.
  spawn(2, [](Communicator& c) {
    std::vector<float> x(1'000'000, 1.0f);
    c.barrier();
    auto t0 = std::chrono::steady_clock::now();
    c.all_reduce(x.data(), x.data(), x.size(), ElemType::f32, ReduceOp::sum);
    const double plain = since(t0);
    c.set_link_model({320e6, 0});
    c.barrier();
    t0 = std::chrono::steady_clock::now();
    c.all_reduce(x.data(), x.data(), x.size(), ElemType::f32, ReduceOp::sum);
    EXPECT_GE(since(t0), 0.1);
    EXPECT_LT(since(t0), 0.1 + plain + 0.1);
    EXPECT_EQ(x[0], 4.0f);
  });
}

TEST(LinkEmulator, BadModelsAndTagsAreRefused) {
  spawn(1, [](Communicator& c) {
    EXPECT_THROW(c.set_link_model({-1, 0}), InvalidInput);
    EXPECT_THROW(c.set_link_model({1e9, -0.1}), InvalidInput);
    EXPECT_THROW(c.set_link_model({std::nan(""), 0}), InvalidInput);
    c.set_link_model({1e9, 0});
    int v = 0;
    EXPECT_THROW(c.isend(&v, 1, ElemType::i32, 0, Communicator::kMaxTag), InvalidInput);
  });
}

}  // namespace
}  // namespace distopt

namespace distopt {
namespace {

// An elastic world (docs/reliability.md, "Survivors"): a rank that fails,
// or falls silent past the time-out, is lost; the others are woken with
// RankLost and re-form the world with shrink(), ranked in their old order,
// where the collectives go on (rank-ordered sums over the survivors).
TEST(Elastic, SurvivorsOfAFailedAndOfASilentRankReformTheWorld) {
  for (const bool silent : {false, true}) {
    std::atomic<int> lost_seen{0};
    std::vector<int> new_ranks(4, -1), new_sizes(4, -1);
    std::vector<double> sums(4, 0);
    const SpawnResult r = spawn(
        4,
        [&](Communicator& c) {
          std::vector<float> v(5, static_cast<float>(c.rank() + 1));
          c.all_reduce(std::span(v), ReduceOp::sum);
          if (c.rank() == 2) {
            if (!silent) throw Error("rank 2 fails");
            for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // silent for ever: abandoned
          }
          try {
            c.all_reduce(std::span(v), ReduceOp::sum);
            ADD_FAILURE() << "the all-reduce went through without rank 2";
          } catch (const RankLost& e) {
            ++lost_seen;
            EXPECT_NE(std::string(e.what()).find("rank(s) 2"), std::string::npos) << e.what();
          }
          const int before = c.rank();
          std::unique_ptr<Communicator> s = c.shrink();
          new_ranks[before] = s->rank();
          new_sizes[before] = s->size();
          double x = before + 1;
          s->all_reduce(std::span(&x, 1), ReduceOp::sum);
          sums[before] = x;
          EXPECT_THROW(c.barrier(), CommError);  // the old world stays broken
        },
        std::chrono::milliseconds(silent ? 500 : 30'000), Elastic::on);
    EXPECT_EQ(lost_seen.load(), 3);
    EXPECT_EQ(new_ranks, (std::vector<int>{0, 1, -1, 2}));
    EXPECT_EQ(new_sizes, (std::vector<int>{3, 3, -1, 3}));
    for (int k : {0, 1, 3}) EXPECT_EQ(sums[k], 1.0 + 2.0 + 4.0);
    EXPECT_EQ(r.abandoned, silent ? std::vector<int>{2} : std::vector<int>{});
  }
}

// Two losses in a row, the second after the survivors worked longer than
// the time-out (a failing rank ends at once: the survivors are not lost
// for outliving it): the world shrinks twice, 4 -> 3 -> 2.
TEST(Elastic, ASecondLossAfterLongWorkShrinksAgain) {
  std::vector<int> final_ranks(4, -1);
  const SpawnResult r = spawn(
      4,
      [&](Communicator& c) {
        const int me = c.rank();
        if (me == 2) throw Error("rank 2 fails");
        std::unique_ptr<Communicator> s;
        try {
          c.barrier();
          ADD_FAILURE() << "a barrier without rank 2";
        } catch (const RankLost&) {
          s = c.shrink();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1400));  // longer than the time-out
        if (me == 1) throw Error("rank 1 fails");
        try {
          s->barrier();
          ADD_FAILURE() << "a barrier without rank 1";
        } catch (const RankLost&) {
          s = s->shrink();
        }
        double x = me;
        s->all_reduce(std::span(&x, 1), ReduceOp::sum);
        EXPECT_EQ(x, 0.0 + 3.0);
        final_ranks[me] = s->rank();
      },
      // (Room for a loaded machine: one ASan run found a survivor slower
      // than 300 ms to the first shrink and left it behind.)
      std::chrono::milliseconds(1000), Elastic::on);
  EXPECT_EQ(final_ranks, (std::vector<int>{0, -1, -1, 1}));
  EXPECT_TRUE(r.abandoned.empty());
}

TEST(Elastic, OnlyAnElasticWorldsTopCommunicatorShrinks) {
  spawn(2, [](Communicator& c) { EXPECT_THROW(c.shrink(), CommError); });
  spawn(
      2,
      [](Communicator& c) {
        std::unique_ptr<Communicator> sub = c.split(0, c.rank());
        EXPECT_THROW(sub->shrink(), CommError);
      },
      Communicator::default_timeout(), Elastic::on);
  // Off: a failing rank still ends every rank with its error.
  EXPECT_THROW(spawn(2,
                     [](Communicator& c) {
                       if (c.rank() == 1) throw InvalidInput("rank 1 fails");
                       c.barrier();
                     }),
               InvalidInput);
}

}  // namespace
}  // namespace distopt

#include <map>

#include "distopt/comm/launch_env.hpp"

namespace distopt {
namespace {

std::optional<LaunchEnv> env_of(const std::map<std::string, std::string>& vars) {
  return launch_env([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    (void)env_of(vars);
  } catch (const InvalidInput& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchEnv, SrunsAndTorchrunsVariablesGiveTheRankAndWorld) {
  EXPECT_FALSE(env_of({}).has_value());
  // A batch script's own environment: the job's task count, no step's.
  EXPECT_FALSE(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "7"}}).has_value());
  const auto s = env_of({{"SLURM_PROCID", "3"},
                         {"SLURM_STEP_NUM_TASKS", "4"},
                         {"SLURM_LOCALID", "1"},
                         {"SLURM_STEP_NUM_NODES", "2"},
                         {"SLURM_STEP_NODELIST", "gpu[007-008]"},
                         {"SLURM_JOB_ID", "991"},
                         {"SLURM_STEP_ID", "2"}});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->launcher, "srun");
  EXPECT_EQ(s->rank, 3);
  EXPECT_EQ(s->world, 4);
  EXPECT_EQ(s->local_rank, 1);
  EXPECT_FALSE(s->one_machine);
  EXPECT_EQ(s->machines, 2);
  EXPECT_EQ(s->master_addr, "gpu007");
  EXPECT_EQ(s->job, "991.2");
  EXPECT_EQ(s->master_port, 15000 + 9912);  // slurm_port: no MASTER_PORT
  // MASTER_ADDR and MASTER_PORT, where set, are the store's place under srun too.
  const auto m = env_of({{"SLURM_PROCID", "0"},
                         {"SLURM_STEP_NUM_TASKS", "2"},
                         {"SLURM_STEP_NODELIST", "gpu[007-008]"},
                         {"MASTER_ADDR", "10.1.2.3"},
                         {"MASTER_PORT", "29400"}});
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->master_addr, "10.1.2.3");
  EXPECT_EQ(m->master_port, 29400);
  // torchrun inside a SLURM step: torchrun's variables are the process's.
  const auto t = env_of({{"RANK", "1"},
                         {"WORLD_SIZE", "2"},
                         {"LOCAL_RANK", "1"},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "10.0.0.1"},
                         {"MASTER_PORT", "29500"},
                         {"TORCHELASTIC_RUN_ID", "abc"},
                         {"SLURM_PROCID", "0"},
                         {"SLURM_STEP_NUM_TASKS", "1"}});
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->launcher, "torchrun");
  EXPECT_EQ(t->rank, 1);
  EXPECT_EQ(t->world, 2);
  EXPECT_TRUE(t->one_machine);
  EXPECT_EQ(t->master_port, 29500);
  EXPECT_EQ(t->job, "abc-10.0.0.1-29500");
  EXPECT_FALSE(t->agent_store);
  EXPECT_TRUE(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}})->agent_store);
  // Without LOCAL_WORLD_SIZE, torchrun's processes are not known to share a machine.
  EXPECT_FALSE(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}})->one_machine);
}

TEST(LaunchEnv, MalformedValuesAreOneLineNamingTheVariable) {
  EXPECT_EQ(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK=x is not a whole number");
  EXPECT_EQ(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}), "RANK=-1 is not a whole number");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE=0 is out of range (1 .. 2147483647)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}), "WORLD_SIZE=99999999999 is not a whole number");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "4"}, {"SLURM_STEP_NUM_TASKS", "4"}}),
            "SLURM_PROCID=4 is not a rank of SLURM_STEP_NUM_TASKS=4 (0 .. 3)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}),
            "MASTER_PORT=70000 is out of range (1 .. 65535)");
}

TEST(LaunchEnv, ASlurmStepsPortIsItsNumbersLastNineDigitsModulo20000) {
  EXPECT_EQ(slurm_port("4242.0"), 15000 + 42420 % 20000);
  EXPECT_NE(slurm_port("4242.1"), slurm_port("4242.0"));
  EXPECT_EQ(slurm_port("987654321.12"), 15000 + 765432112 % 20000);
  EXPECT_EQ(slurm_port("job.step"), 15000);
}

TEST(LaunchEnv, TheFirstHostOfASlurmNodeList) {
  EXPECT_EQ(first_host("node07"), "node07");
  EXPECT_EQ(first_host("node07,gpu2"), "node07");
  EXPECT_EQ(first_host("node[07-09,11],gpu2"), "node07");
  EXPECT_EQ(first_host("n[1,3]"), "n1");
  EXPECT_EQ(first_host("rack1-n[001-004]"), "rack1-n001");
  for (const char* bad : {"", "[1-2]", "node[", "node[x]", "node[1-2", ",node1"}) {
    try {
      (void)first_host(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find("the SLURM node list"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace distopt
