// The gloo backend: see include/distopt/comm/gloo.hpp and
// docs/reliability.md ("Processes").
//
// Data: every message is a gloo unbound buffer sent to one peer on a slot;
// collectives use a slot of their own each (a per-communicator sequence, the
// same on every rank since ranks issue collectives in the same order),
// point-to-point messages the slot of their tag. Sums are reduce_ordered's.
//
// Membership: every process beats (a counter in its heartbeat file, 10 times
// a second). To re-form after a loss or to admit waiting processes, each
// member announces itself for the next epoch and waits until every member
// of the current one has announced itself or fallen silent (its heartbeat
// unchanged for kSilent), at most the time-out. The new member list is
// created exclusively, so that there is one decision, which every member
// reads: the first member's, admitting new ranks, where every member came;
// otherwise that of the first to finish waiting, without the silent ones
// and admitting none (GlooComm::reform). A member that re-forms because it
// lost a peer marks the group as left ("leaving/<epoch>"), which aborts
// the other members' waits on it (Shared::watch_for_leavers, with each
// heartbeat).
#include "distopt/comm/gloo.hpp"

#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "distopt/core/buffer.hpp"
#include "distopt/core/copy.hpp"

namespace distopt {

namespace {

using Clock = Communicator::Clock;
using std::chrono::milliseconds;

constexpr milliseconds kBeat{100};     // heartbeat period
constexpr milliseconds kSilent{1000};  // a heartbeat unchanged this long: the process is gone or stopped

std::string seconds(milliseconds t) { return str(static_cast<double>(t.count()) / 1000.0, " s"); }

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// A key-value store in a directory: one file per key, written under a
// temporary name and renamed, so that a reader sees a whole value or none.
class DirStore final : public gloo::rendezvous::Store {
 public:
  DirStore(std::string dir, milliseconds timeout) : dir_(std::move(dir)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const std::string tmp = temp_name();
    write_file(tmp, data);
    if (std::rename(tmp.c_str(), path(key).c_str()) != 0) {
      const int err = errno;
      std::remove(tmp.c_str());
      throw CommError(str("rendezvous: cannot write ", path(key), ": ", std::strerror(err)));
    }
  }
  // Creates the key unless it exists; true when this call created it.
  bool create_once(const std::string& key, const std::vector<char>& data) {
    const std::string tmp = temp_name();
    write_file(tmp, data);
    const int rc = ::link(tmp.c_str(), path(key).c_str());
    const int err = errno;
    std::remove(tmp.c_str());
    if (rc == 0) return true;
    if (err == EEXIST) return false;
    throw CommError(str("rendezvous: cannot create ", path(key), ": ", std::strerror(err)));
  }
  bool has(const std::string& key) const { return ::access(path(key).c_str(), F_OK) == 0; }
  std::vector<char> read(const std::string& key) const {
    std::ifstream in(path(key), std::ios::binary);
    if (!in) throw CommError(str("rendezvous: cannot read ", path(key)));
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    return read(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    const auto start = Clock::now();
    for (;;) {
      std::vector<std::string> missing;
      for (const std::string& k : keys)
        if (!has(k)) missing.push_back(k);
      if (missing.empty()) return;
      if (Clock::now() - start > timeout) throw CommTimeout(describe_missing(missing, timeout));
      std::this_thread::sleep_for(Clock::now() - start < milliseconds(100) ? milliseconds(1) : milliseconds(5));
    }
  }
  std::string path(const std::string& key) const {
    std::string name = key;
    std::replace(name.begin(), name.end(), '/', '.');
    return dir_ + "/" + name;
  }
  const std::string& dir() const { return dir_; }

 private:
  // Unique among the machines (host), their processes (pid) and the
  // stores of this one (a process-wide count).
  static std::string temp_name(const std::string& dir) {
    static std::atomic<std::uint64_t> counter{0};
    static const std::string host = [] {
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      return std::string(name);
    }();
    return str(dir, "/.tmp.", host, ".", ::getpid(), ".", counter.fetch_add(1, std::memory_order_relaxed));
  }
  std::string temp_name() const { return temp_name(dir_); }
  static void write_file(const std::string& name, const std::vector<char>& data) {
    std::ofstream out(name, std::ios::binary | std::ios::trunc);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    out.close();
    if (!out) throw CommError(str("rendezvous: cannot write ", name));
  }
  // gloo waits for "e<epoch>/<rank>": the address of that rank.
  std::string describe_missing(const std::vector<std::string>& keys, milliseconds timeout) const {
    std::vector<int> ranks;
    for (const std::string& k : keys) {
      const auto slash = k.rfind('/');
      if (slash == std::string::npos) return str("rendezvous: timed out after ", seconds(timeout), " waiting for ", k,
                                                 " in ", dir_);
      ranks.push_back(std::atoi(k.c_str() + slash + 1));
    }
    return str("rendezvous: timed out after ", seconds(timeout), " waiting for rank(s) ", rank_list(ranks), " to join in ",
               dir_, " (gloo backend)");
  }
  std::string dir_;
  milliseconds timeout_;
};

std::vector<char> bytes_of(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

// A small value of the store, or "" where there is none (yet).
std::string read_or_empty(const DirStore& store, const std::string& key) {
  try {
    if (!store.has(key)) return {};
    const std::vector<char> b = store.read(key);
    return std::string(b.begin(), b.end());
  } catch (const CommError&) {
    return {};  // renamed over meanwhile
  }
}

// A wait ended by LiveBuffers::abort_all, with the first reason given.
class WaitAborted : public std::runtime_error {
 public:
  WaitAborted(const std::string& why, bool group_left)
      : std::runtime_error(str("aborted: ", why)), group_left_(group_left) {}
  // A member left the group to re-form it (Shared::watch_for_leavers).
  bool group_left() const { return group_left_; }

 private:
  bool group_left_;
};

// The unbound buffers of a communicator with an operation pending: a
// failure found by one thread aborts another's wait on the same
// communicator (closing the pairs does not wake it), and a member that
// left the group aborts them all (Shared::abort_upto).
class LiveBuffers {
 public:
  void add(gloo::transport::UnboundBuffer* b) {
    std::lock_guard lock(m_);
    live_.push_back(b);
  }
  void remove(gloo::transport::UnboundBuffer* b) {
    std::lock_guard lock(m_);
    live_.erase(std::remove(live_.begin(), live_.end(), b), live_.end());
  }
  void abort_all(const std::string& why, bool group_left = false) {
    std::lock_guard lock(m_);
    if (why_.empty()) {  // the first reason: the communicator is done
      why_ = why;
      group_left_ = group_left;
    }
    for (auto* b : live_) {
      b->abortWaitRecv();
      b->abortWaitSend();
    }
  }
  // A wait that returned false: aborted, for this reason.
  [[noreturn]] void aborted() {
    std::lock_guard lock(m_);
    throw WaitAborted(why_.empty() ? std::string("an abort") : why_, group_left_);
  }

 private:
  std::mutex m_;
  std::vector<gloo::transport::UnboundBuffer*> live_;
  std::string why_;
  bool group_left_ = false;
};

// What every communicator of a process's world shares.
struct Shared {
  Shared(std::string dir, milliseconds timeout, Elastic e, int first)
      : store(std::move(dir), timeout), elastic(e), first(first) {}
  DirStore store;
  std::shared_ptr<gloo::transport::Device> device;
  Elastic elastic;
  int first;  // this process's rank as first numbered
  std::mutex m;
  int epoch = 0;             // of the current membership
  std::vector<int> members;  // first-numbered ranks of the current members, in order
  std::uint64_t splits = 0;  // communicators made by split, for their rendezvous names
  int next_join = 0;         // the first join request not yet answered ("join/<k>")
  int next_id = 0;           // the first rank number (as first numbered) not yet given
  // Rank 0 marks "joins-seen" while requests wait (a join waits as long as
  // the run sees it: diloco admits only at the end of an outer cycle).
  std::uint64_t joins_seen = 0;
  Clock::time_point joins_seen_at{};

  // The operations waiting on this process's communicators, with the
  // epoch each communicator belongs to (GlooComm registers its own).
  std::mutex lives_m;
  std::vector<std::pair<int, LiveBuffers*>> lives;

  // Aborts the waits on this process's communicators of epochs up to
  // `epoch`: their group is being left.
  void abort_upto(int epoch, const std::string& why, bool group_left = false) {
    std::lock_guard lock(lives_m);
    for (auto [e, live] : lives)
      if (e <= epoch) live->abort_all(why, group_left);
  }

  // A member that re-forms because it lost a peer has closed its
  // connections and marked the group as left ("leaving/<next epoch>",
  // created once): this process's waits on the group can no longer all
  // end, and one on a message whose connection broke in mid-transfer would
  // not end before the time-out (gloo wakes the waits queued on a broken
  // pair, not the one it is reading into). They are aborted, so that this
  // process re-forms too. Run with each heartbeat (one look at the
  // rendezvous); skipped while this process re-forms.
  void watch_for_leavers() {
    if (elastic != Elastic::on) return;
    int now = 0;
    {
      std::unique_lock lock(m, std::try_to_lock);
      if (!lock.owns_lock()) return;
      now = epoch;
    }
    const std::string leaver = read_or_empty(store, str("leaving/", now + 1));
    if (!leaver.empty()) abort_upto(now, str("first rank ", leaver, " left the group to re-form it (it lost a peer)"), true);
  }

  // The heartbeat.
  std::mutex beat_m;
  std::condition_variable beat_cv;
  bool stop_beating = false;
  std::thread beater;
  void start_beating() {
    beater = std::thread([this] {
      std::uint64_t beat = 0;
      std::unique_lock lock(beat_m);
      while (!stop_beating) {
        lock.unlock();
        try {
          store.set(str("hb/", first), bytes_of(std::to_string(++beat)));
        } catch (const std::exception&) {
          // A full disk or a vanished directory: the others will see this
          // process as silent, which is what it then is to them.
        }
        try {
          watch_for_leavers();
        } catch (const std::exception&) {
          // (the rendezvous unreadable: its own waits end at the time-out)
        }
        lock.lock();
        beat_cv.wait_for(lock, kBeat, [&] { return stop_beating; });
      }
    });
  }
  ~Shared() {
    {
      std::lock_guard lock(beat_m);
      stop_beating = true;
    }
    beat_cv.notify_all();
    if (beater.joinable()) beater.join();
  }
};

std::shared_ptr<gloo::rendezvous::Context> connect(Shared& sh, const std::string& prefix, int rank, int size,
                                                   milliseconds timeout) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  gloo::rendezvous::PrefixStore store(prefix, sh.store);
  ctx->connectFullMesh(store, sh.device);
  return ctx;
}

class GlooComm;

// One message of an exchange.
struct Part {
  int peer;
  char* data;
  std::size_t bytes;
};

// Registers buffers for the scope of an operation.
class Registered {
 public:
  explicit Registered(LiveBuffers& live) : live_(live) {}
  ~Registered() {
    for (auto* b : mine_) live_.remove(b);
  }
  Registered(const Registered&) = delete;
  Registered& operator=(const Registered&) = delete;
  void add(gloo::transport::UnboundBuffer* b) {
    live_.add(b);
    mine_.push_back(b);
  }

 private:
  LiveBuffers& live_;
  std::vector<gloo::transport::UnboundBuffer*> mine_;
};

class GlooRequest final : public Request {
 public:
  GlooRequest(GlooComm& comm, LiveBuffers& live, std::unique_ptr<gloo::transport::UnboundBuffer> buf, bool send,
              int peer, int tag)
      : comm_(comm), buf_(std::move(buf)), registered_(live), send_(send), peer_(peer), tag_(tag) {
    registered_.add(buf_.get());
  }
  // gloo has no test that leaves the context usable when it is not done
  // (a wait that expires fails every pair): test waits.
  bool test() override {
    wait();
    return true;
  }
  void wait() override;

 private:
  GlooComm& comm_;
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  Registered registered_;  // after buf_: unregistered before it is freed
  bool send_;
  int peer_, tag_;
  bool done_ = false;
};

class GlooComm final : public Communicator {
 public:
  // Made in the epoch current when it is made (a re-forming's after it
  // moved to the next).
  GlooComm(std::shared_ptr<Shared> shared, std::shared_ptr<gloo::Context> ctx, bool top, int epoch)
      : shared_(std::move(shared)), ctx_(std::move(ctx)), top_(top), epoch_(epoch) {
    std::lock_guard lock(shared_->lives_m);
    shared_->lives.emplace_back(epoch, &live_);
  }
  ~GlooComm() override {
    stop_progress();
    std::lock_guard lock(shared_->lives_m);
    std::erase_if(shared_->lives, [&](const auto& l) { return l.second == &live_; });
  }

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }
  std::string_view backend() const override { return "gloo"; }

  // A failed wait: names the peer; RankLost in an elastic world's top
  // communicator. Closes every pair first, so that nothing more is written
  // into buffers the caller may free, and peers waiting on this rank learn
  // at once.
  [[noreturn]] void fail(const std::string& op, int peer, const std::exception& e, Clock::time_point until) {
    try {
      ctx_->closeConnections();
    } catch (const std::exception&) {
    }
    // In an elastic world every communicator of this epoch is done: the
    // group re-forms.
    if (shared_->elastic == Elastic::on)
      shared_->abort_upto(epoch_, "another operation of this process lost a peer");
    else
      live_.abort_all("another operation of this communicator lost a peer");
    const bool timed_out = Clock::now() >= until - milliseconds(5) ||
                           std::string_view(e.what()).find("Timed out") != std::string_view::npos;
    const std::string who = peer >= 0 ? str("rank ", peer) : std::string("the other ranks");
    const auto* aborted = dynamic_cast<const WaitAborted*>(&e);
    const bool left = aborted != nullptr && aborted->group_left();
    const std::string msg = timed_out ? str(op, " on rank ", rank(), ": timed out after ", seconds(timeout()),
                                            " waiting for ", who, " (gloo backend)")
                            : left    ? str(op, " on rank ", rank(), ": ", e.what(), " (gloo backend)")
                                      : str(op, " on rank ", rank(), ": lost ", who, " (gloo: ", e.what(), ")");
    if (shared_->elastic == Elastic::on) throw RankLost(msg);  // (only the top communicator shrinks)
    if (timed_out) throw CommTimeout(msg);
    throw CommError(msg);
  }

 protected:
  std::unique_ptr<Request> do_isend(const void* buf, std::size_t bytes, int peer, int tag) override {
    auto ub = ctx_->createUnboundBuffer(const_cast<void*>(buf), bytes);
    ub->send(peer, p2p_slot(tag), 0, bytes);
    count_sent(bytes);
    return std::make_unique<GlooRequest>(*this, live_, std::move(ub), true, peer, tag);
  }
  std::unique_ptr<Request> do_irecv(void* buf, std::size_t bytes, int peer, int tag) override {
    auto ub = ctx_->createUnboundBuffer(buf, bytes);
    ub->recv(peer, p2p_slot(tag), 0, bytes);
    return std::make_unique<GlooRequest>(*this, live_, std::move(ub), false, peer, tag);
  }

  // Each rank receives its piece from every other rank, then sums all n
  // in rank order.
  void do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type,
                           ReduceOp op) override {
    const int n = size(), me = rank();
    const std::size_t es = size_of(type);
    const auto offsets = offsets_of(counts);
    const std::size_t mine = counts[me] * es;
    if (scratch_.size_bytes() < mine * n) scratch_ = Buffer(mine * n, 5);
    std::vector<Part> sends, recvs;
    for (int j = 1; j < n; ++j) {
      const int to = (me + j) % n, from = (me + n - j) % n;
      sends.push_back({to, const_cast<char*>(static_cast<const char*>(send)) + offsets[to] * es, counts[to] * es});
      recvs.push_back({from, scratch_.as<char>() + from * mine, mine});
    }
    exchange("reduce_scatter", sends, recvs);
    std::vector<const void*> inputs(n);
    for (int r = 0; r < n; ++r)
      inputs[r] = r == me ? static_cast<const char*>(send) + offsets[me] * es : scratch_.as<char>() + r * mine;
    reduce_ordered(inputs.data(), n, recv, counts[me], type, op);
  }

  void do_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type) override {
    const int n = size(), me = rank();
    const std::size_t es = size_of(type);
    const auto offsets = offsets_of(counts);
    std::vector<Part> sends, recvs;
    for (int j = 1; j < n; ++j) {
      const int to = (me + j) % n, from = (me + n - j) % n;
      sends.push_back({to, const_cast<char*>(static_cast<const char*>(send)), counts[me] * es});
      recvs.push_back({from, static_cast<char*>(recv) + offsets[from] * es, counts[from] * es});
    }
    exchange("all_gather", sends, recvs);
    char* own = static_cast<char*>(recv) + offsets[me] * es;
    if (own != send) copy_bytes(own, send, counts[me] * es);
  }

  void do_broadcast(void* buf, std::size_t bytes, int root) override {
    std::vector<Part> sends, recvs;
    if (rank() == root) {
      for (int r = 0; r < size(); ++r)
        if (r != root) sends.push_back({r, static_cast<char*>(buf), bytes});
    } else {
      recvs.push_back({root, static_cast<char*>(buf), bytes});
    }
    exchange("broadcast", sends, recvs);
  }

  void do_barrier() override {
    const int n = size(), me = rank();
    std::vector<char> out(1, 1), in(static_cast<std::size_t>(n), 0);
    std::vector<Part> sends, recvs;
    for (int j = 1; j < n; ++j) {
      sends.push_back({(me + j) % n, out.data(), 1});
      recvs.push_back({(me + n - j) % n, in.data() + (me + n - j) % n, 1});
    }
    exchange("barrier", sends, recvs);
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override {
    const int n = size();
    const std::int64_t mine[3] = {color, key, rank()};
    std::vector<std::int64_t> all(3 * static_cast<std::size_t>(n));
    all_gather(mine, all.data(), 3, ElemType::i64);
    std::uint64_t seq = 0;
    int epoch = 0;
    {
      std::lock_guard lock(shared_->m);
      seq = ++shared_->splits;
      epoch = shared_->epoch;
    }
    if (color < 0) return nullptr;
    std::vector<std::pair<std::int64_t, std::int64_t>> group;  // (key, rank)
    for (int r = 0; r < n; ++r)
      if (all[3 * r] == color) group.emplace_back(all[3 * r + 1], all[3 * r + 2]);
    std::sort(group.begin(), group.end());
    int new_rank = 0;
    for (std::size_t i = 0; i < group.size(); ++i)
      if (group[i].second == rank()) new_rank = static_cast<int>(i);
    // The count restarts with each membership epoch (a joiner's is 0).
    const std::string prefix = str("split/", epoch, ".", seq, ".", color);
    try {
      auto ctx = connect(*shared_, prefix, new_rank, static_cast<int>(group.size()), timeout());
      return std::make_unique<GlooComm>(shared_, std::move(ctx), false, epoch);
    } catch (const std::exception& e) {
      const std::string msg = str("split on rank ", rank(), ": ", e.what(), " (gloo backend)");
      if (shared_->elastic == Elastic::on) throw RankLost(msg);
      throw CommError(msg);
    }
  }

  std::unique_ptr<Communicator> do_shrink() override;
  std::unique_ptr<Communicator> do_grow(int joins) override;
  std::unique_ptr<Communicator> reform(int joins);

 public:
  int pending_joins() override {
    if (!top_ || shared_->elastic != Elastic::on) return 0;
    Shared& sh = *shared_;
    std::lock_guard lock(sh.m);
    int n = 0;
    for (int k = sh.next_join; sh.store.has(str("join/", k)); ++k)
      if (!sh.store.has(str("joined/", k))) ++n;  // not withdrawn
    if (n > 0 && Clock::now() - sh.joins_seen_at > kBeat) {
      try {
        sh.store.set("joins-seen", bytes_of(std::to_string(++sh.joins_seen)));
      } catch (const CommError&) {
        // (a full disk: the joining process will withdraw at its time-out)
      }
      sh.joins_seen_at = Clock::now();
    }
    return n;
  }

 private:
  static constexpr std::uint64_t kP2p = 1ull << 40, kCollective = 1ull << 41;
  static std::uint64_t p2p_slot(int tag) { return kP2p + static_cast<std::uint32_t>(tag); }

  void exchange(const char* op, const std::vector<Part>& sends, const std::vector<Part>& recvs) {
    const std::uint64_t slot = kCollective + seq_++;
    const auto until = deadline();
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> in(recvs.size()), out(sends.size());
    Registered registered(live_);  // after the buffers: unregistered before they are freed
    int peer = -1;
    try {
      for (std::size_t i = 0; i < recvs.size(); ++i) {
        if (recvs[i].bytes == 0) continue;
        peer = recvs[i].peer;
        in[i] = ctx_->createUnboundBuffer(recvs[i].data, recvs[i].bytes);
        registered.add(in[i].get());
        in[i]->recv(recvs[i].peer, slot, 0, recvs[i].bytes);
      }
      for (std::size_t i = 0; i < sends.size(); ++i) {
        if (sends[i].bytes == 0) continue;
        peer = sends[i].peer;
        out[i] = ctx_->createUnboundBuffer(sends[i].data, sends[i].bytes);
        registered.add(out[i].get());
        out[i]->send(sends[i].peer, slot, 0, sends[i].bytes);
        count_sent(sends[i].bytes);
      }
      for (std::size_t i = 0; i < recvs.size(); ++i) {
        if (!in[i]) continue;
        peer = recvs[i].peer;
        if (!in[i]->waitRecv(left(until))) live_.aborted();
      }
      for (std::size_t i = 0; i < sends.size(); ++i) {
        if (!out[i]) continue;
        peer = sends[i].peer;
        if (!out[i]->waitSend(left(until))) live_.aborted();
      }
    } catch (const std::exception& e) {
      fail(op, std::string_view(op) == "barrier" ? -1 : peer, e, until);
    }
  }
  static milliseconds left(Clock::time_point until) {
    return std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(until - Clock::now()));
  }

  friend class GlooRequest;
  LiveBuffers live_;  // first: outlives every operation's registration
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<gloo::Context> ctx_;
  bool top_;
  int epoch_;  // the membership epoch it belongs to
  std::uint64_t seq_ = 0;
  Buffer scratch_;
};

void GlooRequest::wait() {
  if (done_) return;
  const auto until = Clock::now() + comm_.timeout();
  try {
    if (!(send_ ? buf_->waitSend(comm_.timeout()) : buf_->waitRecv(comm_.timeout()))) comm_.live_.aborted();
  } catch (const std::exception& e) {
    comm_.fail(str(send_ ? "send" : "recv", " (tag ", tag_, ")"), peer_, e, until);
  }
  done_ = true;
}

std::vector<char> encode(const std::vector<int>& ranks) { return bytes_of(rank_list(ranks)); }
std::vector<int> decode(const std::vector<char>& text) {
  std::vector<int> out;
  std::stringstream in(std::string(text.begin(), text.end()));
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(std::atoi(item.c_str()));
  return out;
}

// A re-forming's decision ("members/<epoch>", created once): the join
// counters after it, then the members. Its new members (first numbered
// from the counters before it) are the processes it admitted.
struct Decision {
  std::vector<int> members;
  int next_join = 0, next_id = 0;
};
std::vector<char> encode(const Decision& d) {
  std::vector<int> all = {d.next_join, d.next_id};
  all.insert(all.end(), d.members.begin(), d.members.end());
  return encode(all);
}
Decision read_decision(const DirStore& store, int epoch) {
  const std::string key = str("members/", epoch);
  std::vector<int> all = decode(store.read(key));
  if (all.size() < 3 || all[0] < 0 || all[1] < 0)
    throw CommError(str("rendezvous: ", store.path(key), " is malformed"));
  return {std::vector<int>(all.begin() + 2, all.end()), all[0], all[1]};
}

std::unique_ptr<Communicator> GlooComm::do_shrink() { return reform(0); }

std::unique_ptr<Communicator> GlooComm::do_grow(int joins) {
  if (joins < 1) throw CommError(str("grow: ", joins, " new ranks"));
  return reform(joins);
}

// Survivors and admissions decide together: a rank lost in the step where
// processes wait to join makes some ranks shrink and others grow, and both
// come here. Each member announces itself for the next epoch and waits
// until every member has announced itself or fallen silent (its heartbeat
// unchanged for kSilent), at most the time-out. Where every member came,
// the first one decides, admitting up to `joins` waiting processes (its
// own count: 0 where it shrinks); where some did not, the first to finish
// waiting decides the group of those that came, and admits none.
std::unique_ptr<Communicator> GlooComm::reform(int joins) {
  if (!top_) throw CommError("only a world's top communicator re-forms (without its lost ranks, or with new ones)");
  if (shared_->elastic != Elastic::on)
    throw CommError("this gloo world was opened without Elastic::on: it does not re-form");
  // After a loss, the peers still waiting on this rank learn of it at once.
  // Not where this rank grows: gloo closes hard (a reset), which would drop
  // the step's last messages still in this side's socket buffer, and no
  // peer waits on a rank that passed the step (the ranks that shrink
  // meanwhile failed on the lost one).
  // So do this process's other waits on the group (a progress thread's, a
  // split communicator's).
  if (joins == 0) {
    try {
      ctx_->closeConnections();
    } catch (const std::exception&) {
    }
    shared_->abort_upto(epoch_, "this process re-forms the group (it lost a peer)");
  }
  Shared& sh = *shared_;
  std::lock_guard lock(sh.m);
  const int next = sh.epoch + 1;
  const std::vector<int> before = sh.members;
  const std::string decision = str("members/", next);
  // Re-forming after a loss: the other members' waits on the group are
  // aborted (Shared::watch_for_leavers).
  if (joins == 0) sh.store.create_once(str("leaving/", next), bytes_of(std::to_string(sh.first)));
  sh.store.set(str("alive/", next, "/", sh.first), bytes_of("1"));
  const auto start = Clock::now();
  struct Seen {
    std::string beat;
    Clock::time_point since;
  };
  std::map<int, Seen> beats;
  // Whether member m's heartbeat has changed within kSilent.
  const auto beating = [&](int m) {
    std::string beat;
    try {
      const auto b = sh.store.read(str("hb/", m));
      beat.assign(b.begin(), b.end());
    } catch (const CommError&) {
    }
    auto [it, fresh] = beats.try_emplace(m, Seen{beat, Clock::now()});
    if (!fresh && it->second.beat != beat) it->second = Seen{beat, Clock::now()};
    return Clock::now() - it->second.since < kSilent;
  };
  while (!sh.store.has(decision)) {
    std::vector<int> present;
    bool pending = false;
    for (int m : before) {
      if (sh.store.has(str("alive/", next, "/", m))) {
        present.push_back(m);
        continue;
      }
      if (beating(m)) pending = true;
    }
    const bool late = Clock::now() - start > timeout();
    Decision d{present, sh.next_join, sh.next_id};
    if (present.size() == before.size() && sh.first == before.front()) {
      // The answers first, then the decision: a request withdrawn
      // meanwhile keeps its "withdrawn"; one answered for a decision that
      // another member made first asks again (join()).
      for (int taken = 0; taken < joins && sh.store.has(str("join/", d.next_join)); ++d.next_join) {
        if (!sh.store.create_once(str("joined/", d.next_join), bytes_of(str(next, " ", d.next_id)))) continue;
        d.members.push_back(d.next_id++);
        ++taken;
      }
      sh.store.create_once(decision, encode(d));
      break;
    }
    // Every member came: the first decides; another only once it is late,
    // or once the first fell silent after it came (then without it).
    if (present.size() == before.size() && sh.first != before.front() && !beating(before.front())) {
      d.members.erase(d.members.begin());
      sh.store.create_once(decision, encode(d));
      break;
    }
    // Some did not come: the first to see the others all come or fall
    // silent decides.
    if ((present.size() < before.size() && !pending) || late) {
      sh.store.create_once(decision, encode(d));
      break;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  const Decision d = read_decision(sh.store, next);
  const std::vector<int>& after = d.members;
  const auto at = std::find(after.begin(), after.end(), sh.first);
  if (at == after.end())
    throw CommError(str("rank ", rank(), " (first rank ", sh.first, ") was left out when the others re-formed the group ",
                        "without their lost ranks (it answered after the time-out or after they had decided)"));
  const auto stayed = static_cast<std::size_t>(
      std::count_if(after.begin(), after.end(), [&](int m) { return std::find(before.begin(), before.end(), m) != before.end(); }));
  if (2 * stayed <= before.size())
    throw CommError(str("only ", stayed, " of the ", before.size(), " ranks (first ranks ", rank_list(after),
                        ") are left after a loss: a group goes on only with more than half of its ranks (no split brain)"));
  sh.epoch = next;
  sh.next_join = d.next_join;
  sh.next_id = d.next_id;
  sh.splits = 0;
  // The members change at once where no process was admitted, and once the
  // grown group is connected where some were: a rank lost meanwhile makes
  // the others re-form from the group they had (the new ones, who cannot
  // connect either, end).
  const bool grown = stayed < after.size();
  if (!grown) sh.members = after;
  try {
    auto ctx = connect(sh, str("e", next), static_cast<int>(at - after.begin()), static_cast<int>(after.size()),
                       timeout());
    sh.members = after;
    return std::make_unique<GlooComm>(shared_, std::move(ctx), true, next);
  } catch (const std::exception& e) {
    throw RankLost(str(grown ? "admitting new ranks" : "re-forming the group", " (first ranks ", rank_list(after),
                       "): ", e.what()));
  }
}

class World final : public GlooWorld {
 public:
  explicit World(const GlooOptions& o) {
    if (o.size < 1) throw InvalidInput(str("gloo backend: the world size must be at least 1 (got ", o.size, ")"));
    if (o.rank < 0 || o.rank >= o.size)
      throw InvalidInput(str("gloo backend: rank ", o.rank, " is not a rank of a world of ", o.size));
    if (o.rendezvous.empty()) throw InvalidInput("gloo backend: a rendezvous directory is needed (--rendezvous DIR)");
    std::error_code ec;
    std::filesystem::create_directories(o.rendezvous, ec);
    if (!std::filesystem::is_directory(o.rendezvous))
      throw InvalidInput(str("--rendezvous ", o.rendezvous, ": not a directory, and cannot be created",
                             ec ? str(" (", ec.message(), ")") : std::string()));
    shared_ = std::make_shared<Shared>(o.rendezvous, o.timeout, o.elastic, o.rank);
    Shared& sh = *shared_;
    if (sh.store.has("closed"))
      throw InvalidInput(str("--rendezvous ", o.rendezvous,
                             ": an earlier run ended in this directory; give each run a directory of its own"));
    char machine[256] = {};
    if (::gethostname(machine, sizeof machine - 1) != 0) throw InvalidInput("gloo backend: this machine has no host name");
    const std::string host = o.host.empty() ? std::string(machine) : o.host;
    // gloo reads getaddrinfo's failures as success (and crashes): asked first.
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0)
      throw InvalidInput(str("gloo backend: the host ", host, " has no address here (", ::gai_strerror(rc),
                             "); give this machine's address with --gloo-host"));
    ::freeaddrinfo(found);
    const std::string owner = str(machine, " ", ::getpid());
    make_device(sh, host);
    // A write to a peer that is gone must fail, not end this process.
    std::signal(SIGPIPE, SIG_IGN);
    if (o.join) {
      join(o, owner);
      return;
    }
    // The rank, taken: "<machine> <pid>". Never taken over: the keys an
    // earlier start left (its addresses) would mislead the others.
    const std::string rank_key = str("rank/", o.rank);
    if (!sh.store.create_once(rank_key, bytes_of(owner))) {
      const std::vector<char> held = sh.store.read(rank_key);
      throw InvalidInput(str("--rendezvous ", o.rendezvous, ": rank ", o.rank, " is already taken there (by process ",
                             std::string(held.begin(), held.end()), "); each process needs a rank of its own, and each "
                             "run (or new start of one) a directory of its own"));
    }
    for (int r = 0; r < o.size; ++r) sh.members.push_back(r);
    sh.next_id = o.size;
    sh.start_beating();
    try {
      comm_ = std::make_unique<GlooComm>(shared_, connect(sh, "e0", o.rank, o.size, o.timeout), true, 0);
    } catch (const CommTimeout&) {
      std::vector<int> missing;
      for (int r = 0; r < o.size; ++r)
        if (!sh.store.has(str("rank/", r))) missing.push_back(r);
      if (missing.empty()) throw;
      throw CommTimeout(str("rendezvous: timed out after ", seconds(o.timeout), " waiting for rank(s) ",
                            rank_list(missing), " to start in ", o.rendezvous, " (gloo backend)"));
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(str("gloo backend: rank ", o.rank, " could not connect to the others: ", e.what()));
    }
    comm_->set_timeout(o.timeout);
  }
  ~World() override { comm_.reset(); }

  void publish(const std::string& key, const std::string& value) override {
    shared_->store.set(str("published/", key), bytes_of(value));
  }
  std::string published(const std::string& key) const override { return published_in(shared_->store.dir(), key); }

  Communicator& comm() override { return *comm_; }
  std::vector<int> members() const override {
    std::lock_guard lock(shared_->m);
    return shared_->members;
  }
  int first_rank() const override { return shared_->first; }
  void finish() override {
    Shared& sh = *shared_;
    std::vector<int> members;
    int epoch = 0;
    {
      std::lock_guard lock(sh.m);
      members = sh.members;
      epoch = sh.epoch;
    }
    sh.store.set(str("done/", epoch, "/", sh.first), bytes_of("1"));
    const auto start = Clock::now();
    for (;;) {
      std::vector<int> missing;
      for (int m : members)
        if (!sh.store.has(str("done/", epoch, "/", m))) missing.push_back(m);
      if (missing.empty()) break;
      if (Clock::now() - start > comm_->timeout())
        throw CommTimeout(str("the run's end on rank ", sh.first, ": timed out after ", seconds(comm_->timeout()),
                              " waiting for rank(s) ", rank_list(missing), " (gloo backend)"));
      std::this_thread::sleep_for(milliseconds(5));
    }
    if (members.front() == sh.first) sh.store.set("closed", bytes_of("1"));
  }

 private:
  static void make_device(Shared& sh, const std::string& host) {
    try {
      sh.device = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr(host.c_str()));
    } catch (const std::exception& e) {
      throw InvalidInput(str("gloo backend: cannot listen on ", host, " (", e.what(),
                             "); give this machine's address with --gloo-host"));
    }
  }

  // Asks to join ("join/<k>", the first k free) and waits for the answer
  // ("joined/<k>": the epoch and this process's rank number), withdrawing
  // the request once the run has not seen it for the time-out ("joins-seen"
  // unchanged); then connects to the grown group. An answer whose epoch's
  // group left this process out (a member decided it without admissions:
  // GlooComm::reform) is answered by asking again.
  void join(const GlooOptions& o, const std::string& owner) {
    Shared& sh = *shared_;
    if (!sh.store.has("rank/0"))
      throw InvalidInput(str("--join ", o.rendezvous, ": no run has started there"));
    int k = 0, epoch = 0, id = -1;
    Decision d;
    for (;;) {
      while (!sh.store.create_once(str("join/", k), bytes_of(owner))) ++k;
      const std::string answer = str("joined/", k);
      auto start = Clock::now();
      std::string seen = read_or_empty(sh.store, "joins-seen");
      for (int polls = 0; !sh.store.has(answer); ++polls) {
        if (polls % 20 == 19) {  // every 0.1 s: the run saw the request again
          std::string now = read_or_empty(sh.store, "joins-seen");
          if (now != seen) seen = std::move(now), start = Clock::now();
        }
        const bool ended = sh.store.has("closed");
        if ((ended || Clock::now() - start > o.timeout) && sh.store.create_once(answer, bytes_of("withdrawn"))) {
          if (ended) throw CommError(str("--join ", o.rendezvous, ": the run ended before it admitted this process"));
          throw CommTimeout(str("--join ", o.rendezvous, ": the run did not admit this process within ",
                                seconds(o.timeout), " (it admits new ranks between two steps)"));
        }
        std::this_thread::sleep_for(milliseconds(5));
      }
      std::istringstream in([&] {
        const auto a = sh.store.read(answer);
        return std::string(a.begin(), a.end());
      }());
      in >> epoch >> id;
      if (epoch <= 0 || id < 0) throw CommError(str("--join ", o.rendezvous, ": a malformed answer in ", answer));
      sh.store.wait({str("members/", epoch)});
      d = read_decision(sh.store, epoch);
      if (std::find(d.members.begin(), d.members.end(), id) != d.members.end()) break;
    }
    const std::vector<int>& after = d.members;
    const auto at = std::find(after.begin(), after.end(), id);
    {
      std::lock_guard lock(sh.m);
      sh.first = id;
      sh.epoch = epoch;
      sh.members = after;
      sh.next_join = d.next_join;
      sh.next_id = d.next_id;
    }
    sh.start_beating();
    try {
      comm_ = std::make_unique<GlooComm>(
          shared_, connect(sh, str("e", epoch), static_cast<int>(at - after.begin()), static_cast<int>(after.size()),
                           o.timeout),
          true, epoch);
    } catch (const std::exception& e) {
      throw CommError(str("--join ", o.rendezvous, ": could not connect to the run's ranks: ", e.what()));
    }
    comm_->set_timeout(o.timeout);
  }

  std::shared_ptr<Shared> shared_;
  std::unique_ptr<Communicator> comm_;
};

}  // namespace

std::unique_ptr<GlooWorld> open_gloo_world(const GlooOptions& options) { return std::make_unique<World>(options); }

std::string published_in(const std::string& rendezvous, const std::string& key) {
  DirStore store(rendezvous, milliseconds(0));
  const std::string k = str("published/", key);
  if (!store.has(k)) return "";
  const auto v = store.read(k);
  return std::string(v.begin(), v.end());
}

}  // namespace distopt
