// The gloo backend's data path (private to src/comm/gloo; see mesh.cpp and
// docs/reliability.md, "Processes"): a full mesh of TCP connections between
// the processes of one group, whose messages move in the thread that waits
// for them.
//
// Why not gloo's own pairs: each of gloo's unbound-buffer messages waits
// for a "ready to receive" notice from its receiver, and every byte is
// read by gloo's event-loop thread and handed to the waiting one, whose
// pair lock the loop spins on meanwhile; on a 2-core machine an 8-byte
// all_reduce of 2 processes took 180-400 us (MPI: 6.5 us) and pinned to
// one core each 4 ms (docs/cluster.md, "gloo and MPI").
//
// Here a message is a 16-byte header (slot, bytes) and its bytes, sent at
// once (eager); a receiver matches it to the receive posted on the same
// peer and slot, first posted first, or keeps it until one is posted.
// Messages between two processes keep their order per slot. Nothing
// limits what a sender sends ahead: a message no receive is ever posted
// for stays in memory until the group ends (the communicator's
// operations are all matched). Whichever
// thread waits polls every connection, so no message waits for a thread
// that is not running, and a message no one waits for yet does not block
// its connection.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt::gloo_detail {

class KeyStore;
struct Bytes;

// A wait on a connection that broke ("connection to rank 2 closed"), or
// that timed out ("Timed out ...").
class MeshError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Mesh {
 public:
  using Clock = Communicator::Clock;

  // Rank `rank` of `size` connects to the others: it listens on `host`
  // (empty: this machine's name), leaves its address under
  // "<prefix>/<rank>" in `store`, connects to the lower ranks and accepts
  // the higher ones, all within `timeout` (CommTimeout naming the ranks
  // that did not come, CommError for an address that does not answer).
  static std::shared_ptr<Mesh> connect(KeyStore& store, const std::string& prefix, const std::string& host, int rank,
                                       int size, std::chrono::milliseconds timeout);
  // A mesh over connected stream sockets, one per rank (-1 for `rank`'s
  // own), which it then owns: for tests and fuzzing. With `rings`, it
  // agrees on shared-memory rings with each peer as connect() does (the
  // peers must do the same at once).
  static std::shared_ptr<Mesh> over(int rank, std::vector<int> fds, bool rings = false);
  // A greeting's first 16 bytes: the rank it names and the length of the
  // prefix that follows, or rank -1 where they do not greet as a member of
  // a group of `size` whose `rank` accepts them (a rank above it, a prefix
  // of `prefix_length` bytes).
  struct Greeting {
    int rank = -1;
  };
  static Greeting greeting(const unsigned char* head, std::size_t prefix_length, int rank, int size);
  // Throws CommError where this process cannot listen on `host`.
  static void check_listen(const std::string& host);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  // Messages to and from `peer` go through shared memory.
  bool uses_rings(int peer) const;

  struct Op;
  // A message to `peer` from `data` (kept valid until its wait ends), or
  // one from `peer` into `data` (`bytes` must be the size sent).
  std::shared_ptr<Op> send(int peer, std::uint64_t slot, const void* data, std::size_t bytes);
  std::shared_ptr<Op> recv(int peer, std::uint64_t slot, void* data, std::size_t bytes);
  // True when `op` is done, false when abort_pending ended its wait.
  // Throws MeshError when its connection broke or `until` passed.
  bool wait(Op& op, Clock::time_point until);
  // The waits of every operation not done now return false.
  void abort_pending();
  // Ends every connection: no byte is read into or written from a
  // caller's buffer after it returns; waits throw.
  void close();
  // An operation whose caller will not wait for it (its buffer may go):
  // a receive is withdrawn (a message it was reading is read and dropped),
  // a send not begun is dropped and one begun finishes from a copy.
  void cancel(Op& op);

 private:
  struct Peer;
  Mesh(int rank, std::vector<int> fds);
  // Ring bytes per pair for a group of `size` on one machine (0: none;
  // DISTOPT_GLOO_SHM=0 turns them off).
  static std::size_t ring_capacity(int size);
  // Each pair on this machine agrees on two rings in shared memory (one
  // each way), over its connection; other pairs keep to TCP.
  void share_memory(std::size_t capacity, Clock::time_point until);
  void post(Peer& p, const std::shared_ptr<Op>& op);
  // Bytes to or from the peer's connection or ring: how many moved (0:
  // none can now), or -1 once the connection broke.
  long put(Peer& p, const iovec* iov, int n);
  long take(Peer& p, char* into, std::size_t n);
  void write_some(Peer& p);
  void read_some(Peer& p);
  void broke(Peer& p, const std::string& why);
  void wake();
  Bytes buffer(std::size_t n);
  void recycle(Bytes b);
  // Moves what the rings allow (the lock held).
  void progress_rings();
  // A ring of these has data, or room a send waits for.
  static bool rings_ready(const std::vector<Peer*>& ring_peers);
  // The peer `rank` (PreconditionError for this rank or one outside).
  Peer& peer_at(int rank);

  int rank_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; null for this one
  int wake_fd_ = -1;                          // an eventfd that ends a poll
  std::mutex m_;
  std::condition_variable cv_;  // an operation finished, or the poller stopped
  bool polling_ = false;        // a thread polls the connections
  std::uint64_t done_ = 0;      // operations done (for the waiters of others)
  bool closed_ = false;
  std::vector<std::weak_ptr<Op>> pending_;  // for abort_pending
  std::vector<Bytes> spare_;                // (kept for reuse)
};

}  // namespace distopt::gloo_detail
