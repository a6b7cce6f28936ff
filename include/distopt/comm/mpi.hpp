// The MPI backend (Open MPI from Debian): one rank per process, launched by
// `mpirun -np N`. Collectives are built from point-to-point messages so that
// (a) the reduction order is distopt's own (reduce_ordered, ranks 0..n-1),
// bitwise identical to the threads backend, and (b) every wait can expire
// and name the peers that did not deliver. Broadcast and barrier use MPI's
// non-blocking collectives, polled against the deadline.
#pragma once

#include <memory>

#include "distopt/comm/communicator.hpp"

namespace distopt {

// Initializes MPI with MPI_THREAD_MULTIPLE (non-blocking collectives run on
// a progress thread; asynchronous gossip needs it) and finalizes it on
// destruction. One per process; throws CommError if MPI cannot provide
// MPI_THREAD_MULTIPLE.
class MpiEnvironment {
 public:
  MpiEnvironment(int* argc, char*** argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
  // Ends every process of the job with `code` (after an unrecoverable error
  // on one rank, so that the others do not wait for their time-out).
  [[noreturn]] static void abort(int code);
};

// A communicator over MPI_COMM_WORLD (duplicated). Needs a live MpiEnvironment.
std::unique_ptr<Communicator> make_mpi_world();

// True when this process was started by Open MPI's mpirun/mpiexec.
bool launched_by_mpirun();

}  // namespace distopt
