// The strategies on one model and world, one after another in rounds, so
// that a noisy machine slows all of them alike; medians over rounds.
//
//   step_s           wall time of a training step (forward, backward, the
//                    strategy's step), every rank finished
//   bytes_per_rank   what this rank's communicator sent per step (the
//                    backends count it where data moves)
//   theory_bytes     the ZeRO paper's volume per rank: 2Ψ for ddp, zero1
//                    and zero2 (reduce-scatter + all-gather), 3Ψ for zero3
//                    (all-gather twice + reduce-scatter), each × (n-1)/n
//                    for n ranks, Ψ = parameters × bytes per element; with
//                    --grad-compression the gradients' share (ddp's all-reduce,
//                    zero1-3's reduce-scatter) at 2 bytes an element (bf16,
//                    fp16) or 1 + 4/256 (int8: a code each, a scale per 256);
//                    powersgd (rank 1, from the first step): two all-reduces
//                    of the factors and the tensors it sends whole;
//                    onebit (1-bit Adam after one step): the moment's signs
//                    and a scale per 1024 to the owners and back (no zero3)
//   hidden_fraction  1 - (time the rank thread waited for communication)
//                    / (time the collectives ran)
//   peak_bytes       params + grads + master + optimizer state at the peak
//   param_hash       XXH3-64 of the parameters after the two warm-up steps
//                    (same initial values and data for every strategy):
//                    equal across strategies, as the equivalence promises
//                    (int8: zero1-3 alike, ddp its own, which packs its
//                    sums a second time)
#include "distopt/bench/strategies_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"

namespace distopt::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string strategy, compression, backend, model;
  int world;
  std::size_t params;
  double step_s, bytes_per_rank, theory_bytes, hidden_fraction;
  std::size_t peak_bytes;
  std::string param_hash;
};

struct Sample {
  double step_s, bytes, hidden;
  std::size_t peak;
  std::string hash;
};

std::vector<std::size_t> hidden_of(const std::string& model) {
  if (model == "mlp") return {256, 128};
  if (model == "wide") return std::vector<std::size_t>(8, 1664);
  throw InvalidInput(str("unknown benchmark model '", model, "' (known: mlp, wide)"));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// What PowerSGD all-reduces per step at rank r: each matrix it compresses
// as (rows + cols) r factors (torch's rule: worth it when rows cols > 2
// (rows + cols) r), every other tensor whole.
double powersgd_elements(const models::Model& model, int r) {
  double out = 0;
  for (const auto& p : model.params()) {
    const double n = double(p.numel());
    if (p.shape.size() < 2 || n == 0) {
      out += n;
      continue;
    }
    const double rows = double(p.shape[0]), cols = n / rows, rank = std::min({rows, cols, double(r)});
    out += rows * cols > 2 * (rows + cols) * rank ? (rows + cols) * rank : n;
  }
  return out;
}

// One strategy's timed steps on this rank. Collective: every rank calls it.
Sample measure(Communicator& comm, const std::string& strategy, const std::string& compression,
               const std::string& model_name, const StrategiesBenchOptions& o) {
  auto model = models::make_model("mlp", 784, 10, hidden_of(model_name));
  const parallel::FlatLayout layout = parallel::flat_layout(*model);
  std::vector<float> init(layout.elements);
  model->init(init, 1);
  parallel::StrategyOptions so;
  so.bucket_elements = std::max<std::size_t>(1, static_cast<std::size_t>(o.bucket_cap_mb * 1048576.0 / 4));
  so.grad_compression = *parallel::parse_grad_compression(compression);
  so.powersgd_warmup = 0;  // PowerSGD from the first step (its rank: the default)
  so.onebit_warmup = 1;    // 1-bit Adam frozen after the first (untimed) step
  auto s = parallel::make_strategy(strategy, comm, layout, init, {"adam", {{"lr", 1e-4}}}, so);
  const Piece piece = piece_of(o.batch_size, comm.size(), comm.rank());
  std::vector<float> x(piece.count * 784), y(piece.count);
  Rng rng(7, static_cast<std::uint64_t>(comm.rank()));
  for (auto& v : x) v = static_cast<float>(rng.uniform(0, 1));
  for (auto& v : y) v = static_cast<float>(rng.below(10));
  const float scale = 1.0f / static_cast<float>(o.batch_size);
  auto one_step = [&] {
    model->forward_backward(s->access(), x.data(), y.data(), piece.count, scale);
    s->step();
  };
  one_step();  // allocates the optimizer state
  comm.barrier();
  const auto w0 = Clock::now();
  one_step();
  comm.barrier();  // also waits for the last step's pending gathers
  const double warm_s = std::chrono::duration<double>(Clock::now() - w0).count();
  const std::string hash = train::hash_params(s->gather_params());
  // Enough steps for about a third of a second, the same on every rank.
  std::int64_t steps = o.steps;
  if (steps == 0) {
    steps = std::clamp<std::int64_t>(static_cast<std::int64_t>(0.3 / std::max(warm_s, 1e-6)), 3, 300);
    comm.broadcast(&steps, 1, ElemType::i64, 0);
  }
  const std::uint64_t bytes0 = comm.bytes_sent();
  const double busy0 = comm.busy_seconds(), exposed0 = s->exposed_seconds();
  const auto t0 = Clock::now();
  for (std::int64_t k = 0; k < steps; ++k) one_step();
  comm.barrier();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const double busy = comm.busy_seconds() - busy0, exposed = s->exposed_seconds() - exposed0;
  const auto m = s->memory();
  return {seconds / double(steps), double(comm.bytes_sent() - bytes0) / double(steps),
          busy > 0 ? std::clamp(1.0 - exposed / busy, 0.0, 1.0) : 1.0,
          m.params + m.grads + m.master_params + m.optimizer_state, hash};
}

std::vector<Row> run_world(Communicator& comm, const StrategiesBenchOptions& o) {
  const DenormalMode flush(DenormalMode::flush);  // as training runs
  std::vector<Row> rows;
  const auto n = static_cast<double>(comm.size());
  for (const auto& model_name : o.models) {
    const auto model = models::make_model("mlp", 784, 10, hidden_of(model_name));
    std::size_t psi = 0;
    for (const auto& p : model->params()) psi += p.numel();
    // Every (strategy, compression), in rounds.
    std::vector<std::pair<std::string, std::string>> runs;
    for (const auto& c : o.compressions)
      for (const auto& s : o.strategies)
        if (c != "onebit" || !parallel::strategy_or_throw(s).sharded_params)  // 1-bit Adam: not zero3
          runs.emplace_back(s, c);
    std::vector<std::vector<Sample>> samples(runs.size());
    for (int round = 0; round < o.rounds; ++round)
      for (std::size_t k = 0; k < runs.size(); ++k) {
        samples[k].push_back(measure(comm, runs[k].first, runs[k].second, model_name, o));
        if (comm.rank() == 0)
          std::fprintf(stderr, "bench strategies: %s %s (%s) world %d round %d/%d: %.4f s/step\n", model_name.c_str(),
                       runs[k].first.c_str(), runs[k].second.c_str(), comm.size(), round + 1, o.rounds,
                       samples[k].back().step_s);
      }
    for (std::size_t k = 0; k < runs.size(); ++k) {
      std::vector<double> t, b, h;
      for (const Sample& s : samples[k]) t.push_back(s.step_s), b.push_back(s.bytes), h.push_back(s.hidden);
      const parallel::StrategyInfo& info = parallel::strategy_or_throw(runs[k].first);
      // The gradients' share of the volume (ddp: all of it) at the wire's bytes.
      const double grad_psi = info.replicated_params ? info.volume_psi : 1.0;
      const double wire = runs[k].second == "none" ? 4.0 : runs[k].second == "int8" ? 1.0 + 4.0 / 256 : 2.0;
      double volume = (grad_psi * wire + (info.volume_psi - grad_psi) * 4.0) * double(psi) * (n - 1) / n;
      if (runs[k].second == "onebit")  // signs and a scale per 1024 to the owners and back, every strategy
        volume = (2 * (1.0 / 8 + 4.0 / 1024) + (info.volume_psi - grad_psi) * 4.0) * double(psi) * (n - 1) / n;
      if (runs[k].second == "powersgd")  // two all-reduces of the factors and the whole tensors, every strategy
        volume = (2 * powersgd_elements(*model, parallel::StrategyOptions{}.powersgd_rank) * 4.0 +
                  (info.volume_psi - grad_psi) * 4.0 * double(psi)) *
                 (n - 1) / n;
      rows.push_back({runs[k].first, runs[k].second, std::string(comm.backend()), model_name, comm.size(), psi,
                      median(t), median(b), volume, median(h), samples[k].back().peak, samples[k].back().hash});
    }
  }
  return rows;
}

int report(const std::vector<Row>& rows, bool json) {
  FILE* table = json ? stderr : stdout;
  std::fprintf(table, "%-6s %-8s %5s %-5s %-5s %10s %10s %8s %14s %14s %7s %8s %12s  %s\n", "model", "backend", "world",
               "strat", "grads", "params", "step (ms)", "vs ddp", "bytes/rank", "theory", "ratio", "hidden", "peak MiB",
               "param_hash (2 steps)");
  for (const Row& r : rows) {
    double ddp = 0;  // uncompressed ddp's, where it ran
    for (const Row& q : rows)
      if (q.strategy == "ddp" && q.compression == "none" && q.model == r.model && q.world == r.world &&
          q.backend == r.backend)
        ddp = q.step_s;
    std::fprintf(table, "%-6s %-8s %5d %-5s %-5s %10zu %10.2f %8.3f %14.0f %14.0f %7.4f %8.3f %12.1f  %s\n",
                 r.model.c_str(), r.backend.c_str(), r.world, r.strategy.c_str(), r.compression.c_str(), r.params,
                 r.step_s * 1e3, ddp > 0 ? r.step_s / ddp : 0.0, r.bytes_per_rank, r.theory_bytes,
                 r.theory_bytes > 0 ? r.bytes_per_rank / r.theory_bytes : 0.0, r.hidden_fraction,
                 double(r.peak_bytes) / 1048576.0, r.param_hash.c_str());
  }
  if (json) {
    std::string out = "{\"results\": [";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      char b[512];
      std::snprintf(b, sizeof b,
                    "%s{\"strategy\": \"%s\", \"grad_compression\": \"%s\", \"backend\": \"%s\", \"world\": %d, "
                    "\"model\": \"%s\", \"params\": %zu, "
                    "\"step_s\": %.6g, \"bytes_per_rank\": %.0f, \"theory_bytes\": %.0f, \"hidden_fraction\": %.4f, "
                    "\"peak_bytes\": %zu, \"param_hash\": \"%s\"}",
                    i ? ", " : "", r.strategy.c_str(), r.compression.c_str(), r.backend.c_str(), r.world,
                    r.model.c_str(), r.params, r.step_s, r.bytes_per_rank, r.theory_bytes, r.hidden_fraction,
                    r.peak_bytes, r.param_hash.c_str());
      out += b;
    }
    std::printf("%s]}\n", out.c_str());
  }
  std::fflush(stdout);
  // The equivalence, shown: every strategy's parameters after the warm-up
  // steps hash alike per model, world, backend and compression.
  auto family = [](const Row& r) {  // int8: ddp (replicated parameters) packs its sums again
    return r.compression == "int8" && parallel::strategy_or_throw(r.strategy).replicated_params;
  };
  for (const Row& r : rows)
    for (const Row& q : rows)
      if (q.model == r.model && q.world == r.world && q.backend == r.backend && q.compression == r.compression &&
          family(q) == family(r) && q.param_hash != r.param_hash) {
        std::fprintf(stderr, "distopt: error: %s and %s trained different parameters (%s vs %s)\n", r.strategy.c_str(),
                     q.strategy.c_str(), r.param_hash.c_str(), q.param_hash.c_str());
        return 3;
      }
  return 0;
}

void check(const StrategiesBenchOptions& o) {
  if (o.steps < 0 || o.rounds < 1) throw InvalidInput("--steps must be 0 (automatic) or more, --rounds at least 1");
  if (!(o.bucket_cap_mb > 0)) throw InvalidInput("--bucket-cap-mb must be positive");
  for (const auto& m : o.models) (void)hidden_of(m);
  for (const auto& s : o.strategies) parallel::require_strategy(s);
  for (const auto& c : o.compressions)
    if (!parallel::parse_grad_compression(c))
      throw InvalidInput(
          str("--grad-compression: unknown scheme '", c, "' (known: ", parallel::grad_compression_names(), ")"));
}

}  // namespace

int run_strategies_bench_threads(const StrategiesBenchOptions& o) {
  check(o);
  std::vector<Row> rows;
  for (int world : o.worlds) {
    if (o.batch_size < static_cast<std::size_t>(world)) throw InvalidInput("--batch-size is smaller than a world size");
    std::mutex m;
    spawn(world, [&](Communicator& comm) {
      auto r = run_world(comm, o);
      std::lock_guard lock(m);
      if (comm.rank() == 0) rows.insert(rows.end(), r.begin(), r.end());
    });
  }
  return report(rows, o.json);
}

int run_strategies_bench(Communicator& comm, const StrategiesBenchOptions& o) {
  check(o);
  const auto rows = run_world(comm, o);
  return comm.rank() == 0 ? report(rows, o.json) : 0;
}

}  // namespace distopt::bench
