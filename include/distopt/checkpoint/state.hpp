// The parameters and optimizer state of a ddp or zero1-3 strategy as
// pieces of named tensors (checkpoint/pieces.hpp), and back at any world
// size and strategy: the content of a reshardable checkpoint.
//
// Names follow torch's state_dict: "param.<name>" for a parameter,
// "state.<index>.<key>" for its optimizer state, where <index> is the
// parameter's position in the model (torch's model.parameters() order) and
// <key> the state's torch name (exp_avg, step, master_param, Adafactor's
// exp_avg_sq_row, ...). A state tensor shaped like its parameter is cut
// like the parameter; a scalar (0-d) and a tensor's small state (Adafactor's
// row and column averages, Shampoo's preconditioners) are saved whole by
// every rank that holds elements of the parameter, and assemble checks
// that the copies agree bit for bit.
#pragma once

#include <map>
#include <span>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/source.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::checkpoint {

// This rank's pieces of the parameters and of the optimizer state. The
// ranks' pieces together hold every element once (replicated ddp values
// are cut as zero1-3 cut them). Gossip strategies, whose ranks hold
// different models: the pieces of the ranks' mean (the consensus model
// and optimizer state, what another strategy or world size resumes from)
// and, under local_prefix(rank), this rank's own optimizer state whole
// (collective).
PieceSet strategy_pieces(parallel::Strategy& strategy, int rank);

// "gossip.<rank>.": the names of a gossip rank's own tensors.
std::string local_prefix(int rank);
// A gossip rank's LocalState tensors as whole pieces under its prefix, and
// back (with the numbers the manifest keeps); InvalidInput when the
// checkpoint has none for `rank`.
PieceSet local_pieces(const parallel::LocalState& state, int rank);
parallel::LocalState local_state(const TensorSource& source, int rank, std::uint64_t steps,
                                 std::vector<double> scalars);
// A survivor's own state, without communication (Strategy::survivor_state):
// its model (the tensor "x") whole as the parameters, and under
// local_prefix(rank) its optimizer state, `averaged` (SWA/EMA; none when
// empty) and the LocalState's tensors. Views of `state` and `averaged`.
PieceSet survivor_pieces(parallel::Strategy& strategy, int rank, const parallel::LocalState& state,
                         std::span<const float> averaged);

// Values shaped like the strategy's own_params() (SWA/EMA averages) as
// pieces named PREFIX<param name>, cut like the parameters (gossip: their
// ranks' mean, and this rank's whole under local_prefix(rank) + PREFIX;
// collective), and back, reading the rank's values only (padding zero).
// InvalidInput names a missing or misshapen tensor.
PieceSet own_pieces(parallel::Strategy& strategy, int rank, std::span<const float> own, const std::string& prefix);
std::vector<float> own_values(parallel::Strategy& strategy, int rank, const TensorSource& source,
                              const std::string& prefix);

// Compressed gradients' error feedback (Strategy::feedback; docs/formats.md,
// "Error feedback"): "feedback.<rank>.<param name>", the rank's residual,
// each parameter whole; "feedback.sums.<param name>", ddp's owners' residual
// of their sums, cut like the parameters; "feedback.q.<param name>",
// PowerSGD's warm-start factor (columns x rank), written by rank 0. Views of
// the strategy's buffers.
PieceSet feedback_pieces(parallel::Strategy& strategy, int rank);
// And back into a strategy made for `world` ranks: at the checkpoint's
// world each rank its own residual; at another, rank r the sum of the
// saved ranks r, r + world, r + 2 world, ... in rank order; the sums'
// residual into the strategy's (resharded), or added to rank 0's residual
// where the strategy keeps none. What the ranks owe in total is kept.
// PowerSGD's factors where their rank is this run's. Nothing saved (a run
// without int8 or PowerSGD): zeros. Saved, but the strategy keeps none:
// dropped, and the warning says so (else "").
// InvalidInput names a tensor under "feedback." that is no parameter's
// feedback, or one shaped otherwise than its parameter.
std::string load_feedback(parallel::Strategy& strategy, const TensorSource& source, int rank, int world);

// The whole tensors of the rank files that a manifest of `dir` lists
// (verify it first): each file's pieces, assembled (checkpoint inspection;
// a resume reads PieceFiles a range at a time).
std::map<std::string, Whole> read_wholes(const std::filesystem::path& dir, const Manifest& manifest);

// The unsharded parameters in slot order (make_strategy's `initial`), read
// from `source` range by range as the strategy asks for them (a shard, a
// unit); layout and source must outlive it. InvalidInput names a missing
// parameter, a shape that is not the model's, or a tensor that is none of
// a checkpoint's.
parallel::InitialParams initial_params(const parallel::FlatLayout& layout, const TensorSource& source);

// Loads the optimizer state of `source` into a strategy made from
// initial_params(...), each rank reading its pieces straight into the
// optimizer's state (no other copy): after it, the strategy steps as the
// saved one would have. The groups keep their current options.
// InvalidInput names a missing or misshapen state tensor, and leaves no
// state loaded. `from` prefixes the names: a gossip rank's own state
// (local_prefix(rank)).
void load_optimizer_state(parallel::Strategy& strategy, const TensorSource& source, const std::string& from = "");

}  // namespace distopt::checkpoint
