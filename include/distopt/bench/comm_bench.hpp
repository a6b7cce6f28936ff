// `distopt bench comm`: nccl-tests-style tables for all_reduce,
// reduce_scatter, all_gather and broadcast (docs/performance.md).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt::bench {

enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast };

// The backend's own primitive, timed in the same run for comparison
// (MPI_Allreduce and friends). Buffers hold `count` floats per the
// collective's convention (see comm_bench.cpp).
class RawCollectives {
 public:
  virtual ~RawCollectives() = default;
  virtual std::string name() const = 0;
  virtual void run(Collective c, const float* send, float* recv, std::size_t count) = 0;
};

struct CommBenchOptions {
  std::string backend = "threads";
  int world = 2;                  // threads backend
  std::size_t min_bytes = 4 << 10;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::vector<std::string> collectives;  // empty: all four
  int rounds = 5;  // rounds of (ours, peer, ours in place) per size; medians reported
  bool json = false;
};

// Threads backend: runs its own world of options.world ranks.
int run_comm_bench_threads(const CommBenchOptions& options);
// Any communicator every rank passes in (MPI): rank 0 prints.
int run_comm_bench(Communicator& comm, RawCollectives* raw, const CommBenchOptions& options);

}  // namespace distopt::bench
