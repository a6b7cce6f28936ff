// The MPI backend for the tool: environment, world and raw MPI collectives.
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

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

// MPI_Finalize waits for every process of the job; one that stopped
// answering after the run's last collective (SIGSTOP, a hang) would keep it
// waiting for ever. Past `limit` (the communicator's time-out) this process
// says so and ends without finishing; mpirun then ends the job.
void finalize_within(std::chrono::milliseconds limit, int rank) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lock(m);
    if (cv.wait_for(lock, limit, [&] { return done; })) return;
    std::fprintf(stderr,
                 "distopt: error (rank %d): MPI_Finalize did not end within %g s: another process of the job "
                 "stopped answering after the run's end\n",
                 rank, static_cast<double>(limit.count()) / 1000.0);
    std::fflush(stderr);
    std::_Exit(2);
  });
  MPI_Finalize();
  {
    std::lock_guard lock(m);
    done = true;
  }
  cv.notify_one();
  watchdog.join();
}

class World final : public MpiWorld {
 public:
  World() : env_(nullptr, nullptr), comm_(make_mpi_world()) {}
  ~World() override {
    const std::chrono::milliseconds limit = comm_->timeout();
    const int rank = comm_->rank();
    comm_.reset();
    finalize_within(limit, rank);
  }
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
