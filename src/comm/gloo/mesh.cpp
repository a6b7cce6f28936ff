// The gloo backend's data path: see mesh.hpp. The wire: after a greeting
// ("dmesh1\n\0", the connecting rank as 4 bytes, the group's prefix as 4
// bytes of length and its bytes), messages, each a header of two
// little-endian 64-bit words (slot, bytes) and its bytes (docs/formats.md).
#include "mesh.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "distopt/core/error.hpp"
#include "store.hpp"

namespace distopt::gloo_detail {

namespace {

constexpr char kHello[8] = {'d', 'm', 'e', 's', 'h', '1', '\n', '\0'};
constexpr std::size_t kHeader = 16;
constexpr std::size_t kMaxPrefix = 1024;
// Looks at the connections before a wait sleeps (scripts/bench_gloo: 10
// looks were 0.8x MPI's steps per second, 50 about 1x, 200 no better).
constexpr int kSpins = 50;
// Socket buffers that hold a whole gradient bucket (the kernel caps them at
// net.core.wmem_max and rmem_max): with the default ones, 1 MiB messages
// took several polls each and training ran at 0.6-0.8x MPI's speed.
constexpr int kSocketBuffer = 4 << 20;

std::string errno_text(int e) { return std::strerror(e); }

void put_u64(unsigned char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
std::uint64_t get_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t{p[i]} << (8 * i);
  return v;
}
void put_u32(unsigned char* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
std::uint32_t get_u32(const unsigned char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::uint32_t{p[i]} << (8 * i);
  return v;
}

int ms_until(Mesh::Clock::time_point until, int cap) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Mesh::Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, cap));
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_options(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &kSocketBuffer, sizeof kSocketBuffer);
}

// Whole buffers on a non-blocking socket, up to `until`; false when it
// passed; throws CommError on a broken connection.
bool send_until(int fd, const void* buf, std::size_t n, Mesh::Clock::time_point until, const std::string& what) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) throw CommError(str(what, ": ", errno_text(errno)));
    pollfd pf{fd, POLLOUT, 0};
    if (ms_until(until, 1000) == 0) return false;
    ::poll(&pf, 1, ms_until(until, 1000));
  }
  return true;
}

bool recv_until(int fd, void* buf, std::size_t n, Mesh::Clock::time_point until, const std::string& what) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k == 0) throw CommError(str(what, ": the connection closed"));
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) throw CommError(str(what, ": ", errno_text(errno)));
    pollfd pf{fd, POLLIN, 0};
    if (ms_until(until, 1000) == 0) return false;
    ::poll(&pf, 1, ms_until(until, 1000));
  }
  return true;
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

// A listening socket on `host`, and its address as "<numeric host> <port>".
Fd listen_on(const std::string& host, int backlog, std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  AddrInfo found;
  if (const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &found.list); rc != 0)
    throw CommError(str("the host ", host, " has no address here (", ::gai_strerror(rc), ")"));
  std::string why = "no address";
  for (addrinfo* a = found.list; a; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0 || ::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      why = errno_text(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    char h[NI_MAXHOST], p[NI_MAXSERV];
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
        ::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, h, sizeof h, p, sizeof p,
                      NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
      why = errno_text(errno);
      continue;
    }
    address = str(h, " ", p);
    set_nonblocking(fd.get());
    return fd;
  }
  throw CommError(str("cannot listen on ", host, ": ", why));
}

// Connects to "<numeric host> <port>" before `until`; refused connections
// are tried again (a listener that is not there yet).
Fd connect_to(const std::string& address, Mesh::Clock::time_point until, const std::string& who) {
  const auto space = address.find(' ');
  if (space == std::string::npos) throw CommError(str(who, " left a malformed address: '", address, "'"));
  const std::string host = address.substr(0, space), port = address.substr(space + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  AddrInfo found;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found.list); rc != 0 || !found.list)
    throw CommError(str(who, " left a malformed address: '", address, "' (", ::gai_strerror(rc), ")"));
  const addrinfo* a = found.list;
  for (;;) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (fd.get() < 0) throw CommError(str("socket: ", errno_text(errno)));
    int rc = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd pf{fd.get(), POLLOUT, 0};
      if (::poll(&pf, 1, ms_until(until, 60'000)) <= 0) err = ETIMEDOUT;
      else {
        socklen_t len = sizeof err;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err == 0) return fd;
    if (Mesh::Clock::now() >= until)
      throw CommTimeout(str("timed out connecting to ", who, " at ", host, ":", port, " (", errno_text(err), ")"));
    if (err != ECONNREFUSED && err != ETIMEDOUT && err != EAGAIN)
      throw CommError(str("cannot connect to ", who, " at ", host, ":", port, ": ", errno_text(err)));
    ::poll(nullptr, 0, 10);
  }
}

}  // namespace

Mesh::Greeting Mesh::greeting(const unsigned char* head, std::size_t prefix_length, int rank, int size) {
  const std::uint32_t from = get_u32(head + 8), length = get_u32(head + 12);
  if (std::memcmp(head, kHello, sizeof kHello) != 0 || length != prefix_length || from <= std::uint32_t(rank) ||
      from >= std::uint32_t(size))
    return {};
  return {static_cast<int>(from)};
}

std::shared_ptr<Mesh> Mesh::over(int rank, std::vector<int> fds) {
  for (int fd : fds)
    if (fd >= 0) set_nonblocking(fd);
  return std::shared_ptr<Mesh>(new Mesh(rank, std::move(fds)));
}

void Mesh::check_listen(const std::string& host) {
  std::string address;
  listen_on(host, 1, address);
}

struct Mesh::Op {
  bool is_send = false;
  int peer = 0;
  std::uint64_t slot = 0;
  char* data = nullptr;
  std::size_t bytes = 0;
  std::size_t done = 0;  // sends: header bytes included
  unsigned char header[kHeader] = {};
  bool complete = false, aborted = false;
  std::string error;
};

struct Mesh::Peer {
  int rank = 0;
  int fd = -1;
  std::string broken;  // why the connection ended; empty while it works
  std::deque<std::shared_ptr<Op>> sends;  // the first is being written
  std::map<std::uint64_t, std::deque<std::shared_ptr<Op>>> posted;
  std::map<std::uint64_t, std::deque<std::vector<char>>> unexpected;
  // The message being read: its header, then its bytes into in_op's
  // buffer (a posted receive) or in_buf (none posted yet).
  unsigned char header[kHeader] = {};
  std::size_t header_got = 0;
  std::uint64_t in_slot = 0;
  std::size_t in_bytes = 0, in_got = 0;
  std::shared_ptr<Op> in_op;
  std::vector<char> in_buf;
};

std::shared_ptr<Mesh> Mesh::connect(KeyStore& store, const std::string& prefix, const std::string& host, int rank,
                                    int size, std::chrono::milliseconds timeout) {
  if (prefix.size() > kMaxPrefix) throw PreconditionError("mesh: prefix too long");
  const auto until = Clock::now() + timeout;
  std::string address;
  Fd listener = listen_on(host, size + 8, address);
  store.set(str(prefix, "/", rank), bytes_of(address));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r)
    if (r != rank) keys.push_back(str(prefix, "/", r));
  store.wait(keys, std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(
                                                               until - Clock::now())));
  std::vector<Fd> fds(static_cast<std::size_t>(size));
  // Connects to the lower ranks, each greeted with this rank and the prefix.
  std::vector<unsigned char> hello(sizeof kHello + 8 + prefix.size());
  std::memcpy(hello.data(), kHello, sizeof kHello);
  put_u32(hello.data() + 8, static_cast<std::uint32_t>(rank));
  put_u32(hello.data() + 12, static_cast<std::uint32_t>(prefix.size()));
  std::memcpy(hello.data() + 16, prefix.data(), prefix.size());
  for (int r = 0; r < rank; ++r) {
    const std::string who = str("rank ", r);
    const std::vector<char> a = store.get(str(prefix, "/", r));
    Fd fd = connect_to(std::string(a.begin(), a.end()), until, who);
    if (!send_until(fd.get(), hello.data(), hello.size(), until, str("greeting ", who)))
      throw CommTimeout(str("timed out greeting ", who));
    fds[static_cast<std::size_t>(r)] = std::move(fd);
  }
  // Accepts the higher ones.
  for (int accepted = 0; accepted < size - 1 - rank;) {
    pollfd pf{listener.get(), POLLIN, 0};
    if (::poll(&pf, 1, ms_until(until, 1000)) <= 0) {
      if (Clock::now() < until) continue;
      std::vector<int> missing;
      for (int r = rank + 1; r < size; ++r)
        if (fds[static_cast<std::size_t>(r)].get() < 0) missing.push_back(r);
      throw CommTimeout(str("timed out after ", seconds(timeout), " waiting for rank(s) ", rank_list(missing),
                            " to connect"));
    }
    Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (fd.get() < 0) continue;
    unsigned char head[16];
    // A connection that does not greet as a member of this group is
    // dropped (a stray one, or one of an earlier attempt).
    try {
      if (!recv_until(fd.get(), head, sizeof head, until, "greeting")) continue;
    } catch (const CommError&) {
      continue;
    }
    const int from = greeting(head, prefix.size(), rank, size).rank;
    if (from < 0 || fds[static_cast<std::size_t>(from)].get() >= 0) continue;
    std::string theirs(prefix.size(), '\0');
    try {
      if (!recv_until(fd.get(), theirs.data(), theirs.size(), until, "greeting") || theirs != prefix) continue;
    } catch (const CommError&) {
      continue;
    }
    fds[static_cast<std::size_t>(from)] = std::move(fd);
    ++accepted;
  }
  std::vector<int> raw(static_cast<std::size_t>(size), -1);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    set_options(fds[static_cast<std::size_t>(r)].get());
    set_nonblocking(fds[static_cast<std::size_t>(r)].get());
    raw[static_cast<std::size_t>(r)] = fds[static_cast<std::size_t>(r)].release();
  }
  return std::shared_ptr<Mesh>(new Mesh(rank, std::move(raw)));
}

Mesh::Mesh(int rank, std::vector<int> fds) : rank_(rank) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    throw CommError(str("eventfd: ", errno_text(errno)));
  }
  for (int r = 0; r < static_cast<int>(fds.size()); ++r) {
    if (r == rank) {
      peers_.push_back(nullptr);
      continue;
    }
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->fd = fds[static_cast<std::size_t>(r)];
    peers_.push_back(std::move(p));
  }
}

Mesh::~Mesh() {
  for (auto& p : peers_)
    if (p && p->fd >= 0) ::close(p->fd);
  ::close(wake_fd_);
}

std::shared_ptr<Mesh::Op> Mesh::send(int peer, std::uint64_t slot, const void* data, std::size_t bytes) {
  auto op = std::make_shared<Op>();
  op->is_send = true;
  op->peer = peer;
  op->slot = slot;
  op->data = const_cast<char*>(static_cast<const char*>(data));
  op->bytes = bytes;
  put_u64(op->header, slot);
  put_u64(op->header + 8, bytes);
  std::lock_guard lock(m_);
  Peer& p = *peers_.at(static_cast<std::size_t>(peer));
  if (!p.broken.empty()) {
    op->error = p.broken;
    return op;
  }
  post(p, op);
  p.sends.push_back(op);
  if (p.sends.size() == 1) write_some(p);
  if (!op->complete && polling_) wake();  // the poller now also waits to write
  return op;
}

std::shared_ptr<Mesh::Op> Mesh::recv(int peer, std::uint64_t slot, void* data, std::size_t bytes) {
  auto op = std::make_shared<Op>();
  op->peer = peer;
  op->slot = slot;
  op->data = static_cast<char*>(data);
  op->bytes = bytes;
  std::lock_guard lock(m_);
  Peer& p = *peers_.at(static_cast<std::size_t>(peer));
  auto it = p.unexpected.find(slot);
  if (it != p.unexpected.end()) {
    std::vector<char> m = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) p.unexpected.erase(it);
    if (m.size() != bytes)
      op->error = str("a message of ", m.size(), " bytes from rank ", peer, " where ", bytes, " were expected");
    else if (bytes > 0)
      std::memcpy(op->data, m.data(), bytes);
    op->complete = op->error.empty();
    return op;
  }
  if (!p.broken.empty()) {
    op->error = p.broken;
    return op;
  }
  post(p, op);
  p.posted[slot].push_back(op);
  return op;
}

void Mesh::post(Peer&, const std::shared_ptr<Op>& op) {
  if (pending_.size() >= 64)
    std::erase_if(pending_, [](const std::weak_ptr<Op>& w) {
      auto o = w.lock();
      return !o || o->complete || !o->error.empty();
    });
  pending_.push_back(op);
}

void Mesh::write_some(Peer& p) {
  while (!p.sends.empty() && p.broken.empty()) {
    Op& op = *p.sends.front();
    iovec iov[2];
    int n = 0;
    if (op.done < kHeader) iov[n++] = {op.header + op.done, kHeader - op.done};
    const std::size_t body_done = op.done > kHeader ? op.done - kHeader : 0;
    if (op.bytes > body_done) iov[n++] = {op.data + body_done, op.bytes - body_done};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<std::size_t>(n);
    const ssize_t k = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      broke(p, errno_text(errno));
      return;
    }
    op.done += static_cast<std::size_t>(k);
    if (op.done < kHeader + op.bytes) continue;
    op.complete = true;
    p.sends.pop_front();
  }
}

void Mesh::read_some(Peer& p) {
  while (p.broken.empty()) {
    if (p.header_got < kHeader) {
      const ssize_t k = ::recv(p.fd, p.header + p.header_got, kHeader - p.header_got, MSG_DONTWAIT);
      if (k == 0) return broke(p, "the connection closed");
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) broke(p, errno_text(errno));
        return;
      }
      p.header_got += static_cast<std::size_t>(k);
      if (p.header_got < kHeader) continue;
      p.in_slot = get_u64(p.header);
      p.in_bytes = get_u64(p.header + 8);
      p.in_got = 0;
      auto it = p.posted.find(p.in_slot);
      if (it != p.posted.end()) {
        p.in_op = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) p.posted.erase(it);
        if (p.in_op->bytes != p.in_bytes) {
          p.in_op->error = str("a message of ", p.in_bytes, " bytes from rank ", p.rank, " where ", p.in_op->bytes,
                               " were expected");
          p.in_op.reset();
          return broke(p, "it sent a message of an unexpected size");
        }
      } else {
        p.in_buf.clear();  // grown as the bytes come: a size read is not trusted before them
      }
    }
    if (p.in_got < p.in_bytes) {
      std::size_t room = p.in_bytes - p.in_got;
      if (!p.in_op) {
        if (p.in_buf.size() == p.in_got)
          p.in_buf.resize(p.in_got + std::min(room, std::max<std::size_t>(p.in_got, std::size_t{64} << 10)));
        room = p.in_buf.size() - p.in_got;
      }
      char* into = p.in_op ? p.in_op->data : p.in_buf.data();
      const ssize_t k = ::recv(p.fd, into + p.in_got, room, MSG_DONTWAIT);
      if (k == 0) return broke(p, "the connection closed");
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) broke(p, errno_text(errno));
        return;
      }
      p.in_got += static_cast<std::size_t>(k);
      if (p.in_got < p.in_bytes) continue;
    }
    // A whole message.
    p.header_got = 0;
    if (p.in_op) {
      p.in_op->complete = true;
      p.in_op.reset();
      continue;
    }
    // A receive posted while it arrived takes it; else it waits for one.
    auto it = p.posted.find(p.in_slot);
    if (it != p.posted.end() && !p.unexpected.contains(p.in_slot)) {
      std::shared_ptr<Op> op = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) p.posted.erase(it);
      if (op->bytes != p.in_bytes) {
        op->error = str("a message of ", p.in_bytes, " bytes from rank ", p.rank, " where ", op->bytes,
                        " were expected");
        return broke(p, "it sent a message of an unexpected size");
      }
      if (op->bytes > 0) std::memcpy(op->data, p.in_buf.data(), op->bytes);
      op->complete = true;
      p.in_buf = {};
      continue;
    }
    p.unexpected[p.in_slot].push_back(std::move(p.in_buf));
    p.in_buf = {};
  }
}

void Mesh::broke(Peer& p, const std::string& why) {
  if (!p.broken.empty()) return;
  p.broken = str("the connection to rank ", p.rank, " ended: ", why);
  ::shutdown(p.fd, SHUT_RDWR);
  for (auto& op : p.sends)
    if (op->error.empty()) op->error = p.broken;
  p.sends.clear();
  for (auto& [slot, q] : p.posted)
    for (auto& op : q)
      if (op->error.empty()) op->error = p.broken;
  p.posted.clear();
  if (p.in_op && p.in_op->error.empty()) p.in_op->error = p.broken;
  p.in_op.reset();
  p.in_buf = {};
}

void Mesh::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t k = ::write(wake_fd_, &one, sizeof one);
}

bool Mesh::wait(Op& op, Clock::time_point until) {
  std::unique_lock lock(m_);
  std::vector<pollfd> fds;
  std::vector<Peer*> of;
  for (;;) {
    if (op.complete) return true;
    if (!op.error.empty()) throw MeshError(op.error);
    if (op.aborted) return false;
    if (Clock::now() >= until)
      throw MeshError(str("Timed out waiting for ", op.is_send ? "a send to" : "a message from", " rank ", op.peer));
    if (polling_) {  // another thread polls for both
      cv_.wait_until(lock, until);
      continue;
    }
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    of.assign(1, nullptr);
    for (auto& p : peers_) {
      if (!p || !p->broken.empty()) continue;
      fds.push_back({p->fd, static_cast<short>(POLLIN | (p->sends.empty() ? 0 : POLLOUT)), 0});
      of.push_back(p.get());
    }
    polling_ = true;
    lock.unlock();
    // A few looks without sleeping, giving the processor to others between
    // them (a peer on this core may be the one to answer), then a poll
    // that sleeps.
    int ready = 0;
    for (int spin = 0; spin < kSpins && ready == 0; ++spin) {
      ready = ::poll(fds.data(), fds.size(), 0);
      if (ready == 0) ::sched_yield();
    }
    if (ready == 0) ready = ::poll(fds.data(), fds.size(), ms_until(until, 1000));
    lock.lock();
    polling_ = false;
    if (ready > 0 && !closed_) {
      if (fds[0].revents) {
        std::uint64_t count;
        [[maybe_unused]] const ssize_t k = ::read(wake_fd_, &count, sizeof count);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        if (fds[i].revents & POLLOUT) write_some(*of[i]);
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_some(*of[i]);
      }
    }
    cv_.notify_all();
  }
}

void Mesh::abort_pending() {
  std::lock_guard lock(m_);
  for (auto& w : pending_)
    if (auto op = w.lock(); op && !op->complete) op->aborted = true;
  pending_.clear();
  wake();
  cv_.notify_all();
}

void Mesh::close() {
  std::lock_guard lock(m_);
  closed_ = true;
  for (auto& p : peers_)
    if (p) broke(*p, "this process closed it");
  wake();
  cv_.notify_all();
}

}  // namespace distopt::gloo_detail
