// The key-value store over TCP; see include/distopt/comm/tcp_store.hpp.
#include "distopt/comm/tcp_store.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <thread>

#include "distopt/comm/types.hpp"
#include "distopt/core/error.hpp"
#include "seconds.hpp"

namespace distopt {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

void put_u32(std::string& out, std::size_t n) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
}

std::uint32_t get_u32(std::string_view in, std::size_t at) {
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return n;
}

using comm_detail::seconds;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// Sends all of `data` by `deadline` (waiting for room in the socket's
// buffer): false where the connection failed or the time passed (then
// `timed_out`).
bool send_all(int fd, std::string_view data, Clock::time_point deadline, bool& timed_out) {
  timed_out = false;
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      const int ready = ::poll(&p, 1, remaining_ms(deadline));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) timed_out = true;
      if (ready <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

}  // namespace

std::optional<StoreRequest> take_store_request(std::string& in) {
  if (in.empty()) return std::nullopt;
  const auto op = static_cast<unsigned char>(in[0]);
  if (op < 1 || op > 4) throw InvalidInput(str("store request: unknown operation ", static_cast<int>(op)));
  StoreRequest r;
  r.op = static_cast<StoreOp>(op);
  if (in.size() < 5) return std::nullopt;
  const std::uint32_t klen = get_u32(in, 1);
  if (klen > kStoreMaxKey)
    throw InvalidInput(str("store request: a key of ", klen, " bytes (at most ", kStoreMaxKey, ")"));
  std::size_t at = 5 + klen;
  if (in.size() < at) return std::nullopt;
  const bool valued = r.op == StoreOp::set || r.op == StoreOp::create_once;
  std::uint32_t vlen = 0;
  if (valued) {
    if (in.size() < at + 4) return std::nullopt;
    vlen = get_u32(in, at);
    if (vlen > kStoreMaxValue)
      throw InvalidInput(str("store request: a value of ", vlen, " bytes (at most ", kStoreMaxValue, ")"));
    at += 4;
    if (in.size() < at + vlen) return std::nullopt;
  }
  r.key.assign(in, 5, klen);
  r.value.assign(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + vlen));
  in.erase(0, at + vlen);
  return r;
}

std::string encode_store_request(const StoreRequest& r) {
  DISTOPT_CHECK(r.key.size() <= kStoreMaxKey, "store key of ", r.key.size(), " bytes");
  DISTOPT_CHECK(r.value.size() <= kStoreMaxValue, "store value of ", r.value.size(), " bytes");
  std::string out(1, static_cast<char>(r.op));
  put_u32(out, r.key.size());
  out += r.key;
  if (r.op == StoreOp::set || r.op == StoreOp::create_once) {
    put_u32(out, r.value.size());
    out.append(r.value.begin(), r.value.end());
  }
  return out;
}

std::string StoreTable::answer(const StoreRequest& r) {
  const auto it = values_.find(r.key);
  const bool found = it != values_.end();
  switch (r.op) {
    case StoreOp::set:
    case StoreOp::create_once: {
      if (r.op == StoreOp::create_once && found) return std::string(1, '\0');
      const std::size_t before = found ? it->second.size() + it->first.size() : 0;
      const std::size_t after = r.value.size() + r.key.size();
      if (bytes_ - before + after > kStoreMaxBytes) return std::string(1, '\2');
      bytes_ = bytes_ - before + after;
      values_[r.key] = r.value;
      return std::string(1, '\1');
    }
    case StoreOp::has:
      return std::string(1, found ? '\1' : '\0');
    case StoreOp::read: {
      if (!found) return std::string(1, '\0');
      std::string out(1, '\1');
      put_u32(out, it->second.size());
      out.append(it->second.begin(), it->second.end());
      return out;
    }
  }
  return std::string(1, '\2');
}

std::string TcpEndpoint::text() const {
  const bool v6 = host.find(':') != std::string::npos;
  return str("tcp://", v6 ? "[" : "", host, v6 ? "]" : "", ":", port);
}

std::optional<TcpEndpoint> tcp_endpoint(std::string_view rendezvous) {
  constexpr std::string_view scheme = "tcp://";
  if (rendezvous.substr(0, scheme.size()) != scheme) return std::nullopt;
  const std::string_view rest = rendezvous.substr(scheme.size());
  const auto bad = [&](const char* why) {
    return InvalidInput(str("--rendezvous ", rendezvous, ": ", why, " (expected tcp://HOST:PORT)"));
  };
  TcpEndpoint e;
  std::string_view port;
  if (!rest.empty() && rest.front() == '[') {
    const auto close = rest.find(']');
    if (close == std::string_view::npos || close + 1 >= rest.size() || rest[close + 1] != ':')
      throw bad("an IPv6 address goes in brackets, followed by :PORT");
    e.host = std::string(rest.substr(1, close - 1));
    port = rest.substr(close + 2);
  } else {
    const auto colon = rest.rfind(':');
    if (colon == std::string_view::npos) throw bad("no port");
    e.host = std::string(rest.substr(0, colon));
    if (e.host.find(':') != std::string::npos) throw bad("an IPv6 address goes in brackets");
    port = rest.substr(colon + 1);
  }
  if (e.host.empty()) throw bad("no host");
  if (e.host.find_first_of("/ \t") != std::string::npos) throw bad("the host is not a host name or address");
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), e.port);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || e.port < 1 || e.port > 65535)
    throw bad("the port is not a number from 1 to 65535");
  return e;
}

// ---------------------------------------------------------------- server

struct StoreServer::Impl {
  struct Client {
    int fd = -1;
    bool greeted = false;
    std::string in;
  };
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  milliseconds linger;
  std::atomic<bool> closing{false};
  StoreTable table;
  std::vector<Client> clients;
  std::thread thread;
  static constexpr std::size_t kMaxClients = 4096;

  // A client that reads nothing is dropped after a second rather than let
  // stall the store.
  static bool answer_with(int fd, std::string_view data) {
    bool timed_out = false;
    return send_all(fd, data, Clock::now() + milliseconds(1000), timed_out);
  }

  // Reads what client c sent and answers each whole request as it comes: a
  // malformed header is refused as soon as its bytes are in, and at most a
  // request's worth (its declared key and value) is held. False: drop it.
  bool serve(Client& c) {
    char buf[65536];
    for (;;) {
      // Before the greeting, only its bytes.
      const std::size_t want = c.greeted ? sizeof buf : kStoreHello.size() - c.in.size();
      const ssize_t n = ::recv(c.fd, buf, want, MSG_DONTWAIT);
      if (n == 0) return false;
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK;
      }
      c.in.append(buf, static_cast<std::size_t>(n));
      if (!c.greeted) {
        if (c.in.size() < kStoreHello.size()) continue;
        if (c.in != kStoreHello) return false;
        c.in.clear();
        c.greeted = true;
        if (!answer_with(c.fd, kStoreHello)) return false;
        continue;
      }
      try {
        while (std::optional<StoreRequest> r = take_store_request(c.in)) {
          const std::string a = table.answer(*r);
          if (!answer_with(c.fd, a) || a == "\2") return false;
        }
      } catch (const InvalidInput&) {
        return false;  // malformed: not one of ours
      }
    }
  }

  void run() {
    Clock::time_point closing_since{};
    for (;;) {
      if (closing.load()) {
        if (closing_since == Clock::time_point{}) closing_since = Clock::now();
        if (clients.empty() || Clock::now() - closing_since >= linger) break;
      }
      std::vector<pollfd> fds{{listen_fd, POLLIN, 0}, {wake[0], POLLIN, 0}};
      for (const Client& c : clients) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 100) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (fds[1].revents != 0) {
        char b[16];
        while (::read(wake[0], b, sizeof b) > 0) {
        }
      }
      // Answer before accepting: a client's index is its pollfd's minus 2.
      for (std::size_t i = clients.size(); i-- > 0;) {
        if (fds[i + 2].revents == 0) continue;
        if (!serve(clients[i])) {
          ::close(clients[i].fd);
          clients.erase(clients.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0 && clients.size() >= kMaxClients) {
          ::close(fd);  // (a run has one connection per process)
        } else if (fd >= 0) {
          const int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          clients.push_back(Client{fd, false, {}});
        }
      }
    }
    for (Client& c : clients) ::close(c.fd);
    clients.clear();
  }
};

StoreServer::StoreServer(int port, milliseconds linger) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.linger = linger;
  const auto fail = [&](const std::string& what, int err) {
    if (s.listen_fd >= 0) ::close(s.listen_fd);
    return InvalidInput(str("rendezvous: cannot serve the store on port ", port, ": ", what, std::strerror(err),
                            err == EADDRINUSE ? " (another run's store or another service holds it: choose another "
                                                "port, --rendezvous tcp://HOST:PORT or MASTER_PORT)"
                                              : ""));
  };
  // IPv6 with IPv4 mapped where the machine has it; else IPv4.
  s.listen_fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1, zero = 0;
  if (s.listen_fd >= 0) {
    ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ::setsockopt(s.listen_fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<std::uint16_t>(port));
    if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      const int err = errno;
      if (err != EAFNOSUPPORT && err != EADDRNOTAVAIL) throw fail("", err);
      ::close(s.listen_fd);
      s.listen_fd = -1;
    }
  }
  if (s.listen_fd < 0) {
    s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s.listen_fd < 0) throw fail("socket: ", errno);
    ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw fail("", errno);
  }
  if (::listen(s.listen_fd, 1024) != 0) throw fail("listen: ", errno);
  if (::pipe2(s.wake, O_CLOEXEC | O_NONBLOCK) != 0) throw fail("pipe: ", errno);
  s.thread = std::thread([&s] {
    // The process's signals (a SIGTERM to stop training) go to its other threads.
    sigset_t all;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
    s.run();
  });
}

StoreServer::~StoreServer() {
  Impl& s = *impl_;
  s.closing = true;
  const char b = 1;
  [[maybe_unused]] const ssize_t n = ::write(s.wake[1], &b, 1);
  if (s.thread.joinable()) s.thread.join();
  ::close(s.listen_fd);
  ::close(s.wake[0]);
  ::close(s.wake[1]);
}

// ---------------------------------------------------------------- client

namespace {

// One attempt to connect to any of the addresses, within `deadline`: the
// socket, or -1.
int connect_once(addrinfo* found, Clock::time_point deadline) {
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = -1;
      if (::poll(&p, 1, std::min(remaining_ms(deadline), 1000)) == 1) {
        int err = 0;
        socklen_t len = sizeof err;
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) rc = 0;
      }
    }
    if (rc == 0) {
      const int flags = ::fcntl(fd, F_GETFL);
      ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    ::close(fd);
  }
  return -1;
}

// Receives exactly n bytes by `deadline`: false where the connection ended
// or the time passed (then `timed_out`).
bool recv_exact(int fd, char* out, std::size_t n, Clock::time_point deadline, bool& timed_out) {
  timed_out = false;
  while (n > 0) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready == 0) {
      timed_out = true;
      return false;
    }
    if (ready < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    const ssize_t got = ::recv(fd, out, n, 0);
    if (got == 0) return false;
    if (got < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    out += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

}  // namespace

StoreClient::StoreClient(const TcpEndpoint& at, milliseconds timeout) : at_(at), timeout_(timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const int rc = ::getaddrinfo(at.host.c_str(), std::to_string(at.port).c_str(), &hints, &found);
    if (rc == 0) break;
    // A name server that did not answer (yet) is asked again until the time-out.
    if (rc != EAI_AGAIN || Clock::now() >= deadline)
      throw InvalidInput(
          str("rendezvous ", at.text(), ": the host ", at.host, " has no address here (", ::gai_strerror(rc), ")"));
    std::this_thread::sleep_for(milliseconds(100));
  }
  for (;;) {
    fd_ = connect_once(found, deadline);
    if (fd_ >= 0) {
      // The store's greeting; a peer that hangs up without a word (a
      // proxy, a server going down) is retried as one that did not answer.
      std::string hello;
      char buf[kStoreHello.size()];
      bool timed_out = false;
      if (send_all(fd_, kStoreHello, deadline, timed_out)) {
        while (hello.size() < kStoreHello.size() && recv_exact(fd_, buf, 1, deadline, timed_out)) hello += buf[0];
      }
      if (hello == kStoreHello) break;
      ::close(fd_);
      fd_ = -1;
      if (!hello.empty()) {
        ::freeaddrinfo(found);
        throw CommError(str("rendezvous ", at.text(),
                            ": something answers on that port, but not a distopt store "
                            "(another service, or torchrun's own store? choose another port)"));
      }
    }
    if (Clock::now() >= deadline) {
      ::freeaddrinfo(found);
      throw CommTimeout(str("rendezvous ", at.text(), ": no store answered within ", seconds(timeout),
                            " (is the host reachable, and rank 0 started there?)"));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(milliseconds(50), deadline - Clock::now()));
  }
  ::freeaddrinfo(found);
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

std::string StoreClient::ask(const StoreRequest& r) {
  std::lock_guard lock(m_);
  const auto lost = [&](const char* what) {
    broken_ = str("rendezvous ", at_.text(), ": ", what, " (the store's process, rank 0's, is gone?)");
    return CommError(broken_);
  };
  if (!broken_.empty()) throw CommError(broken_);
  const auto deadline = Clock::now() + timeout_;
  bool timed_out = false;
  const auto late = [&] {
    // A late answer would be read as the next one's: the connection is done.
    broken_ = str("rendezvous ", at_.text(), ": the store did not answer within ", seconds(timeout_));
    return CommTimeout(broken_);
  };
  if (!send_all(fd_, encode_store_request(r), deadline, timed_out)) {
    if (timed_out) throw late();
    throw lost("the store hung up");
  }
  char status = 0;
  if (!recv_exact(fd_, &status, 1, deadline, timed_out)) {
    if (timed_out) throw late();
    throw lost("the store hung up");
  }
  if (status == 2) {  // (and the server closed the connection)
    broken_ = str("rendezvous ", at_.text(), ": the store is full (", kStoreMaxBytes, " bytes)");
    throw CommError(broken_);
  }
  std::string out(1, status);
  if (r.op == StoreOp::read && status == 1) {
    char len[4];
    if (!recv_exact(fd_, len, 4, deadline, timed_out)) throw lost("the store hung up in an answer");
    const std::uint32_t n = get_u32(std::string_view(len, 4), 0);
    if (n > kStoreMaxValue) throw lost("the store sent a malformed answer");
    out.resize(1 + n);
    if (!recv_exact(fd_, out.data() + 1, n, deadline, timed_out)) throw lost("the store hung up in an answer");
  }
  return out;
}

void StoreClient::set(const std::string& key, const std::vector<char>& value) {
  ask({StoreOp::set, key, value});
}

bool StoreClient::create_once(const std::string& key, const std::vector<char>& value) {
  return ask({StoreOp::create_once, key, value})[0] == 1;
}

bool StoreClient::has(const std::string& key) {
  return ask({StoreOp::has, key, {}})[0] == 1;
}

std::optional<std::vector<char>> StoreClient::read(const std::string& key) {
  const std::string a = ask({StoreOp::read, key, {}});
  if (a[0] != 1) return std::nullopt;
  return std::vector<char>(a.begin() + 1, a.end());
}

}  // namespace distopt
