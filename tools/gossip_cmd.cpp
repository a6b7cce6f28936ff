// distopt gossip-average: push-sum averaging on its own (docs/gossip.md).
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "backends.hpp"
#include "commands.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/push_sum.hpp"

namespace distopt::cli {

namespace {

struct GossipArgs {
  int world = 4;
  std::string backend = "threads", topology = "exponential", comm_timeout;
  int peers_per_iteration = 1;
  std::uint64_t rounds = 10, seed = 0;
  std::size_t dim = 65536;
  bool json = false, world_given = false;
};

void print_report(const GossipArgs& a, const gossip::Topology& t, const gossip::AverageReport& r) {
  if (a.json) {
    std::string errors;
    for (double e : r.errors) errors += (errors.empty() ? "" : ", ") + jnum(e);
    std::printf(
        "{\"max_abs_error\": %s, \"weight_sum_error\": %s, \"rounds\": %llu, \"topology\": \"%s\", "
        "\"peers_per_iteration\": %d, \"world\": %d, \"dim\": %zu, \"seed\": %llu, \"backend\": \"%s\", "
        "\"predicted_rate\": %s, \"bytes_sent_per_rank\": %llu, \"errors\": [%s]}\n",
        jnum(r.max_abs_error).c_str(), jnum(r.weight_sum_error).c_str(), static_cast<unsigned long long>(a.rounds),
        t.name().c_str(), t.peers_per_iteration(), t.world(), a.dim, static_cast<unsigned long long>(a.seed),
        a.backend.c_str(), jnum(t.predicted_rate()).c_str(), static_cast<unsigned long long>(r.bytes_sent),
        errors.c_str());
  } else {
    std::printf("gossip-average: %s, world %d, %llu rounds, dim %zu: max_abs_error %.3g (from %.3g), "
                "weight_sum_error %.3g; the graph's rate is %.4g per round\n",
                t.name().c_str(), t.world(), static_cast<unsigned long long>(a.rounds), a.dim, r.max_abs_error,
                r.errors.front(), r.weight_sum_error, t.predicted_rate());
  }
  std::fflush(stdout);
}

int run_gossip_average(GossipArgs& a) {
  const std::chrono::milliseconds timeout = a.comm_timeout.empty()
                                                ? Communicator::default_timeout()
                                                : Communicator::parse_timeout(a.comm_timeout, "--comm-timeout");
  if (a.dim == 0) throw InvalidInput("--dim must be at least 1");
  if (a.dim > (std::size_t{1} << 28)) throw InvalidInput(str("--dim ", a.dim, " is above 2^28 (1 GiB per rank)"));
  if (a.backend == "mpi") {
    auto world = open_mpi_world();
    Communicator& comm = world->comm();
    comm.set_timeout(timeout);
    try {
      if (a.world_given && a.world != comm.size())
        throw InvalidInput(str("--world ", a.world, " disagrees with the ", comm.size(), " processes mpirun started"));
      const gossip::Topology topology(a.topology, comm.size(), a.peers_per_iteration);
      const gossip::AverageReport r = gossip::average_random_vectors(comm, topology, a.rounds, a.dim, a.seed);
      if (comm.rank() == 0) print_report(a, topology, r);
      comm.barrier();
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "distopt: error (rank %d): %s\n", comm.rank(), printable(e.what()).c_str());
      std::fflush(stderr);
      world->abort(2);
    }
  }
  if (a.world < 1) throw InvalidInput(str("--world must be at least 1 (got ", a.world, ")"));
  const gossip::Topology topology(a.topology, a.world, a.peers_per_iteration);  // bad names fail here
  gossip::AverageReport report;
  try {
    spawn(
        a.world,
        [&](Communicator& comm) {
          gossip::AverageReport r = gossip::average_random_vectors(comm, topology, a.rounds, a.dim, a.seed);
          if (comm.rank() == 0) report = std::move(r);
        },
        timeout);
  } catch (const RanksAbandoned& e) {
    exit_abandoned(e);
  }
  print_report(a, topology, report);
  return 0;
}

}  // namespace

Runner add_gossip(CLI::App& app) {
  auto a = std::make_shared<GossipArgs>();
  CLI::App* sub = app.add_subcommand(
      "gossip-average", "push-sum gossip on random vectors, one per rank: the error against the exact average");
  sub->add_option("--world", a->world, "ranks of the threads backend (default 4)")
      ->each([a](const std::string&) { a->world_given = true; })
      ->check(non_negative("integer"));
  sub->add_option("--backend", a->backend, "threads (default) or mpi (world size from mpirun)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  sub->add_option("--topology", a->topology, "gossip graph (default exponential; docs/gossip.md lists them)");
  sub->add_option("--peers-per-iteration", a->peers_per_iteration, "peers per round of exponential-k (default 1)");
  sub->add_option("--rounds", a->rounds, "push-sum rounds (default 10)")->check(non_negative("integer"));
  sub->add_option("--dim", a->dim, "elements of each rank's vector (default 65536)")->check(non_negative("integer"));
  sub->add_option("--seed", a->seed, "seed of the random vectors (default 0)")->check(non_negative("integer"));
  sub->add_option("--comm-timeout", a->comm_timeout, "seconds to wait for a silent rank (default 300)");
  sub->add_flag("--json", a->json, "print one JSON object as the last line of stdout");
  for (CLI::Option* opt : sub->get_options())
    if (opt->get_expected_min() > 0) opt->check(non_empty());
  return [a] { return run_gossip_average(*a); };
}

}  // namespace distopt::cli
