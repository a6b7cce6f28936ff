// `distopt bench optim`: optimizer step throughput against a memory-bandwidth
// roofline measured in the same run (docs/performance.md).
#pragma once

#include <string>
#include <vector>

namespace distopt::bench {

struct OptimBenchOptions {
  std::vector<std::string> rules;    // empty: sgd-momentum, adam, adamw and the rest
  std::vector<std::string> cases;    // "16M", "1000x16K"
  std::vector<int> threads{1, 2};
  int repeats = 9;                   // timed steps per measurement (median)
  bool json = false;
  bool placement = false;            // also compare buffer placements
  std::string device = "cpu";        // "cuda": on the GPU against a device copy (docs/gpu.md)
  std::string dtype = "f32";         // parameters' type on cuda: f32, bf16, f16
};

int run_optim_bench(const OptimBenchOptions& options);

}  // namespace distopt::bench
