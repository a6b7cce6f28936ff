// Fault injection, a testing aid (docs/reliability.md, "Testing aid: DISTOPT_FAULT"):
// the one place that reads DISTOPT_FAULT. The training loop (stall, fail,
// kill after a step), checkpoint::save (exit while writing) and the tool's
// launchers (stall at init, end, finalize) ask it where they could fail.
#pragma once

#include <cstddef>
#include <cstdint>

namespace distopt {

// DISTOPT_FAULT, a testing aid of `distopt train` (docs/reliability.md):
// RANK is a rank of the world the run started with (after a change of
// world, the faults of a step do not fire again).
//  * stall:RANK:STEP -- that rank stops answering after that step, as a hung
//    or SIGSTOPped process would (train() sleeps; with process_per_rank the
//    process stops itself with SIGSTOP);
//  * stall:RANK:init -- it stops before it starts (an MPI process before
//    MPI_Init, a rank thread before train()); stall:RANK:end -- after its
//    training returned, before the ranks finish together;
//    stall:RANK:finalize -- after they did, before MPI_Finalize. At these
//    points an MPI process stops itself (SIGSTOP), as `kill -STOP` would;
//    a rank thread sleeps. The tool acts on them, not train();
//  * fail:RANK:STEP -- that rank fails (throws) after that step, as a
//    crashed process would; kill:RANK:STEP -- its process is killed
//    (SIGKILL) after that step (TrainConfig::process_per_rank only);
//  * term:RANK:STEP -- that rank's process gets SIGTERM after that step, as
//    a preempted job's does: the run stops after the next step, writing a
//    checkpoint where it writes them;
//  * exit:RANK:STEP:file|manifest -- the process ends at once (_exit(137),
//    as a kill would) while that rank writes the checkpoint of that step:
//    half of its rank file written, or its file complete and no manifest.
// Any other value throws InvalidInput naming the variable.
struct Fault {
  enum class Kind { none, stall, fail, kill, term, exit };
  enum class At { step, init, end, finalize };
  Kind kind = Kind::none;
  At at = At::step;
  int rank = -1;
  std::size_t step = 0;
  bool in_file = false;  // exit: in the rank file (else before the manifest)
  bool stalls(int r, At where) const { return kind == Kind::stall && rank == r && at == where; }
  // exit: whether rank r ends the process while it writes the checkpoint
  // of `step`, in its rank file (in_file) or before the manifest.
  bool exits_in_checkpoint(int r, std::uint64_t s) const { return kind == Kind::exit && rank == r && step == s; }
};
Fault fault_from_env();

}  // namespace distopt
