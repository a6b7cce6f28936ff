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
std::vector<std::unique_ptr<Communicator>> make_threads_world(int n);

// Runs fn(comm) for every rank of a new n-rank world, each on its own thread,
// and returns when all have ended. When a rank throws, the others are woken
// from any wait with CommAborted (never a hang); the first failure that is
// not such a consequence is rethrown here.
void spawn(int n, const std::function<void(Communicator&)>& fn,
           std::chrono::milliseconds timeout = Communicator::kDefaultTimeout);

}  // namespace distopt
