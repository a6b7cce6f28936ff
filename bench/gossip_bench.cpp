// Per configuration (strategy, world, bandwidth), every rank runs warm-up
// and timed steps of a synthetic model: forward acquires each of 4 units
// and sleeps a quarter of a third of compute_s; backward writes each unit's
// gradient and sleeps a quarter of two thirds; then the strategy's step
// (SGD, lr 1e-3). Reported, over the timed steps of rank 0 (medians, but
// comm_s and the bytes are means: adpsgd's rounds run on their own thread
// and may land in the window of the step before or after):
//
//   iter_s_median, iter_s_p90  wall time of a step
//   iter_s_mean                its mean: what a step costs on average where
//                              a few steps communicate (diloco, timed over
//                              at least sync_every steps so that a sync
//                              falls in the window)
//   compute_s                  the simulated forward and backward (sleeps
//                              and gradient writes)
//   wait_s                     time the rank was blocked on communication
//                              (Strategy::exposed_seconds)
//   comm_s                     time the communication needed: on a shaped
//                              link, the rank's bytes of the step over the
//                              bandwidth plus one latency per message;
//                              unshaped, the time collectives ran
//                              (point-to-point copies are not timed)
#include "distopt/bench/gossip_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/topology.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::bench {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kUnits = 4, kWarmup = 2;

struct Row {
  std::string strategy;
  int world;
  double bandwidth, latency;
  double iter_median, iter_p90, iter_mean, compute, comm, wait;
  double bytes_per_step;
};

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(i, v.size() - 1)];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

parallel::FlatLayout synthetic_layout(std::size_t params) {
  parallel::FlatLayout out;
  const std::size_t per = (params + kUnits - 1) / kUnits;
  for (int u = 0; u < kUnits; ++u) {
    const std::size_t begin = static_cast<std::size_t>(u) * per;
    out.params.push_back({str("layer", u, ".weight"), begin, {static_cast<std::int64_t>(per)}});
    out.units.push_back({str("layer", u), begin, begin + per});
  }
  out.elements = per * kUnits;
  return out;
}

// One configuration on this rank; returns rank 0's row (others: unused).
Row measure(Communicator& comm, const GossipBenchOptions& o, const std::string& strategy, double bandwidth) {
  comm.set_link_model({bandwidth, o.latency_s});
  const parallel::FlatLayout layout = synthetic_layout(o.params);
  std::vector<float> initial(layout.elements, 0.01f);
  parallel::StrategyOptions so;
  so.bucket_elements = std::size_t{1} << 20;  // 4 MiB buckets
  // What the strategy reads, from its registry entry: its default graph
  // (a ring where that graph does not fit the world, as a bipartite one on
  // an odd world) and DiLoCo's outer-step options where they apply.
  const parallel::StrategyInfo& info = parallel::strategy_or_throw(strategy);
  if (!info.topology.empty()) {
    try {
      gossip::Topology(info.topology, comm.size());
    } catch (const InvalidInput&) {
      so.gossip.topology = "ring";
    }
  }
  int steps = o.steps;
  so.gossip.sync_every = o.sync_every;
  so.gossip.fragments = o.fragments;
  so.gossip.sync_delay = o.sync_delay;
  so.gossip.outer_dtype = o.outer_dtype;
  if (info.option_misfit != nullptr && info.option_misfit(info, "sync-every", so.gossip).empty())
    steps = std::max(steps, o.sync_every);
  auto s = parallel::make_strategy(strategy, comm, layout, initial, {"sgd", {{"lr", 1e-3}}}, so);
  const auto fwd = std::chrono::duration<double>(o.compute_s / 3 / kUnits);
  const auto bwd = std::chrono::duration<double>(o.compute_s * 2 / 3 / kUnits);
  const float g0 = 1e-3f * static_cast<float>(comm.rank() + 1);
  std::vector<double> iter, compute, comm_s, wait, bytes;
  // One barrier before the timed steps only: a barrier per step would
  // absorb the communication still queued on the link.
  comm.barrier();
  auto t0 = Clock::now();
  for (int k = 0; k < kWarmup + steps; ++k) {
    if (k == kWarmup) {
      comm.barrier();
      t0 = Clock::now();
    }
    const double exposed0 = s->exposed_seconds(), busy0 = comm.busy_seconds();
    const std::uint64_t bytes0 = s->bytes_sent();  // adpsgd's gossip thread included
    double computing = 0;
    models::UnitAccess& access = s->access();
    for (int u = 0; u < kUnits; ++u) {
      (void)access.acquire(u, models::Pass::forward);
      const auto c0 = Clock::now();
      std::this_thread::sleep_for(fwd);
      computing += seconds(Clock::now() - c0);
      access.release(u, models::Pass::forward);
    }
    for (int u = kUnits - 1; u >= 0; --u) {
      (void)access.acquire(u, models::Pass::backward);
      const auto c0 = Clock::now();
      std::span<float> g = access.grads(u);
      std::fill(g.begin(), g.end(), g0);
      std::this_thread::sleep_for(bwd);
      computing += seconds(Clock::now() - c0);
      access.grads_done(u);
      access.release(u, models::Pass::backward);
    }
    s->step();
    const auto t1 = Clock::now();
    const double took = seconds(t1 - t0);
    t0 = t1;
    if (k < kWarmup) continue;
    const double sent = static_cast<double>(s->bytes_sent() - bytes0);
    iter.push_back(took);
    compute.push_back(computing);
    wait.push_back(s->exposed_seconds() - exposed0);
    bytes.push_back(sent);
    comm_s.push_back(bandwidth > 0 ? sent * 8 / bandwidth : comm.busy_seconds() - busy0);
  }
  comm.barrier();
  comm.set_link_model({});
  return {strategy,           comm.size(),           bandwidth,     o.latency_s,           quantile(iter, 0.5),
          quantile(iter, 0.9), mean(iter),            quantile(compute, 0.5), mean(comm_s), quantile(wait, 0.5),
          mean(bytes)};
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

void print(const std::vector<Row>& rows, const GossipBenchOptions& o) {
  if (o.json) {
    std::string out;
    for (const Row& r : rows)
      out += str(out.empty() ? "" : ", ", "{\"strategy\": \"", r.strategy, "\", \"world\": ", r.world,
                 ", \"link_bandwidth_bps\": ", r.bandwidth > 0 ? num(r.bandwidth) : std::string("null"),
                 ", \"link_latency_s\": ", num(r.latency), ", \"iter_s_median\": ", num(r.iter_median),
                 ", \"iter_s_p90\": ", num(r.iter_p90), ", \"iter_s_mean\": ", num(r.iter_mean), ", \"compute_s\": ", num(r.compute), ", \"comm_s\": ",
                 num(r.comm), ", \"wait_s\": ", num(r.wait), ", \"bytes_per_rank_per_step\": ", num(r.bytes_per_step),
                 "}");
    std::printf("{\"params\": %zu, \"compute_s\": %s, \"steps\": %d, \"diloco_steps\": %d, \"results\": [%s]}\n",
                o.params, num(o.compute_s).c_str(), o.steps, std::max(o.steps, o.sync_every), out.c_str());
  } else {
    std::printf("%-7s %5s %10s %10s %10s %10s %10s %10s %10s %14s\n", "strategy", "world", "link", "iter_med",
                "iter_p90", "iter_mean", "compute", "comm", "wait", "bytes/step");
    for (const Row& r : rows)
      std::printf("%-7s %5d %10s %10.4f %10.4f %10.4f %10.4f %10.4f %10.4f %14.0f\n", r.strategy.c_str(), r.world,
                  r.bandwidth > 0 ? (num(r.bandwidth / 1e6) + "M").c_str() : "unshaped", r.iter_median, r.iter_p90,
                  r.iter_mean, r.compute, r.comm, r.wait, r.bytes_per_step);
  }
  std::fflush(stdout);
}

void validate(const GossipBenchOptions& o) {
  if (o.params < 4) throw InvalidInput("--params must be at least 4");
  if (!(o.compute_s >= 0 && std::isfinite(o.compute_s)))
    throw InvalidInput(str("--compute-s must be a non-negative number of seconds (got ", o.compute_s, ")"));
  if (o.steps < 1) throw InvalidInput(str("--steps must be at least 1 (got ", o.steps, ")"));
  for (double b : o.bandwidths)
    if (!(b >= 0 && std::isfinite(b))) throw InvalidInput(str("a bandwidth must be non-negative (got ", b, ")"));
  if (!(o.latency_s >= 0 && std::isfinite(o.latency_s)))
    throw InvalidInput(str("--link-latency must be a non-negative number of seconds (got ", o.latency_s, ")"));
  for (const std::string& s : o.strategies) parallel::require_strategy(s);
  if (o.sync_every < 1) throw InvalidInput(str("--sync-every must be at least 1 (got ", o.sync_every, ")"));
  if (o.sync_delay < 0 || o.sync_delay >= o.sync_every)
    throw InvalidInput(str("--sync-delay must be in [0, --sync-every) (got ", o.sync_delay, ")"));
  if (o.fragments < 1 || o.fragments > kUnits)
    throw InvalidInput(str("--fragments must be in [1, ", kUnits, "] (the bench's model has ", kUnits,
                           " layers; got ", o.fragments, ")"));
}

}  // namespace

int run_gossip_bench_threads(const GossipBenchOptions& o) {
  validate(o);
  std::vector<Row> rows;
  for (double bw : o.bandwidths)
    for (int world : o.worlds)
      for (const std::string& s : o.strategies) {
        std::fprintf(stderr, "bench gossip: %s, world %d, %s\n", s.c_str(), world,
                     bw > 0 ? (num(bw / 1e6) + " Mbit/s").c_str() : "unshaped");
        Row row{};
        spawn(world, [&](Communicator& comm) {
          Row r = measure(comm, o, s, bw);
          if (comm.rank() == 0) row = r;
        });
        rows.push_back(row);
      }
  print(rows, o);
  return 0;
}

int run_gossip_bench(Communicator& comm, const GossipBenchOptions& o) {
  validate(o);
  std::vector<Row> rows;
  for (double bw : o.bandwidths)
    for (const std::string& s : o.strategies) rows.push_back(measure(comm, o, s, bw));
  if (comm.rank() == 0) print(rows, o);
  return 0;
}

}  // namespace distopt::bench
