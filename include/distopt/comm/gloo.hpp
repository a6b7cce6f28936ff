// The gloo backend: one rank per process, processes started by the user
// (or a script) on one machine or several, meeting in a rendezvous
// directory. Data moves over gloo's TCP pairs (Debian's libgloo-dev);
// collectives are built from pairwise messages and summed with
// reduce_ordered, so results are bitwise those of the threads and MPI
// backends. Unlike Open MPI 4.1, a process that dies or stops answering
// does not end the others: in an Elastic::on world they get RankLost and
// re-form the group with Communicator::shrink() (docs/reliability.md,
// "Processes").
//
// The rendezvous directory holds small files: each process's address for
// each membership epoch, a heartbeat per process, and the membership
// decisions. Every process of a run must see the same directory (one
// machine, or a shared file system); give each run a directory of its own.
// Or the rendezvous is "tcp://HOST:PORT": the same keys in a store that
// rank 0's process serves on PORT (comm/tcp_store.hpp), for machines that
// share no directory; losing rank 0's process then loses the store.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt {

struct GlooOptions {
  std::string rendezvous;  // the run's rendezvous directory (created if missing), or tcp://HOST:PORT
  int rank = 0;            // this process's rank, 0 .. size-1
  int size = 1;
  // The address other processes reach this one at: a host name or an IP
  // address of this machine. Empty: this machine's host name.
  std::string host;
  std::chrono::milliseconds timeout = Communicator::default_timeout();
  Elastic elastic = Elastic::off;
  // Join the run going on in `rendezvous` (rank and size are then ignored):
  // wait, up to the time-out, until its ranks admit this process between two
  // of their steps (Communicator::grow); comm() is then the grown group.
  bool join = false;
};

// What a process of a gloo world holds: the rendezvous, its heartbeat, the
// membership; its top communicator. Keep it alive while any communicator
// of the world is.
class GlooWorld {
 public:
  virtual ~GlooWorld() = default;
  // The communicator every process started with (rank = options' rank).
  virtual Communicator& comm() = 0;
  // The ranks (as first numbered) of the current members, in order.
  virtual std::vector<int> members() const = 0;
  // This process's rank as first numbered.
  virtual int first_rank() const = 0;
  // Waits, up to the time-out, until every current member has called it:
  // the run's end, without a communicator (the last one may have been
  // replaced by shrink() inside the trainer). Throws CommTimeout naming
  // the members that did not come.
  virtual void finish() = 0;
  // Small values every process of the run can read (the run's configuration,
  // for processes that join): written whole or not at all.
  virtual void publish(const std::string& key, const std::string& value) = 0;
  // The value, or "" when nothing was published under `key`.
  virtual std::string published(const std::string& key) const = 0;
};

// Connects this process to the others (each calls it with its own rank;
// waits up to the time-out for all), or joins a run (options.join). Throws InvalidInput for bad options
// or a directory an earlier run finished in, CommTimeout naming the ranks
// that did not come.
std::unique_ptr<GlooWorld> open_gloo_world(const GlooOptions& options);

// What a run published under `key` in its rendezvous directory (before
// joining it: its configuration), or "" when nothing is there.
std::string published_in(const std::string& rendezvous, const std::string& key);

}  // namespace distopt
