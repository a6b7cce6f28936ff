// The MPI backend for the tool: environment, world and raw MPI collectives.
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "backends.hpp"
#include "distopt/comm/mpi.hpp"
#include "distopt/core/error.hpp"

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

// MPI_Init and MPI_Finalize wait for every process of the job, with no
// limit of their own: one that stopped answering (SIGSTOP, a hang) before
// the start or after the run's last collective would keep them waiting for
// ever. A Watchdog ends this process past `limit` (the communicator's
// time-out), saying which wait it gave up; mpirun then ends the job.
class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds limit, std::string message)
      : thread_([this, limit, message = std::move(message)] {
          std::unique_lock lock(m_);
          if (cv_.wait_for(lock, limit, [&] { return done_; })) return;
          std::fprintf(stderr, "distopt: error %s\n", message.c_str());
          std::fflush(stderr);
          std::_Exit(2);
        }) {}
  ~Watchdog() { disarm(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void disarm() {
    {
      std::lock_guard lock(m_);
      done_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: it uses the members above
};

std::string init_message(std::chrono::milliseconds limit) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return str("(rank ", rank ? rank : "?", "): MPI_Init did not end within ", static_cast<double>(limit.count()) / 1000.0,
             " s: another process of the job did not start (stopped or hung before MPI_Init)");
}

class World final : public MpiWorld {
 public:
  explicit World(std::chrono::milliseconds timeout)
      : init_(timeout, init_message(timeout)), env_(nullptr, nullptr), comm_(make_mpi_world()) {
    init_.disarm();
    comm_->set_timeout(timeout);
  }
  ~World() override {
    const std::chrono::milliseconds limit = comm_->timeout();
    Watchdog finalize(limit, str("(rank ", comm_->rank(), "): MPI_Finalize did not end within ",
                                 static_cast<double>(limit.count()) / 1000.0,
                                 " s: another process of the job stopped answering after the run's end"));
    comm_.reset();
    MPI_Finalize();  // env_ sees it finalized
  }
  Communicator& comm() override { return *comm_; }
  bench::RawCollectives& raw() override { return raw_; }
  [[noreturn]] void abort(int code) override { MpiEnvironment::abort(code); }

 private:
  Watchdog init_;
  MpiEnvironment env_;
  std::unique_ptr<Communicator> comm_;
  MpiRaw raw_;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<MpiWorld> open_mpi_world(std::chrono::milliseconds timeout) {
  if (!launched_by_mpirun())
    throw InvalidInput("--backend mpi needs to be started by mpirun, e.g. mpirun -np 4 distopt ... --backend mpi");
  return std::make_unique<World>(timeout);
}

}  // namespace distopt::cli
