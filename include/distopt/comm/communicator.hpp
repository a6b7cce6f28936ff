// Communicator: the small, typed, order-contracted interface every backend
// implements (threads: ranks are threads of one process; mpi: Open MPI).
//
// Contract:
//  * Every rank of a communicator issues the same collectives in the same
//    order (blocking and non-blocking alike). Nothing coordinates beyond that.
//  * One thread uses a communicator at a time. Non-blocking collectives run,
//    in issue order, on the communicator's own progress thread; a blocking
//    collective issued while some are pending waits its turn.
//  * Every wait has a deadline (timeout(): default_timeout(), settable). Past
//    it, CommTimeout names the operation and the peers that did not answer.
//    Waits that last long poll gently: the MPI backend yields for the first
//    second and then sleeps 1 ms between polls; the threads backend sleeps
//    on a condition variable after a short spin.
//    When a rank of the threads backend fails, the others are woken with
//    CommAborted (RankLost in an elastic world, whose survivors go on
//    through shrink()). After any CommError in a collective the communicator is
//    broken: every later collective, queued or new, fails at once with it.
//  * all_reduce is reduce_scatter followed by all_gather over the pieces of
//    piece_of(), and reductions combine ranks in order 0, 1, ..., n-1
//    (reduce_ordered). Results are therefore bitwise identical between
//    all_reduce and all_gather(reduce_scatter), and between backends.
//  * Buffers: counts are in elements. `send` and `recv` may be the same
//    pointer (in place) where noted.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "distopt/comm/types.hpp"
#include "distopt/core/buffer.hpp"

namespace distopt {

class Request {
 public:
  virtual ~Request() = default;
  // True when the operation completed; rethrows its failure.
  virtual bool test() = 0;
  // Blocks until completion (or the communicator's timeout); rethrows.
  virtual void wait() = 0;
};

// An emulated network link (docs/gossip.md, "Emulated links"): every rank
// has one egress link of `bandwidth_bps` bits per second (0: unshaped)
// shared by all it sends, in order (messages of up to kSmallMessage bytes
// skip the queue), and every message arrives `latency_s` after its last
// byte left. A point-to-point message is not received before
// then; a collective ends on each rank once the bytes it sent have crossed
// its link, plus one latency per phase.
struct LinkModel {
  double bandwidth_bps = 0;
  double latency_s = 0;
  bool active() const { return bandwidth_bps > 0 || latency_s > 0; }
};

// Whether a world goes on without ranks it loses: off, a failing rank ends
// every rank (CommAborted, or the backend's error); on, the others are woken
// with RankLost, a rank silent past the time-out is lost as well, and the
// survivors re-form the world with Communicator::shrink() (threads, gloo).
enum class Elastic { off, on };

class Communicator {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kDefaultTimeout{300'000};
  // The timeout new communicators start with: DISTOPT_COMM_TIMEOUT (seconds)
  // where it is set, else kDefaultTimeout. A malformed value throws
  // InvalidInput naming the variable.
  static std::chrono::milliseconds default_timeout();
  // A timeout given as text in seconds ("5", "0.5"): positive, finite and at
  // most a year; `what` names the source in the error ("--comm-timeout").
  static std::chrono::milliseconds parse_timeout(const std::string& seconds, const std::string& what);

  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;

  // Bytes this rank has sent to other ranks through this communicator:
  // what the MPI backend hands to MPI_Isend, what the threads backend reads
  // from or writes into other ranks' memory (docs/algorithms.md counts the
  // same per collective). Broadcast counts the root's buffer once per peer.
  std::uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // Seconds spent running collectives (blocking ones on the caller's
  // thread, non-blocking ones on the progress thread), waiting for peers
  // included. Point-to-point operations are not counted.
  double busy_seconds() const { return static_cast<double>(busy_ns_.load(std::memory_order_relaxed)) * 1e-9; }

  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  // Throws InvalidInput for a negative or non-finite bandwidth or latency.
  // While a model is active, point-to-point tags must be below kMaxTag.
  void set_link_model(const LinkModel& link);
  const LinkModel& link_model() const { return link_; }
  static constexpr int kMaxTag = 1 << 20;
  // Messages of at most this many bytes do not queue behind others on an
  // emulated link.
  static constexpr std::size_t kSmallMessage = 4096;
  std::chrono::milliseconds timeout() const { return timeout_; }

  // recv[i] = op over ranks of send[i]; `count` elements. In place allowed.
  void all_reduce(const void* send, void* recv, std::size_t count, ElemType type, ReduceOp op);
  // send holds size()*recv_count elements; rank r receives the reduction of
  // piece r (elements [r*recv_count, (r+1)*recv_count)). In place: recv may
  // be send + rank()*recv_count (the rank's own piece of the input).
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, ElemType type, ReduceOp op);
  // As reduce_scatter with per-rank counts: rank r receives the reduction of
  // the r-th piece (offsets are the counts' prefix sums); the same sums in
  // the same order as reduce_scatter and all_reduce give those elements.
  void reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type, ReduceOp op);
  // recv (size()*send_count elements) = the ranks' send buffers in rank order.
  // In place: send may be recv + rank()*send_count.
  void all_gather(const void* send, void* recv, std::size_t send_count, ElemType type);
  // As all_gather with per-rank counts (any counts, e.g. uneven shards).
  // `send` may be recv + (offset of this rank's piece): in place.
  void all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type);
  // send holds size() pieces of `count` elements, piece r for rank r; recv
  // receives size() pieces, piece r from rank r (its own piece copied).
  // Not in place. The compressed reductions are built on it
  // (src/parallel/int8_wire.hpp): the sums are the receiver's, not the
  // transport's.
  void all_to_all(const void* send, void* recv, std::size_t count, ElemType type);
  void broadcast(void* buf, std::size_t count, ElemType type, int root);
  // Bytes of any length from `root` to every rank: the size, then the bytes
  // (the others' `bytes` are resized to it).
  void broadcast_bytes(std::string& bytes, int root);
  void broadcast_bytes(std::vector<char>& bytes, int root);
  void barrier();

  void send(const void* buf, std::size_t count, ElemType type, int peer, int tag = 0);
  void recv(void* buf, std::size_t count, ElemType type, int peer, int tag = 0);
  std::unique_ptr<Request> isend(const void* buf, std::size_t count, ElemType type, int peer, int tag = 0);
  std::unique_ptr<Request> irecv(void* buf, std::size_t count, ElemType type, int peer, int tag = 0);

  // Non-blocking collectives: buffers must stay valid until wait()/test().
  std::unique_ptr<Request> iall_reduce(const void* send, void* recv, std::size_t count, ElemType type, ReduceOp op);
  std::unique_ptr<Request> ireduce_scatter(const void* send, void* recv, std::size_t recv_count, ElemType type,
                                           ReduceOp op);
  std::unique_ptr<Request> iall_gather(const void* send, void* recv, std::size_t send_count, ElemType type);
  std::unique_ptr<Request> iall_to_all(const void* send, void* recv, std::size_t count, ElemType type);
  std::unique_ptr<Request> ibroadcast(void* buf, std::size_t count, ElemType type, int root);

  // Collective: ranks with the same color form a new communicator, ordered
  // by (key, rank). A negative color returns nullptr for that rank. The new
  // one starts with this one's timeout and link model (an emulated link of
  // its own: the two do not share a token bucket).
  std::unique_ptr<Communicator> split(int color, int key);

  // After RankLost: the ranks still alive form a new communicator, ranked
  // in their old order (collective over the survivors; a rank that does
  // not come within the time-out is lost too). Only a world's top-level
  // communicator (not one made by split) shrinks; backends that cannot
  // re-form a group throw CommError saying so.
  std::unique_ptr<Communicator> shrink();

  // Worlds that admit new ranks (gloo's --join): how many processes wait to
  // join (asked on rank 0; not collective; always 0 where none can). grow()
  // is collective over this world's top communicator and the first `joins`
  // of them: a new communicator with the current ranks first, in order,
  // and the new ones after them. A rank lost meanwhile makes the others
  // shrink() while some grow(): both then form the group of the survivors,
  // admitting no one (a grow may thus return a smaller world). Backends
  // that cannot throw CommError.
  virtual int pending_joins() { return 0; }
  std::unique_ptr<Communicator> grow(int joins);

  // Typed conveniences.
  template <class T>
  void all_reduce(std::span<T> buf, ReduceOp op);

 protected:
  Communicator() = default;
  Clock::time_point deadline() const { return Clock::now() + timeout_; }

  // Backend primitives. rank r of the result holds op over ranks of
  // send[offset_r .. offset_r + counts[r]) (offsets = prefix sums). By
  // default the rank-ordered collectives below, on the backend's
  // exchange() (MPI, gloo, torch.distributed's groups); the threads
  // backend, which shares memory, has its own.
  virtual void do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type,
                                   ReduceOp op) {
    ordered_reduce_scatter_v(send, recv, counts, type, op);
  }
  virtual void do_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type) {
    ordered_all_gather_v(send, recv, counts, type);
  }
  // all_to_all of `bytes` per piece; by default on exchange(), as below.
  virtual void do_all_to_all(const void* send, void* recv, std::size_t bytes) { ordered_all_to_all(send, recv, bytes); }
  virtual void do_broadcast(void* buf, std::size_t bytes, int root) = 0;
  virtual void do_barrier() = 0;
  // Point-to-point; `peer` is already checked to be a rank of this communicator.
  virtual std::unique_ptr<Request> do_isend(const void* buf, std::size_t bytes, int peer, int tag) = 0;
  virtual std::unique_ptr<Request> do_irecv(void* buf, std::size_t bytes, int peer, int tag) = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;
  virtual std::unique_ptr<Communicator> do_shrink();
  virtual std::unique_ptr<Communicator> do_grow(int joins);
  // Backends call this first thing in their destructor: it finishes queued
  // non-blocking collectives and joins the progress thread while the
  // backend's members still exist.
  void stop_progress();
  // Backends call this for the bytes they move to other ranks.
  void count_sent(std::size_t bytes);

  // The rank-ordered collectives on point-to-point messages
  // (src/comm/ordered.cpp), the default do_reduce_scatter_v and
  // do_all_gather_v, for backends whose transport moves bytes and leaves
  // the sums to distopt (MPI, gloo, torch.distributed's groups): each rank
  // receives its piece from every other rank and sums all n in rank order
  // (reduce_ordered), so every backend gives the threads backend's bits.
  // At step j a rank sends to rank + j and receives from rank - j. A
  // backend using them implements exchange().
  struct Message {
    int peer;
    char* data;
    std::size_t bytes;
  };
  // Posts every receive, then every send, of one collective (`op`:
  // "reduce_scatter", "all_gather" or "all_to_all", for its errors and the backend's
  // tags) and waits for all of them; counts the bytes it sends.
  virtual void exchange(const char* op, std::span<const Message> sends, std::span<const Message> recvs);
  void ordered_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type,
                                ReduceOp op);
  void ordered_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type);
  void ordered_all_to_all(const void* send, void* recv, std::size_t bytes);

 private:
  struct Task;
  class TaskRequest;
  // Runs a collective in issue order: inline when nothing is pending,
  // otherwise after the pending ones (on the progress thread).
  void run_ordered(std::function<void()> fn);
  void all_reduce_now(const void* send, void* recv, std::size_t count, ElemType type, ReduceOp op);
  std::unique_ptr<Request> enqueue(std::function<void()> fn);
  void progress_loop();
  void check_rank(int r, const char* what) const;

  std::chrono::milliseconds timeout_ = default_timeout();
  // The emulated link: when this rank's egress is free again.
  class EmulatedSend;
  class EmulatedRecv;
  Clock::time_point reserve_link(std::size_t bytes);
  LinkModel link_;
  std::mutex link_mutex_;
  Clock::time_point link_free_{};
  std::atomic<std::uint64_t> bytes_sent_{0};
  // Bytes sent by the thread running a collective, while it runs one.
  std::atomic<std::uint64_t> collective_bytes_{0};
  std::atomic<std::thread::id> on_collective_thread_{};
  std::atomic<std::uint64_t> busy_ns_{0};
  void timed(const std::function<void()>& fn);
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool busy_ = false;  // the progress thread is running a task
  bool stop_ = false;
  std::exception_ptr broken_;  // the first CommError: later collectives fail with it at once
  // Receives the other ranks' pieces in ordered_reduce_scatter_v; a member,
  // so that a receive abandoned after a failure never lands in freed memory.
  Buffer scratch_;
  std::thread progress_;
};

template <class T>
void Communicator::all_reduce(std::span<T> buf, ReduceOp op) {
  ElemType t;
  if constexpr (std::is_same_v<T, float>) t = ElemType::f32;
  else if constexpr (std::is_same_v<T, double>) t = ElemType::f64;
  else if constexpr (std::is_same_v<T, std::int32_t>) t = ElemType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>) t = ElemType::i64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) t = ElemType::u8;
  else if constexpr (std::is_same_v<T, bf16>) t = ElemType::bf16;
  else t = ElemType::f16;
  all_reduce(buf.data(), buf.data(), buf.size(), t, op);
}

}  // namespace distopt
