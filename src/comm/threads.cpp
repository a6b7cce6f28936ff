// Threads backend: see include/distopt/comm/threads.hpp.
//
// Each communicator group shares a Group: a barrier with per-rank arrival
// marks (so a time-out can name the ranks that did not arrive), one slot per
// rank where a collective posts its buffers, and mailboxes for
// point-to-point messages. A collective is: post slot, barrier, work on the
// posted buffers, barrier (nobody leaves while others still read its memory).
//
// The types every group of a world shares are in threads_impl.hpp; spawn()
// is in threads_spawn.cpp.
#include "distopt/comm/threads.hpp"

#include "distopt/core/copy.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "threads_impl.hpp"

namespace distopt {

namespace threads_detail {

void World::abort(const std::string& why) {
  {
    std::lock_guard lock(m);
    if (aborted.exchange(true)) return;
    reason = why;
  }
  wake_all();
}

void World::lose(const std::vector<int>& ranks) {
  {
    std::lock_guard lock(m);
    for (int r : ranks) lost[r] = true;
  }
  wake_all();
}

void World::wake_all() {
  std::vector<std::shared_ptr<Group>> live;
  {
    std::lock_guard lock(m);
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
    shrink_cv.notify_all();
  }
  for (auto& g : live) {
    std::lock_guard lock(g->m);  // no waiter can miss the flag
    g->cv.notify_all();
  }
}

}  // namespace threads_detail

namespace {

using threads_detail::Group;
using threads_detail::seconds;
using threads_detail::Slot;
using threads_detail::World;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

std::shared_ptr<Group> new_group(int n, const std::shared_ptr<World>& world) {
  auto g = std::make_shared<Group>(n, world);
  std::lock_guard lock(world->m);
  world->groups.push_back(g);
  return g;
}

class ThreadsComm final : public Communicator {
 public:
  ThreadsComm(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  ~ThreadsComm() override { stop_progress(); }

  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  std::string_view backend() const override { return "threads"; }

  World& world() { return *g_->world; }

 protected:
  std::unique_ptr<Request> do_isend(const void* buf, std::size_t bytes, int peer, int tag) override;
  std::unique_ptr<Request> do_irecv(void* buf, std::size_t bytes, int peer, int tag) override;

  void do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type,
                           ReduceOp op) override {
    rendezvous("reduce_scatter", Slot{send, recv});
    const std::size_t offset = offsets_of(counts)[rank_] * size_of(type);
    std::vector<const void*> inputs(g_->size);
    for (int r = 0; r < g_->size; ++r) inputs[r] = static_cast<const char*>(g_->slots[r].send) + offset;
    reduce_ordered(inputs.data(), g_->size, recv, counts[rank_], type, op);
    count_sent(counts[rank_] * size_of(type) * static_cast<std::size_t>(g_->size - 1));  // read from the others
    rendezvous("reduce_scatter", std::nullopt, Phase::closing);
  }

  // Push: each rank writes its own piece into every rank's output in one
  // pass, each 128 bytes read once and stored to all outputs -- per rank,
  // S/n bytes read and S written, where pulling every piece reads S and
  // writes S (docs/algorithms.md).
  void do_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type) override {
    rendezvous("all_gather", Slot{send, recv});
    const std::size_t es = size_of(type);
    const std::size_t bytes = counts[rank_] * es, at = offsets_of(counts)[rank_] * es;
    std::vector<void*> outs;
    for (int r = 0; r < g_->size; ++r) {
      char* dst = static_cast<char*>(g_->slots[r].recv) + at;
      if (dst != send) outs.push_back(dst);
    }
    if (bytes < kStreamBytes) {
      for (void* dst : outs) copy_bytes(dst, send, bytes);
    } else {
      stream_bytes_to(outs, send, bytes);
    }
    count_sent(bytes * static_cast<std::size_t>(g_->size - 1));  // written into the others' outputs
    rendezvous("all_gather", std::nullopt, Phase::closing);
  }

  // Pull: each rank copies its piece of every rank's input.
  void do_all_to_all(const void* send, void* recv, std::size_t bytes) override {
    rendezvous("all_to_all", Slot{send, recv});
    for (int r = 0; r < g_->size; ++r)
      copy_bytes(static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes,
                 static_cast<const char*>(g_->slots[r].send) + static_cast<std::size_t>(rank_) * bytes, bytes);
    count_sent(bytes * static_cast<std::size_t>(g_->size - 1));  // read from the others
    rendezvous("all_to_all", std::nullopt, Phase::closing);
  }

  void do_broadcast(void* buf, std::size_t bytes, int root) override {
    rendezvous("broadcast", Slot{buf, buf});
    if (rank_ != root) copy_bytes(buf, g_->slots[root].send, bytes);
    if (rank_ == root) count_sent(bytes * static_cast<std::size_t>(g_->size - 1));
    rendezvous("broadcast", std::nullopt, Phase::closing);
  }

  void do_barrier() override { rendezvous("barrier"); }

  std::unique_ptr<Communicator> do_shrink() override {
    World& w = *g_->world;
    if (!w.elastic) throw CommError("shrink: this threads world does not go on without lost ranks (Elastic::off)");
    const int me = g_->members[rank_];
    const auto until = deadline();
    std::unique_lock lock(w.m);
    if (w.lost[me])
      throw RankLost(str("shrink on rank ", rank_, ": this rank was lost; the others went on without it"));
    if (!g_->top) throw CommError("shrink: only the world's top-level communicator re-forms");
    if (w.root != g_.get())
      throw RankLost(str("shrink on rank ", rank_, ": the survivors re-formed without this rank"));
    const std::uint64_t round = w.round;
    w.arrived[me] = 1;
    auto complete = [&] {
      for (int m : g_->members)
        if (!w.lost[m] && !w.arrived[m]) return false;
      return true;
    };
    w.shrink_cv.wait_until(lock, until, [&] { return w.round != round || complete() || w.aborted; });
    if (w.aborted) {
      lock.unlock();
      throw_aborted("shrink");
    }
    bool late = false;
    if (w.round == round) {
      // This rank closes the round: who has not come by now is lost too.
      std::vector<int> live;
      for (int m : g_->members) {
        if (!w.lost[m] && !w.arrived[m]) {
          w.lost[m] = true;
          late = true;
        }
        if (!w.lost[m]) live.push_back(m);
      }
      auto next = std::make_shared<Group>(static_cast<int>(live.size()), g_->world);
      next->members = live;
      next->top = true;
      w.groups.push_back(next);
      w.root = next.get();
      w.formed[round] = {next, 0};
      std::fill(w.arrived.begin(), w.arrived.end(), 0);
      ++w.round;
      w.shrink_cv.notify_all();
    }
    World::Formed& f = w.formed.at(round);
    std::shared_ptr<Group> next = f.group;
    if (++f.taken == next->size) w.formed.erase(round);
    lock.unlock();
    if (late) w.wake_all();
    const auto at = std::find(next->members.begin(), next->members.end(), me);
    if (at == next->members.end())
      throw RankLost(str("shrink on rank ", rank_, ": this rank came after the survivors re-formed without it"));
    return std::make_unique<ThreadsComm>(std::move(next), static_cast<int>(at - next->members.begin()));
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override {
    Slot mine;
    mine.color = color;
    mine.key = key;
    rendezvous("split", mine);
    const std::uint64_t id = split_count_++;
    std::vector<std::pair<int, int>> members;  // (key, parent rank)
    for (int r = 0; r < g_->size; ++r)
      if (g_->slots[r].color == color) members.push_back({g_->slots[r].key, r});
    std::sort(members.begin(), members.end());
    std::shared_ptr<Group> child;
    if (color >= 0) {
      std::lock_guard lock(g_->m);
      auto& slot = g_->children[{id, color}];
      if (!slot) {
        slot = new_group(static_cast<int>(members.size()), g_->world);
        for (std::size_t i = 0; i < members.size(); ++i) slot->members[i] = g_->members[members[i].second];
      }
      child = slot;
    }
    rendezvous("split", std::nullopt, Phase::closing);
    if (rank_ == 0) {
      std::lock_guard lock(g_->m);
      for (auto it = g_->children.begin(); it != g_->children.end();)
        it = it->first.first == id ? g_->children.erase(it) : std::next(it);
    }
    if (color < 0) return nullptr;
    const int new_rank = static_cast<int>(
        std::find_if(members.begin(), members.end(), [&](auto& m) { return m.second == rank_; }) - members.begin());
    auto comm = std::make_unique<ThreadsComm>(std::move(child), new_rank);
    comm->set_timeout(timeout());
    return comm;
  }

 private:
  friend class MailRecv;
  // Elastic: a rank of this group was lost (the caller may hold g_->m).
  [[noreturn]] void throw_lost(const char* op) {
    throw RankLost(str(op, " on rank ", rank_, ": rank(s) ", g_->lost_members(), " lost (threads backend)"));
  }
  [[noreturn]] void throw_aborted(const char* op) {
    std::lock_guard lock(g_->world->m);
    throw CommAborted(str(op, " on rank ", rank_, ": aborted because ", g_->world->reason));
  }

  // Posts this rank's slot (when given) and waits until every rank of the
  // group arrived. The closing rendezvous of a collective posts nothing:
  // slower ranks may still be reading the slots of the opening one.
  // The closing rendezvous of a collective (after its copies) or any other.
  enum class Phase { opening, closing };
  void rendezvous(const char* op, std::optional<Slot> slot = std::nullopt, Phase phase = Phase::opening) {
    const auto until = deadline();
    std::unique_lock lock(g_->m);
    if (g_->world->aborted) {
      lock.unlock();
      throw_aborted(op);
    }
    // The closing rendezvous of an elastic world: every rank passed the
    // opening one and is in the collective's bounded copy, reading or
    // writing the others' buffers; none may leave (and free them) before
    // all are through, lost or not.
    if (phase == Phase::closing && g_->world->elastic) {
      const std::uint64_t gen = g_->generation.load(std::memory_order_relaxed);
      if (++g_->arrived == g_->size) {
        g_->arrived = 0;
        g_->generation.store(gen + 1, std::memory_order_release);
        g_->cv.notify_all();
        return;
      }
      g_->cv.wait(lock, [&] { return g_->generation.load(std::memory_order_relaxed) != gen || g_->world->aborted; });
      if (g_->generation.load(std::memory_order_relaxed) != gen) return;
      lock.unlock();
      throw_aborted(op);
    }
    if (g_->broken()) throw_lost(op);
    if (slot) g_->slots[rank_] = *slot;
    const std::uint64_t gen = g_->generation.load(std::memory_order_relaxed);
    g_->arrived_gen[rank_] = gen + 1;
    if (++g_->arrived == g_->size) {
      g_->arrived = 0;
      g_->generation.store(gen + 1, std::memory_order_release);
      g_->cv.notify_all();
      return;
    }
    // Spin briefly before sleeping: ranks of a step arrive within
    // microseconds of each other, and a futex wake-up costs tens of them.
    // Only when every rank can have a core, or spinning starves the others.
    if (spin_) {
      lock.unlock();
      for (int i = 0; i < kSpinIterations; ++i) {
        if (g_->generation.load(std::memory_order_acquire) != gen) return;
        if (g_->world->aborted.load(std::memory_order_relaxed) || g_->broken()) break;
        cpu_relax();
      }
      lock.lock();
    }
    g_->cv.wait_until(lock, until, [&] {
      return g_->generation.load(std::memory_order_relaxed) != gen || g_->world->aborted || g_->broken();
    });
    if (g_->generation.load(std::memory_order_relaxed) != gen) return;
    if (g_->world->aborted) {
      lock.unlock();
      throw_aborted(op);
    }
    if (g_->broken()) throw_lost(op);
    std::string missing;
    std::vector<int> silent;
    for (int r = 0; r < g_->size; ++r)
      if (g_->arrived_gen[r] != gen + 1) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        silent.push_back(g_->members[r]);
      }
    if (g_->world->elastic) {
      // Silent past the time-out: lost, and the others woken to go on without them.
      lock.unlock();
      g_->world->lose(silent);
      throw RankLost(str(op, " on rank ", rank_, ": rank(s) ", missing, " silent for ", seconds(timeout()),
                         ", lost (threads backend)"));
    }
    throw CommTimeout(str(op, " on rank ", rank_, ": timed out after ", seconds(timeout()),
                          " waiting for rank(s) ", missing, " (threads backend)"));
  }

  // Up to about 0.1-0.2 ms of pause instructions, then sleep.
  static constexpr int kSpinIterations = 1 << 12;
  std::shared_ptr<Group> g_;
  const int rank_;
  const bool spin_ = g_->size <= static_cast<int>(std::thread::hardware_concurrency());
  std::uint64_t split_count_ = 0;
};

class DoneRequest final : public Request {
 public:
  bool test() override { return true; }
  void wait() override {}
};

class MailRecv final : public Request {
 public:
  MailRecv(ThreadsComm* c, void* buf, std::size_t bytes, int peer, int tag)
      : c_(c), buf_(buf), bytes_(bytes), peer_(peer), tag_(tag) {}

  bool test() override {
    if (done_) return true;
    {
      std::lock_guard lock(c_->g_->m);
      if (take()) return true;
    }
    // A message that will never come: the world has aborted.
    if (c_->g_->world->aborted) c_->throw_aborted("recv");
    return false;
  }

  void wait() override {
    if (done_) return;
    const auto until = c_->deadline();
    std::unique_lock lock(c_->g_->m);
    c_->g_->cv.wait_until(lock, until, [&] { return ready() || c_->g_->world->aborted || c_->g_->broken(); });
    if (take()) return;
    if (c_->g_->world->aborted) {
      lock.unlock();
      c_->throw_aborted("recv");
    }
    if (c_->g_->broken()) c_->throw_lost("recv");
    throw CommTimeout(str("recv on rank ", c_->rank(), ": timed out after ", seconds(c_->timeout()),
                          " waiting for rank ", peer_, " (tag ", tag_, ", threads backend)"));
  }

 private:
  std::deque<std::vector<unsigned char>>& box() { return c_->g_->mail[{peer_, c_->rank(), tag_}]; }
  bool ready() { return !box().empty(); }
  // Caller holds the group's mutex.
  bool take() {
    auto& b = box();
    if (b.empty()) return false;
    std::vector<unsigned char> msg = std::move(b.front());
    b.pop_front();
    if (msg.size() != bytes_)
      throw CommError(str("recv on rank ", c_->rank(), " from rank ", peer_, " (tag ", tag_, "): expected ", bytes_,
                          " bytes, the message has ", msg.size()));
    if (bytes_ > 0) std::memcpy(buf_, msg.data(), bytes_);
    done_ = true;
    return true;
  }
  ThreadsComm* c_;
  void* buf_;
  std::size_t bytes_;
  int peer_, tag_;
  bool done_ = false;
};

std::unique_ptr<Request> ThreadsComm::do_isend(const void* buf, std::size_t bytes, int peer, int tag) {
  std::vector<unsigned char> msg(static_cast<const unsigned char*>(buf),
                                 static_cast<const unsigned char*>(buf) + bytes);
  {
    std::lock_guard lock(g_->m);
    if (g_->world->aborted) throw CommAborted(str("send on rank ", rank_, ": aborted because ", g_->world->reason));
    g_->mail[{rank_, peer, tag}].push_back(std::move(msg));
  }
  g_->cv.notify_all();
  count_sent(bytes);
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<Request> ThreadsComm::do_irecv(void* buf, std::size_t bytes, int peer, int tag) {
  return std::make_unique<MailRecv>(this, buf, bytes, peer, tag);
}

}  // namespace

namespace threads_detail {

World& world_of(Communicator& comm) { return static_cast<ThreadsComm&>(comm).world(); }

}  // namespace threads_detail

std::vector<std::unique_ptr<Communicator>> make_threads_world(int n, Elastic elastic) {
  if (n < 1) throw InvalidInput(str("world size must be at least 1, got ", n));
  auto world = std::make_shared<World>(n, elastic);
  auto group = new_group(n, world);
  world->root = group.get();
  group->top = true;
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(std::make_unique<ThreadsComm>(group, r));
  return comms;
}

}  // namespace distopt
