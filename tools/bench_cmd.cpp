// distopt bench optim [--json] [--rules a,b] [--cases 16M,1000x16K] [--threads 1,2]
// distopt bench comm [--backend threads|mpi|gloo] [--world N] [--rank R --rendezvous DIR] [--json] [--collectives ...]
// distopt bench strategies [--backend threads|mpi] [--worlds 2,4] [--models mlp,wide] [--grad-compression
// none,bf16,int8]
//                          [--json]
// distopt bench gossip [--backend threads|mpi] [--worlds 4,8,16] [--bandwidths 100M,1G,none] [--json]
// distopt bench memory --cap 1G [--world 4] [--strategies ddp,zero1,zero2,zero3] [--dim 256] [--json]
#include <cstdio>
#include <memory>
#include <string>

#include "backends.hpp"
#include "commands.hpp"
#include "distopt/bench/comm_bench.hpp"
#include "distopt/bench/gossip_bench.hpp"
#include "distopt/bench/optim_bench.hpp"
#include "distopt/bench/strategies_bench.hpp"
#include "distopt/core/error.hpp"
#ifdef DISTOPT_HAVE_GLOO
#include "distopt/comm/gloo.hpp"
#endif

namespace distopt::cli {

namespace {

struct GlooBench {
  int rank = -1;
  std::string rendezvous;
};

// bench comm on one process of a gloo world; the peer column is the copy
// bandwidth, as under threads (gloo's own collectives are not reachable).
int run_comm_bench_gloo(const bench::CommBenchOptions& c, const GlooBench& g) {
#ifdef DISTOPT_HAVE_GLOO
  if (g.rank < 0 || g.rank >= c.world || g.rendezvous.empty())
    throw InvalidInput("bench comm --backend gloo: give each process --rank (0 .. --world - 1) and --rendezvous");
  GlooOptions options;
  options.rendezvous = g.rendezvous;
  options.rank = g.rank;
  options.size = c.world;
  auto world = open_gloo_world(options);
  const int status = bench::run_comm_bench(world->comm(), nullptr, c);
  world->finish();
  return status;
#else
  (void)c;
  (void)g;
  throw InvalidInput("bench comm --backend gloo: this build has no gloo backend (libgloo-dev)");
#endif
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto o = std::make_shared<bench::OptimBenchOptions>();
  auto c = std::make_shared<bench::CommBenchOptions>();
  auto st = std::make_shared<bench::StrategiesBenchOptions>();
  auto gb = std::make_shared<bench::GossipBenchOptions>();
  auto bandwidths = std::make_shared<std::vector<std::string>>();
  CLI::App* sub = app.add_subcommand("bench", "benchmarks that report ratios measured in the same run");
  sub->require_subcommand(1);

  CLI::App* optim = sub->add_subcommand("optim", "optimizer step throughput against a memory-bandwidth roofline");
  optim
      ->add_option("--rules", o->rules,
                   "rules to measure (default: every fp32 rule; also adamw-bf16, adamw-int8, adamw-int4, "
                   "sgd-momentum-int8, lion-int8)")
      ->delimiter(',');
  optim->add_option("--cases", o->cases, "16M and/or 1000x16K (default: both; on cuda 256M, 100x10M, 1000x256K)")->delimiter(',');
  optim->add_option("--threads", o->threads, "thread counts (default: 1,2)")->delimiter(',')->check(CLI::Range(1, 256));
  optim->add_option("--repeats", o->repeats, "timed steps per measurement; the median is reported")
      ->check(CLI::Range(1, 1000));
  optim->add_flag("--json", o->json, "print {\"results\": [...]} as the last line of stdout");
  optim->add_flag("--placement", o->placement, "also compare buffer placements for the adam kernel");
  optim->add_option("--device", o->device,
                    "cpu (default) or cuda: on the GPU, against a device-to-device copy (cases 256M, 100x10M, 1000x256K)");
  optim->add_option("--dtype", o->dtype, "with --device cuda: the parameters' type, f32 (default), bf16 or f16");

  CLI::App* comm = sub->add_subcommand("comm", "collectives (nccl-tests style) against the backend's raw primitive");
  auto gloo = std::make_shared<GlooBench>();
  comm->add_option("--backend", c->backend,
                   "threads (default), mpi (start with mpirun) or gloo (start --world processes, each with its --rank "
                   "and the same --rendezvous)")
      ->check(CLI::IsMember({"threads", "mpi", "gloo"}));
  comm->add_option("--world", c->world, "ranks of the threads backend, or gloo's processes (default 2)")
      ->check(CLI::Range(1, 64));
  comm->add_option("--rank", gloo->rank, "gloo: this process's rank")->check(CLI::Range(0, 63));
  comm->add_option("--rendezvous", gloo->rendezvous, "gloo: a directory every process sees, or tcp://HOST:PORT");
  comm->add_option("--collectives", c->collectives, "all_reduce, reduce_scatter, all_gather, broadcast")
      ->delimiter(',');
  comm->add_option("--min-bytes", c->min_bytes, "smallest size (default 4096)");
  comm->add_option("--rounds", c->rounds, "timing rounds per size, medians reported (default 5)")
      ->check(CLI::Range(1, 101));
  comm->add_option("--max-bytes", c->max_bytes, "largest size (default 268435456)");
  comm->add_flag("--json", c->json, "print {\"results\": [...]} as the last line of stdout (rank 0)");

  CLI::App* strat = sub->add_subcommand(
      "strategies", "ddp, zero1, zero2, zero3: step time, bytes per rank vs theory, hidden communication, memory");
  strat->add_option("--backend", st->backend, "threads (default) or mpi (start with mpirun)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  strat->add_option("--worlds", st->worlds, "world sizes of the threads backend (default 2,4)")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  strat->add_option("--strategies", st->strategies, "default ddp,zero1,zero2,zero3")->delimiter(',');
  strat->add_option("--models", st->models, "mlp (784-256-128-10) and/or wide (784-8x1664-10, 20.7M parameters)")
      ->delimiter(',');
  strat->add_option("--batch-size", st->batch_size, "global batch size (default 128)")->check(CLI::Range(1, 1 << 20));
  strat->add_option("--steps", st->steps, "timed steps per round (default 0: about 0.3 s worth)")
      ->check(CLI::Range(0, 10000));
  strat->add_option("--rounds", st->rounds, "rounds over the strategies, medians reported (default 3)")
      ->check(CLI::Range(1, 101));
  strat->add_option("--bucket-cap-mb", st->bucket_cap_mb, "gradient bucket size in MiB (default 0.125, as train)");
  strat
      ->add_option("--grad-compression", st->compressions,
                   "gradient compression schemes, each strategy under each (default none; e.g. none,bf16,int8)")
      ->delimiter(',');
  strat->add_flag("--json", st->json, "print {\"results\": [...]} as the last line of stdout (rank 0)");

  CLI::App* gossip = sub->add_subcommand(
      "gossip", "time per iteration of ddp and the gossip strategies on emulated links (docs/gossip.md)");
  gossip->add_option("--backend", gb->backend, "threads (default) or mpi (start with mpirun)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  gossip->add_option("--worlds", gb->worlds, "world sizes of the threads backend (default 4,8,16)")
      ->delimiter(',')->check(CLI::Range(1, 64));
  gossip->add_option("--strategies", gb->strategies, "default ddp,sgp,osgp,dpsgd,adpsgd (diloco too)")->delimiter(',');
  gossip->add_option("--bandwidths", *bandwidths, "link bandwidths per rank, bits/s (default 100M,1G,none)")
      ->delimiter(',');
  gossip->add_option("--link-latency", gb->latency_s, "link latency per message in seconds (default 0)");
  gossip->add_option("--params", gb->params, "model parameters (default 5000000)")->check(non_negative("integer"));
  gossip->add_option("--compute-s", gb->compute_s, "simulated forward + backward seconds per step (default 0.05)");
  gossip->add_option("--steps", gb->steps, "timed steps after 2 warm-up steps (default 8; diloco: at least --sync-every)")
      ->check(CLI::Range(1, 10000));
  gossip->add_option("--sync-every", gb->sync_every, "diloco: steps between syncs (default 100)")
      ->check(CLI::Range(1, 10000));
  gossip->add_option("--fragments", gb->fragments, "diloco: fragments of the model's 4 layers (default 1)");
  gossip->add_option("--sync-delay", gb->sync_delay, "diloco: steps a sync runs behind training (default 0)");
  gossip->add_option("--outer-dtype", gb->outer_dtype, "diloco: f32 (default), bf16, fp8 or int4")
      ->check(CLI::IsMember({"f32", "bf16", "fp8", "int4"}));
  gossip->add_flag("--json", gb->json, "print {\"results\": [...]} as the last line of stdout (rank 0)");

  Runner memory;
  add_bench_memory(*sub, memory);

  return [o, c, st, gb, bandwidths, optim, strat, gossip, memory, comm, gloo] {
    if (optim->parsed()) return bench::run_optim_bench(*o);
    if (const int status = memory(); status >= 0) return status;
    if (gossip->parsed() && !bandwidths->empty()) {
      gb->bandwidths.clear();
      for (const std::string& b : *bandwidths) gb->bandwidths.push_back(parse_bandwidth("--bandwidths", b));
    }
    if (comm->parsed() && c->backend == "gloo") return run_comm_bench_gloo(*c, *gloo);
    const bool mpi = gossip->parsed() ? gb->backend == "mpi" : strat->parsed() ? st->backend == "mpi" : c->backend == "mpi";
    if (!mpi) {
      if (gossip->parsed()) return bench::run_gossip_bench_threads(*gb);
      return strat->parsed() ? bench::run_strategies_bench_threads(*st) : bench::run_comm_bench_threads(*c);
    }
    auto world = open_mpi_world();
    try {
      if (gossip->parsed()) return bench::run_gossip_bench(world->comm(), *gb);
      if (strat->parsed()) return bench::run_strategies_bench(world->comm(), *st);
      return bench::run_comm_bench(world->comm(), &world->raw(), *c);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "distopt: error (rank %d): %s\n", world->comm().rank(), e.what());
      std::fflush(stderr);
      world->abort(2);
    }
    return 2;  // not reached: abort ends the job
  };
}

}  // namespace distopt::cli
