// distopt bench optim [--json] [--rules a,b] [--cases 16M,1000x16K] [--threads 1,2]
#include <memory>

#include "commands.hpp"
#include "distopt/bench/optim_bench.hpp"

namespace distopt::cli {

Runner add_bench(CLI::App& app) {
  auto o = std::make_shared<bench::OptimBenchOptions>();
  CLI::App* sub = app.add_subcommand("bench", "benchmarks that report ratios measured in the same run");
  sub->require_subcommand(1);
  CLI::App* optim = sub->add_subcommand("optim", "optimizer step throughput against a memory-bandwidth roofline");
  optim->add_option("--rules", o->rules, "rules to measure (default: all)")->delimiter(',');
  optim->add_option("--cases", o->cases, "16M and/or 1000x16K (default: both)")->delimiter(',');
  optim->add_option("--threads", o->threads, "thread counts (default: 1,2)")->delimiter(',')->check(CLI::Range(1, 256));
  optim->add_option("--repeats", o->repeats, "timed steps per measurement; the median is reported")
      ->check(CLI::Range(1, 1000));
  optim->add_flag("--json", o->json, "print {\"results\": [...]} as the last line of stdout");
  optim->add_flag("--placement", o->placement, "also compare buffer placements for the adam kernel");
  return [o, optim] { return optim->parsed() ? bench::run_optim_bench(*o) : 2; };
}

}  // namespace distopt::cli
