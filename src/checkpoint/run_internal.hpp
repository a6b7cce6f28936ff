// What run.cpp and survival.cpp share (not installed): the pieces of a
// rank file, the run state a manifest keeps, a gossip run's per-rank
// numbers.
#pragma once

#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/run_state.hpp"

namespace distopt::checkpoint::detail {

// Every rank's LocalState numbers, gathered (collective): [steps, numbers...] per rank.
std::vector<RunState::Gossip::Rank> gather_local_numbers(Communicator& comm, const parallel::LocalState& local);
// The state the manifest keeps besides the tensors.
RunState state_of(const RunParts& parts);
// Rank `rank`'s pieces of the strategy's state and of the averages (cut
// like the parameters): a rank file's tensors, less a gossip rank's own.
PieceSet rank_pieces(parallel::Strategy& strategy, int rank, const RunParts& parts);

}  // namespace distopt::checkpoint::detail
