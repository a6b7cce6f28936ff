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
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string_view>
#include <utility>

#include "distopt/core/error.hpp"
#include "store.hpp"

namespace distopt::gloo_detail {

namespace {

constexpr char kHello[8] = {'d', 'm', 'e', 's', 'h', '1', '\n', '\0'};
constexpr std::size_t kHeader = 16;
constexpr std::size_t kMaxPrefix = 1024;
// A message's length is trusted this far before its bytes come (beyond,
// its buffer doubles as they come; 64 MiB made each garbage header cost
// mesh_fuzz 30 ms under AddressSanitizer).
constexpr std::size_t kTrusted = std::size_t{1} << 20;
// Buffers kept for reuse (messages that came before their receive).
constexpr std::size_t kSpares = 8;
// Looks at the connections before a wait sleeps (scripts/bench_gloo: 10
// looks were 0.8x MPI's steps per second, 50 about 1x, 200 no better).
constexpr int kSpins = 50;
// Between processes of one machine: looks at the rings (yielding between
// them) before a wait sleeps in 1 ms polls; the sockets are looked at
// every kSocketLook-th time (a lost peer, a wake-up). 200, 2000 and 20000
// looks trained the same (scripts/bench_gloo's mlp, 4 processes on 2
// cores), and 100 too (1.2x MPI's steps per second), while 2000 starved
// other processes of a loaded machine (cli.slurm beside cli.gloo: a job
// ran past its scancel, processes did not start within 10 s).
constexpr int kRingSpins = 100;
constexpr int kSocketLook = 16;
// Shared memory for the rings of one group, all pairs together: at most
// 32 MiB, each ring 256 KiB to 4 MiB (a group too large for 256 KiB rings
// uses TCP only).
constexpr std::size_t kRingBudget = std::size_t{32} << 20;
constexpr std::size_t kRingMin = std::size_t{256} << 10, kRingMax = std::size_t{4} << 20;
// Socket buffers that hold a whole gradient bucket (the kernel caps them at
// net.core.wmem_max and rmem_max): with the default ones, 1 MiB messages
// took several polls each and training ran at 0.6-0.8x MPI's speed.
constexpr int kSocketBuffer = 4 << 20;

std::string errno_text(int e) {
  return std::strerror(e);
}

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

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

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

std::shared_ptr<Mesh> Mesh::over(int rank, std::vector<int> fds, bool rings) {
  for (int fd : fds)
    if (fd >= 0) set_nonblocking(fd);
  const int size = static_cast<int>(fds.size());
  auto mesh = std::shared_ptr<Mesh>(new Mesh(rank, std::move(fds)));
  if (rings) mesh->share_memory(ring_capacity(size), Clock::now() + std::chrono::seconds(10));
  return mesh;
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
  std::unique_ptr<char[]> own;  // a cancelled send's rest: its bytes from own_from on
  std::size_t own_from = 0;
};

// A single-producer single-consumer byte ring in memory two processes
// share: the producer advances `head` after writing, the consumer `tail`
// after reading (both count bytes since the start).
struct RingControl {
  alignas(64) std::atomic<std::uint64_t> head{0};
  alignas(64) std::atomic<std::uint64_t> tail{0};
};
static_assert(sizeof(RingControl) == 128);

struct Ring {
  void* base = nullptr;
  std::size_t mapped = 0, capacity = 0;
  RingControl* control() const { return static_cast<RingControl*>(base); }
  char* data() const { return static_cast<char*>(base) + sizeof(RingControl); }
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() { reset(); }
  void reset() {
    if (base) ::munmap(base, mapped);
    base = nullptr;
    mapped = capacity = 0;
  }
};

// A message's bytes kept until its receive is posted (not zero-filled).
struct Bytes {
  std::unique_ptr<char[]> data;
  std::size_t size = 0, capacity = 0;
};

struct Mesh::Peer {
  int rank = 0;
  int fd = -1;  // the connection (on one machine with rings, only to see the peer go)
  bool rings = false;
  Ring out, in;
  // A send waits for room in `out` (the poller's look).
  bool waits_for_room = false;
  std::string broken;                     // why the connection ended; empty while it works
  std::deque<std::shared_ptr<Op>> sends;  // the first is being written
  std::map<std::uint64_t, std::deque<std::shared_ptr<Op>>> posted;
  std::map<std::uint64_t, std::deque<Bytes>> unexpected;
  // The message being read: its header, then its bytes into in_op's
  // buffer (a posted receive) or in_buf (none posted yet).
  unsigned char header[kHeader] = {};
  std::size_t header_got = 0;
  std::uint64_t in_slot = 0;
  std::size_t in_bytes = 0, in_got = 0;
  std::shared_ptr<Op> in_op;
  Bytes in_buf;
  bool discard = false;  // the message being read had its receive cancelled
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
  store.wait(
      keys, std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now())));
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
      throw CommTimeout(
          str("timed out after ", seconds(timeout), " waiting for rank(s) ", rank_list(missing), " to connect"));
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
  auto mesh = std::shared_ptr<Mesh>(new Mesh(rank, std::move(raw)));
  mesh->share_memory(ring_capacity(size), until);
  return mesh;
}

std::size_t Mesh::ring_capacity(int size) {
  if (size < 2) return 0;
  const char* off = std::getenv("DISTOPT_GLOO_SHM");
  if (off && std::string_view(off) == "0") return 0;
  const std::size_t pairs = static_cast<std::size_t>(size) * static_cast<std::size_t>(size - 1);
  const std::size_t c = std::min(kRingMax, kRingBudget / pairs) / 4096 * 4096;
  return c >= kRingMin ? c : 0;
}

namespace {

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  in >> id;
  return id;
}

// Maps `name`'s ring of `capacity` bytes, creating it where `create`.
bool map_ring(Ring& r, const std::string& name, std::size_t capacity, bool create) {
  const std::size_t bytes = sizeof(RingControl) + capacity;
  const int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600)
                        : ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return false;
  bool ok = true;
  if (create) {
    // Reserved now: a full /dev/shm fails here, not with SIGBUS later.
    ok = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 && ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0;
  } else {
    struct stat st {};
    ok = ::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) == bytes;
  }
  // (Populated: a first touch of each page in the middle of a message
  // took microseconds each.)
  void* base = ok ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (base == MAP_FAILED) {
    if (create) ::shm_unlink(name.c_str());  // (only one this call made)
    return false;
  }
  r.base = base;
  r.mapped = bytes;
  r.capacity = capacity;
  if (create) new (base) RingControl();
  return true;
}

}  // namespace

void Mesh::share_memory(std::size_t capacity, Clock::time_point until) {
  const std::string boot = capacity > 0 ? boot_id() : std::string();
  if (boot.empty()) capacity = 0;
  static std::atomic<std::uint64_t> count{0};
  static const std::string nonce = [] {
    std::random_device rd;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%08x%08x", rd(), rd());
    return std::string(hex);
  }();
  std::vector<std::string> mine;
  struct Unlink {
    std::vector<std::string>& names;
    ~Unlink() {
      for (const auto& n : names) ::shm_unlink(n.c_str());
    }
  } unlink{mine};
  // Each side offers a ring it writes to ("none" where it has none)...
  for (auto& p : peers_) {
    if (!p) continue;
    std::string offer = "none";
    if (capacity > 0) {
      // (The nonce: processes of other PID namespaces may share /dev/shm.)
      const std::string name = str("/distopt.", ::getpid(), ".", nonce, ".", count.fetch_add(1));
      if (map_ring(p->out, name, capacity, true)) {
        mine.push_back(name);
        offer = str(boot, " ", name, " ", capacity);
      }
    }
    unsigned char length[4];
    put_u32(length, static_cast<std::uint32_t>(offer.size()));
    const std::string who = str("offering memory to rank ", p->rank);
    if (!send_until(p->fd, length, 4, until, who) || !send_until(p->fd, offer.data(), offer.size(), until, who))
      throw CommTimeout(str("timed out ", who));
  }
  // ... maps the other's where it is on this machine, and says so.
  for (auto& p : peers_) {
    if (!p) continue;
    const std::string who = str("the memory offer of rank ", p->rank);
    unsigned char length[4];
    if (!recv_until(p->fd, length, 4, until, who)) throw CommTimeout(str("timed out waiting for ", who));
    const std::uint32_t n = get_u32(length);
    if (n > 4096) throw CommError(str(who, " is malformed (", n, " bytes)"));
    std::string offer(n, '\0');
    if (!recv_until(p->fd, offer.data(), n, until, who)) throw CommTimeout(str("timed out waiting for ", who));
    std::istringstream in(offer);
    std::string their_boot, name;
    std::size_t their_capacity = 0;
    in >> their_boot >> name >> their_capacity;
    const bool mapped = capacity > 0 && in && their_boot == boot && name.rfind("/distopt.", 0) == 0 &&
                        their_capacity >= kRingMin && their_capacity <= kRingMax &&
                        map_ring(p->in, name, their_capacity, false);
    const unsigned char answer = mapped ? 1 : 0;
    if (!send_until(p->fd, &answer, 1, until, who)) throw CommTimeout(str("timed out answering ", who));
  }
  // A pair uses rings where both sides mapped the other's.
  for (auto& p : peers_) {
    if (!p) continue;
    unsigned char answer = 0;
    const std::string who = str("rank ", p->rank, "'s answer to the memory offer");
    if (!recv_until(p->fd, &answer, 1, until, who)) throw CommTimeout(str("timed out waiting for ", who));
    p->rings = answer == 1 && p->in.base != nullptr && p->out.base != nullptr;
    if (!p->rings) {
      p->in.reset();
      p->out.reset();
    }
  }
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
  Peer& p = peer_at(peer);
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
  Peer& p = peer_at(peer);
  auto it = p.unexpected.find(slot);
  if (it != p.unexpected.end()) {
    Bytes m = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) p.unexpected.erase(it);
    if (m.size != bytes)
      op->error = str("a message of ", m.size, " bytes from rank ", peer, " where ", bytes, " were expected");
    else if (bytes > 0) std::memcpy(op->data, m.data.get(), bytes);
    op->complete = op->error.empty();
    recycle(std::move(m));
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

Mesh::Peer& Mesh::peer_at(int rank) {
  if (rank < 0 || rank >= size() || rank == rank_)
    throw PreconditionError(str("mesh: no connection from rank ", rank_, " to rank ", rank));
  return *peers_[static_cast<std::size_t>(rank)];
}

void Mesh::cancel(Op& op) {
  std::lock_guard lock(m_);
  if (op.complete || !op.error.empty() || closed_) return;
  Peer& p = *peers_[static_cast<std::size_t>(op.peer)];
  if (op.is_send) {
    // Not begun: dropped. Begun: the rest is copied, so that the message
    // still ends whole (the receiver expects its bytes).
    auto it = std::find_if(p.sends.begin(), p.sends.end(), [&](const auto& o) { return o.get() == &op; });
    if (it == p.sends.end()) return;
    if (op.done == 0) {
      p.sends.erase(it);
    } else {
      const std::size_t body = op.done > kHeader ? op.done - kHeader : 0;
      op.own = std::make_unique_for_overwrite<char[]>(op.bytes - body + 1);
      std::memcpy(op.own.get(), op.data + body, op.bytes - body);
      op.own_from = body;
    }
    op.error = "cancelled";
    return;
  }
  if (p.in_op.get() == &op) {  // being read: the rest of it is dropped
    p.in_op.reset();
    p.discard = true;
    p.in_buf = buffer(std::size_t{64} << 10);
  } else if (auto it = p.posted.find(op.slot); it != p.posted.end()) {
    std::erase_if(it->second, [&](const auto& o) { return o.get() == &op; });
    if (it->second.empty()) p.posted.erase(it);
  }
  op.error = "cancelled";
}

void Mesh::post(Peer&, const std::shared_ptr<Op>& op) {
  if (pending_.size() >= 64)
    std::erase_if(pending_, [](const std::weak_ptr<Op>& w) {
      auto o = w.lock();
      return !o || o->complete || !o->error.empty();
    });
  pending_.push_back(op);
}

namespace {

void copy_into(const Ring& r, std::uint64_t at, const char* from, std::size_t n) {
  const std::size_t off = static_cast<std::size_t>(at % r.capacity), first = std::min(n, r.capacity - off);
  std::memcpy(r.data() + off, from, first);
  if (n > first) std::memcpy(r.data(), from + first, n - first);
}

void copy_out(const Ring& r, std::uint64_t at, char* to, std::size_t n) {
  const std::size_t off = static_cast<std::size_t>(at % r.capacity), first = std::min(n, r.capacity - off);
  std::memcpy(to, r.data() + off, first);
  if (n > first) std::memcpy(to + first, r.data(), n - first);
}

}  // namespace

long Mesh::put(Peer& p, const iovec* iov, int n) {
  if (p.rings) {
    RingControl* c = p.out.control();
    const std::uint64_t head = c->head.load(std::memory_order_relaxed);
    const std::uint64_t used = head - c->tail.load(std::memory_order_acquire);
    if (used > p.out.capacity) {  // (the peer's process wrote over the ring's count)
      broke(p, "its ring's read count is corrupt");
      return -1;
    }
    std::size_t space = p.out.capacity - static_cast<std::size_t>(used);
    std::size_t moved = 0;
    for (int i = 0; i < n && space > 0; ++i) {
      const std::size_t k = std::min(space, iov[i].iov_len);
      copy_into(p.out, head + moved, static_cast<const char*>(iov[i].iov_base), k);
      moved += k;
      space -= k;
    }
    if (moved > 0) c->head.store(head + moved, std::memory_order_release);
    return static_cast<long>(moved);
  }
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<std::size_t>(n);
  for (;;) {
    const ssize_t k = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k >= 0) return k;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    broke(p, errno_text(errno));
    return -1;
  }
}

long Mesh::take(Peer& p, char* into, std::size_t n) {
  if (p.rings) {
    RingControl* c = p.in.control();
    const std::uint64_t tail = c->tail.load(std::memory_order_relaxed);
    const std::uint64_t ready = c->head.load(std::memory_order_acquire) - tail;
    if (ready > p.in.capacity) {
      broke(p, "its ring's write count is corrupt");
      return -1;
    }
    const std::size_t k = std::min(n, static_cast<std::size_t>(ready));
    if (k > 0) {
      copy_out(p.in, tail, into, k);
      c->tail.store(tail + k, std::memory_order_release);
    }
    return static_cast<long>(k);
  }
  for (;;) {
    const ssize_t k = ::recv(p.fd, into, n, MSG_DONTWAIT);
    if (k > 0) return k;
    if (k == 0) {
      broke(p, "the connection closed");
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    broke(p, errno_text(errno));
    return -1;
  }
}

void Mesh::write_some(Peer& p) {
  while (!p.sends.empty() && p.broken.empty()) {
    Op& op = *p.sends.front();
    iovec iov[2];
    int n = 0;
    if (op.done < kHeader) iov[n++] = {op.header + op.done, kHeader - op.done};
    const std::size_t body_done = op.done > kHeader ? op.done - kHeader : 0;
    if (op.bytes > body_done) {
      char* from = op.own ? op.own.get() + (body_done - op.own_from) : op.data + body_done;
      iov[n++] = {from, op.bytes - body_done};
    }
    const long k = put(p, iov, n);
    if (k <= 0) return;
    op.done += static_cast<std::size_t>(k);
    if (op.done < kHeader + op.bytes) continue;
    op.complete = true;
    ++done_;
    p.sends.pop_front();
  }
}

void Mesh::read_some(Peer& p) {
  while (p.broken.empty()) {
    if (p.header_got < kHeader) {
      const long k = take(p, reinterpret_cast<char*>(p.header) + p.header_got, kHeader - p.header_got);
      if (k <= 0) return;
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
        // A size read is trusted up to kTrusted bytes; past them the
        // buffer grows as the bytes come.
        p.in_buf = buffer(std::min(p.in_bytes, kTrusted));
      }
    }
    if (p.in_got < p.in_bytes) {
      std::size_t room = p.in_bytes - p.in_got;
      char* into = nullptr;
      if (p.in_op) {
        into = p.in_op->data + p.in_got;
      } else if (p.discard) {  // (read and dropped, a buffer at a time)
        room = std::min(room, p.in_buf.capacity);
        into = p.in_buf.data.get();
      } else {
        if (p.in_buf.capacity == p.in_got) {
          Bytes more = buffer(std::min(p.in_bytes, 2 * p.in_got));
          if (p.in_got > 0) std::memcpy(more.data.get(), p.in_buf.data.get(), p.in_got);
          recycle(std::exchange(p.in_buf, std::move(more)));
        }
        room = std::min(room, p.in_buf.capacity - p.in_got);
        into = p.in_buf.data.get() + p.in_got;
      }
      const long k = take(p, into, room);
      if (k <= 0) return;
      p.in_got += static_cast<std::size_t>(k);
      if (p.in_got < p.in_bytes) continue;
    }
    // A whole message.
    p.header_got = 0;
    if (p.discard) {
      p.discard = false;
      recycle(std::exchange(p.in_buf, Bytes()));
      continue;
    }
    if (p.in_op) {
      p.in_op->complete = true;
      ++done_;
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
        op->error =
            str("a message of ", p.in_bytes, " bytes from rank ", p.rank, " where ", op->bytes, " were expected");
        return broke(p, "it sent a message of an unexpected size");
      }
      if (op->bytes > 0) std::memcpy(op->data, p.in_buf.data.get(), op->bytes);
      op->complete = true;
      ++done_;
      recycle(std::exchange(p.in_buf, Bytes()));
      continue;
    }
    p.in_buf.size = p.in_bytes;
    p.unexpected[p.in_slot].push_back(std::exchange(p.in_buf, Bytes()));
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
  p.in_buf = Bytes();
}

Bytes Mesh::buffer(std::size_t n) {
  // The smallest spare that holds n: reused memory is not faulted in again.
  auto best = spare_.end();
  for (auto it = spare_.begin(); it != spare_.end(); ++it)
    if (it->capacity >= n && (best == spare_.end() || it->capacity < best->capacity)) best = it;
  if (best != spare_.end()) {
    Bytes b = std::move(*best);
    spare_.erase(best);
    b.size = 0;
    return b;
  }
  Bytes b;
  if (n > 0) b.data = std::make_unique_for_overwrite<char[]>(n);
  b.capacity = n;
  return b;
}

void Mesh::recycle(Bytes b) {
  if (b.capacity == 0) return;
  if (spare_.size() >= kSpares) spare_.erase(spare_.begin());
  spare_.push_back(std::move(b));
}

void Mesh::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t k = ::write(wake_fd_, &one, sizeof one);
}

void Mesh::progress_rings() {
  for (auto& p : peers_) {
    if (!p || !p->rings || !p->broken.empty()) continue;
    write_some(*p);
    read_some(*p);
  }
}

// (Read without the lock: the peers were taken under it, and only the
// other process moves these counts meanwhile.)
bool Mesh::rings_ready(const std::vector<Peer*>& ring_peers) {
  for (const Peer* p : ring_peers) {
    const RingControl* in = p->in.control();
    if (in->head.load(std::memory_order_acquire) != in->tail.load(std::memory_order_relaxed)) return true;
    // Any room: the send's last write filled the ring. (Not "the tail
    // moved since we looked": the peer may have emptied it before.)
    if (p->waits_for_room) {
      const RingControl* out = p->out.control();
      if (out->head.load(std::memory_order_acquire) - out->tail.load(std::memory_order_acquire) < p->out.capacity)
        return true;
    }
  }
  return false;
}

bool Mesh::wait(Op& op, Clock::time_point until) {
  std::unique_lock lock(m_);
  std::vector<pollfd> fds;
  std::vector<Peer*> of, ring_peers;
  for (;;) {
    const std::uint64_t done_before = done_;
    if (!closed_) progress_rings();
    if (done_ != done_before) {
      // Another thread's operation may be done: its waiter learns it (on
      // the condition, or, polling, from the wake-up).
      cv_.notify_all();
      if (polling_) wake();
    }
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
    ring_peers.clear();
    bool sockets = false;
    for (auto& p : peers_) {
      if (!p) continue;
      p->waits_for_room = false;
      if (!p->broken.empty()) continue;
      if (p->rings) {
        p->waits_for_room = !p->sends.empty();
        ring_peers.push_back(p.get());
      } else {
        sockets = true;
      }
      // (A ring's peer sends nothing on its socket: it is polled to see it go.)
      const bool out = !p->rings && !p->sends.empty();
      fds.push_back({p->fd, static_cast<short>(POLLIN | (out ? POLLOUT : 0)), 0});
      of.push_back(p.get());
    }
    polling_ = true;
    lock.unlock();
    // A few looks without sleeping, giving the processor to others between
    // them (a peer on this core may be the one to answer), then a poll
    // that sleeps; with rings, many looks at them and then 1 ms sleeps.
    int ready = 0;
    if (ring_peers.empty()) {
      for (int spin = 0; spin < kSpins && ready == 0; ++spin) {
        ready = ::poll(fds.data(), fds.size(), 0);
        if (ready == 0) ::sched_yield();
      }
      if (ready == 0) ready = ::poll(fds.data(), fds.size(), ms_until(until, 1000));
    } else {
      for (int spin = 1;; ++spin) {
        if (rings_ready(ring_peers)) {
          // (Sockets too, where some peers are on TCP: a stream on the
          // rings does not starve them.)
          if (sockets) ready = ::poll(fds.data(), fds.size(), 0);
          break;
        }
        if (spin % kSocketLook == 0 || spin > kRingSpins) {
          ready = ::poll(fds.data(), fds.size(), spin > kRingSpins ? 1 : 0);
          if (ready != 0 || Clock::now() >= until) break;
        }
        if (spin <= kRingSpins) ::sched_yield();
      }
    }
    lock.lock();
    polling_ = false;
    struct Notify {  // (also when reading throws)
      std::condition_variable& cv;
      ~Notify() { cv.notify_all(); }
    } notify{cv_};
    if (ready > 0 && !closed_) {
      if (fds[0].revents) {
        std::uint64_t count;
        [[maybe_unused]] const ssize_t k = ::read(wake_fd_, &count, sizeof count);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        Peer& p = *of[i];
        if (p.rings) {
          // Nothing comes on a ring peer's socket but its end: what it
          // wrote to the ring before is read first.
          if (p.broken.empty()) {
            char byte;
            const ssize_t k = ::recv(p.fd, &byte, 1, MSG_DONTWAIT);
            const bool end = k >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
            if (end) {
              const int e = errno;
              read_some(p);
              if (k == 0) broke(p, "the connection closed");
              else if (k > 0) broke(p, "it sent on the socket of a shared-memory pair");
              else broke(p, errno_text(e));
            }
          }
          continue;
        }
        if (fds[i].revents & POLLOUT) write_some(p);
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_some(p);
      }
    }
  }
}

bool Mesh::uses_rings(int peer) const {
  return peers_.at(static_cast<std::size_t>(peer))->rings;
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
