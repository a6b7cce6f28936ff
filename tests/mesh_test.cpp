// The gloo backend's data path (src/comm/gloo/mesh.hpp) on its own: two
// meshes over a socket pair, their messages on it or in shared-memory
// rings (each test runs both ways), or three connected through a
// rendezvous directory. The backend as a whole is comm_gloo_test's.
#include "../src/comm/gloo/mesh.hpp"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "../src/comm/gloo/store.hpp"
#include "distopt/core/error.hpp"

namespace distopt::gloo_detail {
namespace {

using namespace std::chrono_literals;

// Ranks 0 and 1 of a group, over a socket pair, with rings or without.
std::pair<std::shared_ptr<Mesh>, std::shared_ptr<Mesh>> pair_of_meshes(bool rings) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) throw std::runtime_error("socketpair");
  std::shared_ptr<Mesh> b;
  std::thread t([&] { b = Mesh::over(1, {sv[1], -1}, rings); });
  auto a = Mesh::over(0, {-1, sv[0]}, rings);
  t.join();
  EXPECT_EQ(a->uses_rings(1), rings);
  EXPECT_EQ(b->uses_rings(0), rings);
  return {a, b};
}

class Mesh2 : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(SocketAndRings, Mesh2, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Rings" : "Socket"; });

Mesh::Clock::time_point soon(std::chrono::milliseconds d = 5s) {
  return Mesh::Clock::now() + d;
}

TEST_P(Mesh2, AMessageSentBeforeItsReceiveIsPostedWaitsForIt) {
  auto [a, b] = pair_of_meshes(GetParam());
  std::vector<int> x(1000), y(1000, 0);
  std::iota(x.begin(), x.end(), 7);
  auto s = a->send(1, 5, x.data(), x.size() * sizeof(int));
  ASSERT_TRUE(a->wait(*s, soon()));
  // Another slot's message, sent later, is taken first.
  int z = 42, w = 0;
  auto s2 = a->send(1, 6, &z, sizeof z);
  ASSERT_TRUE(a->wait(*s2, soon()));
  auto r2 = b->recv(0, 6, &w, sizeof w);
  ASSERT_TRUE(b->wait(*r2, soon()));
  EXPECT_EQ(w, 42);
  auto r = b->recv(0, 5, y.data(), y.size() * sizeof(int));
  ASSERT_TRUE(b->wait(*r, soon()));
  EXPECT_EQ(x, y);
}

TEST_P(Mesh2, MessagesOfOneSlotArriveInOrder) {
  auto [a, b] = pair_of_meshes(GetParam());
  std::vector<std::shared_ptr<Mesh::Op>> ops;
  int out[20], in[20] = {};
  for (int i = 0; i < 20; ++i) {
    out[i] = i * i;
    // Half posted before their message, half after.
    if (i % 2 == 0) ops.push_back(b->recv(0, 3, &in[i], sizeof(int)));
  }
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(a->wait(*a->send(1, 3, &out[i], sizeof(int)), soon()));
  for (int i = 1; i < 20; i += 2) ops.push_back(b->recv(0, 3, &in[i], sizeof(int)));
  for (auto& op : ops) ASSERT_TRUE(b->wait(*op, soon()));
  // The receives were posted in the order 0, 2, ..., 18, 1, 3, ...: they
  // take the messages in that order.
  std::vector<int> order;
  for (int i = 0; i < 20; i += 2) order.push_back(i);
  for (int i = 1; i < 20; i += 2) order.push_back(i);
  for (int k = 0; k < 20; ++k) EXPECT_EQ(in[order[static_cast<std::size_t>(k)]], k * k) << k;
}

TEST_P(Mesh2, LargeMessagesBothWaysAtOnceDoNotBlockEachOther) {
  auto [a, b] = pair_of_meshes(GetParam());
  const std::size_t n = 16 << 20;  // far above any socket buffer
  std::vector<char> xa(n, 'a'), xb(n, 'b'), ya(n), yb(n);
  std::thread t([&, b = b] {
    auto s = b->send(0, 1, xb.data(), n);
    auto r = b->recv(0, 1, yb.data(), n);
    EXPECT_TRUE(b->wait(*s, soon(20s)));
    EXPECT_TRUE(b->wait(*r, soon(20s)));
  });
  auto s = a->send(1, 1, xa.data(), n);
  auto r = a->recv(1, 1, ya.data(), n);
  EXPECT_TRUE(a->wait(*s, soon(20s)));
  EXPECT_TRUE(a->wait(*r, soon(20s)));
  t.join();
  EXPECT_EQ(ya, xb);
  EXPECT_EQ(yb, xa);
}

TEST_P(Mesh2, TwoThreadsWaitingAtOnceBothFinish) {
  auto [a, b] = pair_of_meshes(GetParam());
  int x1 = 1, x2 = 2, y1 = 0, y2 = 0;
  auto r1 = b->recv(0, 1, &y1, sizeof y1);
  auto r2 = b->recv(0, 2, &y2, sizeof y2);
  std::thread t([&, b = b] { EXPECT_TRUE(b->wait(*r2, soon())); });
  std::this_thread::sleep_for(20ms);
  a->wait(*a->send(1, 1, &x1, sizeof x1), soon());
  EXPECT_TRUE(b->wait(*r1, soon()));
  a->wait(*a->send(1, 2, &x2, sizeof x2), soon());
  t.join();
  EXPECT_EQ(y1, 1);
  EXPECT_EQ(y2, 2);
}

TEST_P(Mesh2, AWaitEndsOnAbortOnTimeOutAndOnALostPeer) {
  auto [a, b] = pair_of_meshes(GetParam());
  int y = 0;
  auto r = b->recv(0, 1, &y, sizeof y);
  std::thread t([&, b = b] {
    std::this_thread::sleep_for(30ms);
    b->abort_pending();
  });
  EXPECT_FALSE(b->wait(*r, soon()));
  t.join();
  // A later receive is not aborted: it times out.
  auto r2 = b->recv(0, 2, &y, sizeof y);
  const auto t0 = Mesh::Clock::now();
  EXPECT_THROW(
      {
        try {
          b->wait(*r2, soon(100ms));
        } catch (const MeshError& e) {
          EXPECT_NE(std::string(e.what()).find("Timed out"), std::string::npos) << e.what();
          throw;
        }
      },
      MeshError);
  EXPECT_LT(Mesh::Clock::now() - t0, 2s);
  // The peer goes: the wait names it.
  auto r3 = b->recv(0, 3, &y, sizeof y);
  a.reset();
  try {
    b->wait(*r3, soon());
    ADD_FAILURE() << "no error";
  } catch (const MeshError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
}

TEST_P(Mesh2, AMessageOfTheWrongSizeIsAnError) {
  auto [a, b] = pair_of_meshes(GetParam());
  int x[2] = {1, 2}, y = 0;
  a->wait(*a->send(1, 1, x, sizeof x), soon());
  auto r = b->recv(0, 1, &y, sizeof y);
  EXPECT_THROW(b->wait(*r, soon()), MeshError);
}

TEST_P(Mesh2, CloseEndsEveryWait) {
  auto [a, b] = pair_of_meshes(GetParam());
  int y = 0;
  auto r = b->recv(0, 1, &y, sizeof y);
  std::thread t([&, b = b] {
    std::this_thread::sleep_for(30ms);
    b->close();
  });
  EXPECT_THROW(b->wait(*r, soon()), MeshError);
  t.join();
}

TEST_P(Mesh2, AMessageSentBeforeThePeerWentIsStillReceived) {
  auto [a, b] = pair_of_meshes(GetParam());
  int x = 5, y = 0, z = 0;
  ASSERT_TRUE(a->wait(*a->send(1, 1, &x, sizeof x), soon()));
  a.reset();  // its connection (and its side of the rings) ends
  std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(b->wait(*b->recv(0, 1, &y, sizeof y), soon()));
  EXPECT_EQ(y, 5);
  EXPECT_THROW(b->wait(*b->recv(0, 1, &z, sizeof z), soon()), MeshError);
}

TEST_P(Mesh2, AWaitThatTakesAnotherThreadsMessageWakesIt) {
  // Thread t polls for slot 2; the main thread's wait for slot 1 may read
  // slot 2's message first: t must learn it at once, not at its deadline.
  auto [a, b] = pair_of_meshes(GetParam());
  const auto t0 = Mesh::Clock::now();
  for (int i = 0; i < 200; ++i) {
    int x1 = i, x2 = -i, y1 = 0, y2 = 0;
    auto r1 = b->recv(0, 1, &y1, sizeof y1);
    auto r2 = b->recv(0, 2, &y2, sizeof y2);
    std::thread t([&, b = b] { EXPECT_TRUE(b->wait(*r2, soon(3s))); });
    a->wait(*a->send(1, 2, &x2, sizeof x2), soon());
    a->wait(*a->send(1, 1, &x1, sizeof x1), soon());
    EXPECT_TRUE(b->wait(*r1, soon(3s)));
    t.join();
    ASSERT_EQ(y1, i);
    ASSERT_EQ(y2, -i);
  }
  EXPECT_LT(Mesh::Clock::now() - t0, 2s);
}

TEST_P(Mesh2, ACancelledReceiveLeavesItsMessageToTheNext) {
  auto [a, b] = pair_of_meshes(GetParam());
  int x = 7, y = 1, dead = -1;
  auto gone = b->recv(0, 1, &dead, sizeof dead);
  b->cancel(*gone);
  ASSERT_TRUE(a->wait(*a->send(1, 1, &x, sizeof x), soon()));
  EXPECT_TRUE(b->wait(*b->recv(0, 1, &y, sizeof y), soon()));
  EXPECT_EQ(y, 7);
  EXPECT_EQ(dead, -1);
  EXPECT_THROW(b->wait(*gone, soon()), MeshError);
  // A message to this rank itself is refused.
  EXPECT_THROW(b->send(1, 1, &x, sizeof x), PreconditionError);
}

TEST(Mesh, AGreetingMustNameAHigherRankAndThePrefixsLength) {
  unsigned char head[16] = {'d', 'm', 'e', 's', 'h', '1', '\n', '\0', 2, 0, 0, 0, 3, 0, 0, 0};
  EXPECT_EQ(Mesh::greeting(head, 3, 0, 4).rank, 2);
  EXPECT_EQ(Mesh::greeting(head, 3, 2, 4).rank, -1);  // not above the acceptor
  EXPECT_EQ(Mesh::greeting(head, 3, 0, 2).rank, -1);  // not in the group
  EXPECT_EQ(Mesh::greeting(head, 4, 0, 4).rank, -1);  // another prefix
  head[0] = 'x';
  EXPECT_EQ(Mesh::greeting(head, 3, 0, 4).rank, -1);
}

// Three meshes connected through a rendezvous directory.
TEST(Mesh, ThreeRanksConnectThroughARendezvousAndExchange) {
  const auto dir = std::filesystem::temp_directory_path() / ("mesh_test." + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const int n = 3;
  std::vector<std::shared_ptr<Mesh>> meshes(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      DirStore store(dir.string(), 10s);
      meshes[static_cast<std::size_t>(r)] = Mesh::connect(store, "e0", "127.0.0.1", r, n, 10s);
    });
  for (auto& t : threads) t.join();
  std::vector<int> got(n * n, -1);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const int v = 10 * r + q;
      auto s = meshes[static_cast<std::size_t>(r)]->send(q, 9, &v, sizeof v);
      ASSERT_TRUE(meshes[static_cast<std::size_t>(r)]->wait(*s, soon()));
    }
  for (int q = 0; q < n; ++q)
    for (int r = 0; r < n; ++r) {
      if (q == r) continue;
      auto op = meshes[static_cast<std::size_t>(q)]->recv(r, 9, &got[static_cast<std::size_t>(n * r + q)], sizeof(int));
      ASSERT_TRUE(meshes[static_cast<std::size_t>(q)]->wait(*op, soon()));
      EXPECT_EQ(got[static_cast<std::size_t>(n * r + q)], 10 * r + q);
    }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace distopt::gloo_detail
