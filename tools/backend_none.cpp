// Built when Open MPI was not found at configure time.
#include "backends.hpp"

namespace distopt::cli {

bool mpi_available() { return false; }

std::unique_ptr<MpiWorld> open_mpi_world(std::chrono::milliseconds) {
  throw InvalidInput("this distopt was built without MPI: install libopenmpi-dev (scripts/install-deps) and rebuild");
}

}  // namespace distopt::cli
