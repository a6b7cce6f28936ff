// The distributed backends the tool was built with. The MPI backend is an
// optional CMake target: backend_mpi.cpp or backend_none.cpp is compiled in.
#pragma once

#include <chrono>
#include <memory>

#include "distopt/bench/comm_bench.hpp"
#include "distopt/comm/communicator.hpp"

namespace distopt::cli {

// An initialized MPI world for this process; owns MPI_Init/MPI_Finalize.
class MpiWorld {
 public:
  virtual ~MpiWorld() = default;
  virtual Communicator& comm() = 0;
  // MPI's own collectives on the same processes, for `bench comm`.
  virtual bench::RawCollectives& raw() = 0;
  // Ends every rank of the job after an unrecoverable error on this one.
  [[noreturn]] virtual void abort(int code) = 0;
};

bool mpi_available();
// Throws InvalidInput when the tool was built without MPI or when the
// process was not started by mpirun. `timeout` bounds every wait of the
// world's communicator and MPI_Init's and MPI_Finalize's waits for the
// job's other processes: past it the process names the wait in one line and
// ends with status 2.
std::unique_ptr<MpiWorld> open_mpi_world(std::chrono::milliseconds timeout = Communicator::default_timeout());

}  // namespace distopt::cli
