// `distopt bench gossip`: time per iteration of ddp, the gossip
// strategies and diloco on emulated links (docs/gossip.md, "The systems result"): a
// model of `params` parameters in 4 layers whose forward and backward take a
// fixed simulated compute time, at each world size and link bandwidth.
#pragma once

#include <string>
#include <vector>

#include "distopt/comm/communicator.hpp"

namespace distopt::bench {

struct GossipBenchOptions {
  std::string backend = "threads";
  std::vector<int> worlds{4, 8, 16};  // threads backend; MPI takes the job's size
  std::vector<std::string> strategies{"ddp", "sgp", "osgp", "dpsgd", "adpsgd"};
  std::vector<double> bandwidths{1e8, 1e9, 0};  // bits per second per rank; 0: unshaped
  double latency_s = 0;                         // per message
  std::size_t params = 5'000'000;
  double compute_s = 0.05;  // simulated forward + backward per step
  int steps = 8;            // timed steps, after 2 warm-up steps (diloco: at least sync_every)
  // diloco's (GossipOptions): outer steps every sync_every steps, the
  // model in `fragments` fragments, the pseudo-gradient in outer_dtype.
  int sync_every = 100;
  int fragments = 1;
  int sync_delay = 0;
  std::string outer_dtype = "f32";
  bool json = false;
};

int run_gossip_bench_threads(const GossipBenchOptions& options);
// Every rank of `comm` calls it (MPI); rank 0 prints.
int run_gossip_bench(Communicator& comm, const GossipBenchOptions& options);

}  // namespace distopt::bench
