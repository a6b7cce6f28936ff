// The threads backend (the default): the ranks of a world are threads of
// one process sharing memory. Collectives post buffer pointers and read
// each other's memory directly, so data is copied only where the result
// needs it (docs/algorithms.md has the steps and bytes moved).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt {

// n communicators, one per rank, sharing one world. Give each to one thread.
std::vector<std::unique_ptr<Communicator>> make_threads_world(int n, Elastic elastic = Elastic::off);

// Runs fn(comm) for every rank of a new n-rank world, each on its own thread,
// and returns when all have ended. When a rank throws, the others are woken
// from any wait with CommAborted (never a hang); the first failure that is
// not such a consequence is rethrown here. `timeout` bounds every wait.
//
// A rank that does not return within kAbandonAfter of the world's abort
// (stuck outside any communicator call, where the abort cannot reach it)
// is abandoned: spawn detaches its thread and throws RanksAbandoned naming
// it after the original failure. Whatever that thread references must then
// outlive it: the process should report and end without unwinding
// (std::_Exit), as distopt's commands do.
//
// Elastic::on: a failing rank's error is not rethrown while another rank
// ends normally (the survivors went on); lost ranks still running when the
// survivors have ended (stalled) are abandoned, and the result says so: the
// process should then end without unwinding, as above.
inline constexpr std::chrono::milliseconds kAbandonAfter{2'000};
struct SpawnResult {
  std::vector<int> abandoned;  // lost ranks left running (Elastic::on)
};
SpawnResult spawn(int n, const std::function<void(Communicator&)>& fn,
                  std::chrono::milliseconds timeout = Communicator::default_timeout(), Elastic elastic = Elastic::off);

}  // namespace distopt
