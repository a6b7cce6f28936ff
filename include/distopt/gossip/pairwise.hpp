// AD-PSGD's pairwise averaging (Lian et al. 2018), run by a communication
// thread beside the owner's computation (docs/gossip.md, "adpsgd").
//
// Rounds follow a matching: in round r every rank that has a partner,
// pairwise_partner(rank, world, r), takes a snapshot s of its vector x,
// exchanges it with the partner and adds half the difference,
//
//     x <- x + (s_partner - s) / 2,
//
// which is x <- (x + x_partner) / 2 when x did not change meanwhile. In the
// delta form whatever the owner added to x while the snapshots travelled
// (a gradient step) is kept whole, and the sum of all ranks' vectors is
// exactly what the owners added to it, up to float rounding: no average is
// lost or counted twice. A round waits only for the partner's message, so
// pairs progress independently; there is no global barrier.
//
// The thread runs the rounds the owner has allowed (one per local step,
// allow()), so every rank must allow the same rounds; the owner waits for
// rounds only where it chooses to (wait_for(), bounded staleness).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt::gossip {

// The partner of `rank` in round `round`, or -1 when it rests. Even worlds:
// the bipartite exponential graph's distance d of that round (odd: 1, -1,
// 3, -3, 5, ..., 1 + 2^i), odd ranks pairing with rank + d and even ranks
// with rank - d, so every round is a perfect matching between odd and even
// ranks. Odd worlds: a different rank rests each round (rank 2r mod n in
// round r) and the others pair as an even world of n - 1 in rotated order.
// Consensus per round, computed for n up to 16: exact after 1, 2, 3, 5
// rounds for n = 2, 4, 8, 16; otherwise geometric at a rate of 0.5 for
// n = 3, 5, 6, 7 and 0.55-0.71 for n = 9 to 15.
// A world of one rank never pairs.
int pairwise_partner(int rank, int world, std::uint64_t round);

class AsyncPairwise {
 public:
  static constexpr int kTag = 0x6056;
  // `comm` is used by the gossip thread alone from here on (give it a
  // communicator of its own, e.g. comm.split(0, comm.rank())). `x` is the
  // vector averaged in place; the owner changes it only while holding
  // `x_mutex`, which the thread takes to read a snapshot and to add the
  // partner's half. Both must outlive the AsyncPairwise. Rounds are
  // numbered from `first_round` on (a run resumed after that many steps):
  // the rounds before it count as allowed and completed.
  AsyncPairwise(Communicator& comm, std::span<float> x, std::mutex& x_mutex, int tag = kTag,
                std::uint64_t first_round = 0);
  // On a normal exit: finish(), errors swallowed. While an exception
  // unwinds the owner (a failure elsewhere, when the partner may never
  // answer): the thread stops at its next poll without waiting for the
  // rounds allowed, cancelling its receive; a send buffer still in use is
  // left allocated. Either way no thread is left running.
  ~AsyncPairwise();
  AsyncPairwise(const AsyncPairwise&) = delete;
  AsyncPairwise& operator=(const AsyncPairwise&) = delete;

  // Allows rounds 0 .. rounds - 1 (never fewer than before).
  void allow(std::uint64_t rounds);
  // Blocks until `rounds` rounds have completed (at most those allowed);
  // rethrows the thread's failure (a partner that did not answer within the
  // communicator's timeout: CommTimeout naming it).
  void wait_for(std::uint64_t rounds);
  // Waits for every round allowed and ends the thread; rethrows its failure.
  void finish();
  std::uint64_t allowed() const;
  std::uint64_t completed() const;
  // Bytes this rank's gossip thread has sent.
  std::uint64_t bytes_sent() const { return comm_.bytes_sent(); }

 private:
  void run();
  void exchange(int partner, std::uint64_t round);
  // Polls `r` until done; false when told to stop first. Throws CommTimeout
  // after the communicator's timeout.
  bool await(Request& r, int partner, std::uint64_t round, const char* what);

  Communicator& comm_;
  std::span<float> x_;
  std::mutex& x_mutex_;
  int tag_;
  int unwinding_at_start_;
  std::vector<float> snapshot_, received_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::uint64_t allowed_ = 0, completed_ = 0;
  bool finishing_ = false;
  std::atomic<bool> abandon_{false};
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace distopt::gossip
