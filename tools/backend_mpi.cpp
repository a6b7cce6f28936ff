// The MPI backend for the tool: environment, world and raw MPI collectives.
#include <mpi.h>

#include "backends.hpp"
#include "distopt/comm/mpi.hpp"

namespace distopt::cli {

namespace {

class MpiRaw final : public bench::RawCollectives {
 public:
  std::string name() const override { return "raw MPI busbw"; }
  void run(bench::Collective c, const float* send, float* recv, std::size_t count) override {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const int total = static_cast<int>(count), per = static_cast<int>(count / n);
    switch (c) {
      case bench::Collective::all_reduce:
        MPI_Allreduce(send, recv, total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case bench::Collective::reduce_scatter:
        MPI_Reduce_scatter_block(send, recv, per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case bench::Collective::all_gather:
        MPI_Allgather(send, per, MPI_FLOAT, recv, per, MPI_FLOAT, MPI_COMM_WORLD);
        break;
      case bench::Collective::broadcast:
        MPI_Bcast(recv, total, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    }
  }
};

class World final : public MpiWorld {
 public:
  World() : env_(nullptr, nullptr), comm_(make_mpi_world()) {}
  ~World() override { comm_.reset(); }
  Communicator& comm() override { return *comm_; }
  bench::RawCollectives& raw() override { return raw_; }
  [[noreturn]] void abort(int code) override { MpiEnvironment::abort(code); }

 private:
  MpiEnvironment env_;
  std::unique_ptr<Communicator> comm_;
  MpiRaw raw_;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<MpiWorld> open_mpi_world() {
  if (!launched_by_mpirun())
    throw InvalidInput("--backend mpi needs to be started by mpirun, e.g. mpirun -np 4 distopt ... --backend mpi");
  return std::make_unique<World>();
}

}  // namespace distopt::cli
