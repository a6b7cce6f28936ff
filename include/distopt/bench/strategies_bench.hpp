// `distopt bench strategies`: ddp, zero1, zero2 and zero3 on the same
// model and world, measured in the same run (docs/performance.md): step
// time, bytes sent per rank per step beside the theoretical volume, the
// fraction of communication hidden behind compute, and peak memory.
#pragma once

#include <string>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt::bench {

struct StrategiesBenchOptions {
  std::string backend = "threads";
  std::vector<int> worlds{2, 4};                 // threads backend; MPI takes the job's size
  std::vector<std::string> strategies{"ddp", "zero1", "zero2", "zero3"};
  std::vector<std::string> models{"mlp", "wide"};  // wide: 784-8x1664-10, 20.7M parameters in 9 units
  std::vector<std::string> compressions{"none"};   // --grad-compression schemes, each strategy under each
  std::size_t batch_size = 128;                  // global
  int steps = 0;                                 // timed steps per round; 0: about 0.3 s worth
  int rounds = 3;                                // rounds over the strategies; medians reported
  double bucket_cap_mb = 0.125;  // as distopt train
  bool json = false;
};

int run_strategies_bench_threads(const StrategiesBenchOptions& options);
// Every rank of `comm` calls it (MPI); rank 0 prints.
int run_strategies_bench(Communicator& comm, const StrategiesBenchOptions& options);

}  // namespace distopt::bench
