// The TCP rendezvous store (include/distopt/comm/tcp_store.hpp): its wire
// format, its table, and a server with clients on this machine's loopback.
// The gloo worlds that meet through it are in comm_gloo_test.cpp and, as
// processes, in cli_gloo_test.sh.
#include "distopt/comm/tcp_store.hpp"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "distopt/comm/types.hpp"
#include "distopt/core/error.hpp"
#include "free_port.hpp"

namespace distopt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<char> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

TcpEndpoint local(int port) {
  return TcpEndpoint{"127.0.0.1", port};
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(TcpStore, RequestsCrossTheWireWholeAndInPieces) {
  const StoreRequest set{StoreOp::set, "e0/3", bytes("an address")};
  const StoreRequest has{StoreOp::has, "closed", {}};
  const std::string wire = encode_store_request(set) + encode_store_request(has);
  // Fed one byte at a time, nothing comes out before each request is whole.
  std::string in;
  std::vector<StoreRequest> out;
  for (char c : wire) {
    in += c;
    while (std::optional<StoreRequest> r = take_store_request(in)) out.push_back(*r);
  }
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].op, StoreOp::set);
  EXPECT_EQ(out[0].key, "e0/3");
  EXPECT_EQ(out[0].value, bytes("an address"));
  EXPECT_EQ(out[1].op, StoreOp::has);
  EXPECT_EQ(out[1].key, "closed");
  EXPECT_TRUE(out[1].value.empty());
  EXPECT_TRUE(in.empty());
}

TEST(TcpStore, MalformedRequestsAreRefusedBeforeAnythingIsAllocated) {
  std::string unknown("\x09", 1);
  EXPECT_EQ(message_of([&] { take_store_request(unknown); }), "store request: unknown operation 9");
  // A key length of 2^32 - 1 with no key behind it: refused from the header alone.
  std::string long_key("\x03\xff\xff\xff\xff", 5);
  EXPECT_EQ(message_of([&] { take_store_request(long_key); }),
            "store request: a key of 4294967295 bytes (at most 1024)");
  std::string long_value = encode_store_request({StoreOp::set, "k", {}});
  long_value.resize(long_value.size() - 4);
  long_value += std::string("\x01\x00\x00\x02", 4);  // 32 MiB + 1
  EXPECT_EQ(message_of([&] { take_store_request(long_value); }),
            "store request: a value of 33554433 bytes (at most 16777216)");
}

TEST(TcpStore, TheTableCreatesOnceAndAnswersAsTheWireSays) {
  StoreTable t;
  EXPECT_EQ(t.answer({StoreOp::has, "k", {}}), std::string(1, '\0'));
  EXPECT_EQ(t.answer({StoreOp::read, "k", {}}), std::string(1, '\0'));
  EXPECT_EQ(t.answer({StoreOp::create_once, "k", bytes("first")}), std::string(1, '\1'));
  EXPECT_EQ(t.answer({StoreOp::create_once, "k", bytes("second")}), std::string(1, '\0'));
  EXPECT_EQ(t.answer({StoreOp::read, "k", {}}), std::string("\1\5\0\0\0first", 10));
  EXPECT_EQ(t.answer({StoreOp::set, "k", bytes("third")}), std::string(1, '\1'));
  EXPECT_EQ(t.answer({StoreOp::read, "k", {}}), std::string("\1\5\0\0\0third", 10));
  EXPECT_EQ(t.bytes(), 6u);
  // Past kStoreMaxBytes a write is refused, and nothing else changes.
  const std::vector<char> big(kStoreMaxValue, 'x');
  std::size_t i = 0;
  std::string a;
  while ((a = t.answer({StoreOp::set, "big" + std::to_string(i), big})) == std::string(1, '\1')) ++i;
  EXPECT_EQ(a, std::string(1, '\2'));
  EXPECT_EQ(i, 15u);  // 15 values of 16 MiB and their keys, and "k": under 256 MiB; a 16th is not
  EXPECT_EQ(t.answer({StoreOp::has, "big" + std::to_string(i), {}}), std::string(1, '\0'));
}

TEST(TcpStore, EndpointsParseOrAreNamed) {
  EXPECT_FALSE(tcp_endpoint("/tmp/rv").has_value());
  const auto e = tcp_endpoint("tcp://node07:29500");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->host, "node07");
  EXPECT_EQ(e->port, 29500);
  EXPECT_EQ(e->text(), "tcp://node07:29500");
  const auto v6 = tcp_endpoint("tcp://[::1]:1");
  ASSERT_TRUE(v6.has_value());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->text(), "tcp://[::1]:1");
  EXPECT_EQ(message_of([] { tcp_endpoint("tcp://node07"); }),
            "--rendezvous tcp://node07: no port (expected tcp://HOST:PORT)");
  EXPECT_EQ(message_of([] { tcp_endpoint("tcp://:80"); }),
            "--rendezvous tcp://:80: no host (expected tcp://HOST:PORT)");
  for (const char* bad : {"tcp://h:0", "tcp://h:65536", "tcp://h:80x", "tcp://h:", "tcp://h:-1"})
    EXPECT_NE(message_of([&] { tcp_endpoint(bad); }).find("the port is not a number from 1 to 65535"),
              std::string::npos)
        << bad;
  EXPECT_NE(message_of([] { tcp_endpoint("tcp://::1:80"); }).find("an IPv6 address goes in brackets"),
            std::string::npos);
}

TEST(TcpStore, ClientsOfOneServerSeeOneTableAndOneCreatorPerKey) {
  const int port = free_port();
  StoreServer server(port, 5s);
  constexpr int kClients = 8, kKeys = 50;
  std::vector<std::thread> threads;
  std::vector<std::vector<bool>> created(kClients, std::vector<bool>(kKeys));
  for (int c = 0; c < kClients; ++c)
    threads.emplace_back([&, c] {
      StoreClient client(local(port), 5s);
      for (int k = 0; k < kKeys; ++k)
        created[c][k] = client.create_once("decision/" + std::to_string(k), bytes("client " + std::to_string(c)));
    });
  for (auto& t : threads) t.join();
  StoreClient reader(local(port), 5s);
  for (int k = 0; k < kKeys; ++k) {
    int creators = 0, creator = -1;
    for (int c = 0; c < kClients; ++c)
      if (created[c][k]) ++creators, creator = c;
    ASSERT_EQ(creators, 1) << "key " << k;
    EXPECT_EQ(reader.read("decision/" + std::to_string(k)), bytes("client " + std::to_string(creator)));
  }
  EXPECT_FALSE(reader.has("nothing"));
  EXPECT_FALSE(reader.read("nothing").has_value());
  reader.set("empty", {});
  EXPECT_TRUE(reader.has("empty"));
  EXPECT_EQ(reader.read("empty"), std::vector<char>{});
  const std::vector<char> large(kStoreMaxValue, 'v');
  reader.set("large", large);
  EXPECT_EQ(reader.read("large"), large);
}

TEST(TcpStore, ATakenPortANonStoreAndNoServerAreOneLineEach) {
  const int port = free_port();
  StoreServer server(port, 1s);
  const std::string taken = message_of([&] { StoreServer again(port, 1s); });
  EXPECT_EQ(
      taken.find("rendezvous: cannot serve the store on port " + std::to_string(port) + ": Address already in use"), 0u)
      << taken;
  EXPECT_EQ(taken.find('\n'), std::string::npos);

  // No one on the port: retried until the time-out, then named.
  const int nobody = free_port();
  const auto t0 = Clock::now();
  const std::string none = message_of([&] { StoreClient c(local(nobody), 400ms); });
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(none, "rendezvous tcp://127.0.0.1:" + std::to_string(nobody) +
                      ": no store answered within 0.4 s (is the host reachable, and rank 0 started there?)");
  EXPECT_GE(waited, 0.4);
  EXPECT_LT(waited, 2.0);

  // Something else on the port, which answers in its own words.
  const int other = free_port();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(other));
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  std::thread http([fd] {
    const int c = ::accept(fd, nullptr, nullptr);
    const char reply[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
    ::send(c, reply, sizeof reply - 1, MSG_NOSIGNAL);
    ::close(c);
  });
  const std::string wrong = message_of([&] { StoreClient c(local(other), 2s); });
  http.join();
  ::close(fd);
  EXPECT_EQ(wrong.find("rendezvous tcp://127.0.0.1:" + std::to_string(other) +
                       ": something answers on that port, but not a distopt store"),
            0u)
      << wrong;

  EXPECT_NE(message_of([] {
              StoreClient c({"no.such.host.invalid", 80}, 1s);
            }).find("the host no.such.host.invalid has no address here"),
            std::string::npos);
}

TEST(TcpStore, AClientStartedFirstWaitsForTheServer) {
  const int port = free_port();
  std::unique_ptr<StoreServer> server;
  std::thread later([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<StoreServer>(port, 5s);
  });
  StoreClient client(local(port), 5s);
  later.join();
  client.set("k", bytes("v"));
  EXPECT_EQ(client.read("k"), bytes("v"));
}

TEST(TcpStore, TheServerStaysUntilItsClientsHangUpAndTheyLearnWhenItIsGone) {
  const int port = free_port();
  auto server = std::make_unique<StoreServer>(port, 5s);
  auto client = std::make_unique<StoreClient>(local(port), 5s);
  client->set("k", bytes("v"));
  // The server's owner ends while a client still has work: the server waits.
  std::atomic<bool> stopped{false};
  std::thread owner([&] {
    server.reset();
    stopped = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(stopped.load());
  EXPECT_EQ(client->read("k"), bytes("v"));
  client.reset();
  owner.join();
  EXPECT_TRUE(stopped.load());

  // Past its linger, it stops anyway; the client's next request says so,
  // and so does every one after it.
  server = std::make_unique<StoreServer>(port, 100ms);
  StoreClient left(local(port), 5s);
  server.reset();
  const std::string gone = message_of([&] { left.has("k"); });
  EXPECT_EQ(gone, "rendezvous tcp://127.0.0.1:" + std::to_string(port) +
                      ": the store hung up (the store's process, rank 0's, is gone?)");
  EXPECT_EQ(message_of([&] { left.has("k"); }), gone);
}

}  // namespace
}  // namespace distopt
