// The gloo backend's heartbeat (private to src/comm/gloo; see
// membership.cpp and docs/reliability.md, "Processes"), and Shared, what
// every communicator of a process's world shares, which runs it. Every
// process beats: a counter in its heartbeat file ("hb/<first rank>"), every
// kBeat. A process whose heartbeat is unchanged for kSilent is gone or
// stopped: a re-forming waits no longer for it (GlooComm::reform). With
// each beat, the process looks whether a member left the group to re-form
// it, and then aborts its own waits on the group (Shared::watch_for_leavers).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "store.hpp"

namespace distopt::gloo_detail {

constexpr milliseconds kBeat{100};     // heartbeat period
constexpr milliseconds kSilent{1000};  // a heartbeat unchanged this long: the process is gone or stopped

class LiveBuffers;

// What every communicator of a process's world shares.
struct Shared {
  // `serve`: this process serves the rendezvous's TCP store (rank 0).
  Shared(const std::string& rendezvous, milliseconds timeout, Elastic e, int first, bool serve)
      : store(open_store(rendezvous, timeout, serve)), elastic(e), first(first) {}
  std::unique_ptr<KeyStore> store;
  std::string host;  // the address other processes reach this one at
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
  // (Defined in transport.cpp, with LiveBuffers.)
  void abort_upto(int epoch, const std::string& why, bool group_left = false);

  // A member that re-forms because it lost a peer has closed its
  // connections and marked the group as left ("leaving/<next epoch>",
  // created once): this process's waits on the group can no longer all
  // end, and one on a message whose connection broke in mid-transfer would
  // not end before the time-out (gloo wakes the waits queued on a broken
  // pair, not the one it is reading into). They are aborted, so that this
  // process re-forms too. Run with each heartbeat (one look at the
  // rendezvous); skipped while this process re-forms.
  void watch_for_leavers();

  // The heartbeat.
  std::mutex beat_m;
  std::condition_variable beat_cv;
  bool stop_beating = false;
  std::thread beater;
  void start_beating();
  ~Shared();
};

}  // namespace distopt::gloo_detail
