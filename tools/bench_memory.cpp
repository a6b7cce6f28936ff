// distopt bench memory --cap 1G [--world 4] [--strategies ddp,zero1,zero2,zero3] [--dim 256] [--json]
//
// The ZeRO paper's headline measured: under one cap on the resident memory
// of a `distopt train` process (all ranks of the threads backend
// together), the largest gpt (layers at a width) each strategy trains a
// few steps with Adam. Each trial is a child `distopt train` watched by
// this process: it is killed as soon as its resident memory passes the
// cap, and it fits when it finishes with its peak (the kernel's ru_maxrss
// of the child) at most the cap. docs/performance.md, "Memory".
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "distopt/parallel/strategy.hpp"

extern char** environ;

namespace distopt::cli {

namespace {

struct MemoryBenchOptions {
  std::string cap;
  int world = 4;
  std::vector<std::string> strategies{"ddp", "zero1", "zero2", "zero3"};
  std::size_t dim = 256, heads = 4, context = 64;
  int steps = 2;
  std::size_t max_layers = 4096;
  std::string train_args;  // more `distopt train` flags, split at spaces
  bool json = false;
};

std::string mb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f MiB", bytes / (1024.0 * 1024.0));
  return b;
}

// One child `distopt train`, watched.
struct Trial {
  std::size_t layers = 0;
  bool fits = false;
  bool over = false;  // killed at the cap, or finished above it
  std::uint64_t peak = 0;
  double seconds = 0;
  nlohmann::json summary;  // the child's --json summary where it finished
  std::string error;       // its last stderr line where it failed otherwise
};

std::string self_exe() {
  std::vector<char> b(4096);
  const ssize_t n = ::readlink("/proc/self/exe", b.data(), b.size() - 1);
  if (n <= 0) throw IoError("bench memory: cannot find its own executable (/proc/self/exe) to run distopt train");
  return {b.data(), static_cast<std::size_t>(n)};
}

class TrialRunner {
 public:
  explicit TrialRunner(const MemoryBenchOptions& o) : o_(o), exe_(self_exe()) {
    std::istringstream extra(o.train_args);
    for (std::string w; extra >> w;) extra_.push_back(w);
  }

  // `cap` 0: unwatched (how much a model that cannot fit would need).
  Trial run(const std::string& strategy, std::size_t layers, std::uint64_t cap) const {
    const int batch = o_.world;  // one window per rank
    std::vector<std::string> args{exe_, "train", "--model", "gpt", "--layers", std::to_string(layers),
                                  "--dim", std::to_string(o_.dim), "--heads", std::to_string(o_.heads),
                                  "--context", std::to_string(o_.context), "--world", std::to_string(o_.world),
                                  "--strategy", strategy, "--optimizer", "adam", "--batch-size",
                                  std::to_string(batch), "--max-steps", std::to_string(o_.steps),
                                  "--test-size", std::to_string(batch), "--activation-checkpointing",
                                  "--progress", "none", "--json"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw IoError(str("bench memory: pipe: ", std::strerror(errno)));
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_adddup2(&actions, err[1], 2);
    pid_t pid = 0;
    const auto start = std::chrono::steady_clock::now();
    const int rc = ::posix_spawn(&pid, exe_.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(err[1]);
    if (rc != 0) {
      ::close(out[0]);
      ::close(err[0]);
      throw IoError(str("bench memory: cannot start ", exe_, ": ", std::strerror(rc)));
    }
    Trial t;
    t.layers = layers;
    std::string text[2];
    pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
    int open = 2;
    while (open > 0) {
      // Resident memory is read every 5 ms: a run is stopped at the cap,
      // not after the machine has run out.
      if (::poll(fds, 2, 5) < 0 && errno != EINTR) break;
      for (int i = 0; i < 2; ++i) {
        if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        char b[4096];
        const ssize_t n = ::read(fds[i].fd, b, sizeof b);
        if (n > 0) {
          text[i].append(b, static_cast<std::size_t>(n));
        } else if (n == 0 || errno != EINTR) {
          ::close(fds[i].fd);
          fds[i].fd = -1;
          --open;
        }
      }
      if (cap > 0 && !t.over && resident_bytes(pid) > cap) {
        t.over = true;
        ::kill(pid, SIGKILL);
      }
    }
    int status = 0;
    rusage usage{};
    while (::wait4(pid, &status, 0, &usage) < 0 && errno == EINTR) {
    }
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    t.peak = static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
    if (cap > 0 && t.peak > cap) t.over = true;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (ok) {
      const auto nl = text[0].find_last_of('\n', text[0].size() >= 2 ? text[0].size() - 2 : 0);
      const std::string last = text[0].substr(nl == std::string::npos ? 0 : nl + 1);
      t.summary = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
      if (!t.summary.is_object()) t.error = "no JSON summary in its output";
    } else if (!t.over) {
      std::string e = text[1];
      while (!e.empty() && e.back() == '\n') e.pop_back();
      const auto nl = e.find_last_of('\n');
      t.error = e.empty() ? str("ended with status ", status) : e.substr(nl == std::string::npos ? 0 : nl + 1);
    }
    t.fits = ok && !t.over && t.error.empty();
    return t;
  }

 private:
  const MemoryBenchOptions& o_;
  std::string exe_;
  std::vector<std::string> extra_;
};

InvalidInput child_failed(const std::string& strategy, std::size_t layers, const Trial& t) {
  std::string e = t.error;
  const std::string prefix = "distopt: error: ";
  if (e.rfind(prefix, 0) == 0) e.erase(0, prefix.size());
  return InvalidInput(str("bench memory: distopt train (", strategy, ", ", layers, " layers) failed: ", e));
}

// The largest number of layers that fits: two small runs give the peak's
// growth per layer, each next trial after a fit is aimed from the smallest
// and the largest that fit (the peak grows linearly in layers), and after
// a trial over the cap the interval between the largest fit and the
// smallest over is halved.
struct Search {
  std::string strategy;
  std::optional<Trial> best;
  std::size_t smallest_over = 0;  // 0: none found
  std::vector<Trial> trials;
};

Search search(const TrialRunner& runner, const MemoryBenchOptions& o, std::uint64_t cap, const std::string& strategy,
              const Trial& one_layer) {
  Search s{strategy, {}, 0, {}};
  std::size_t lo = 0, hi = o.max_layers + 1;  // lo fits (0: none yet), hi does not
  std::vector<Trial> fits;
  std::size_t next = 1;
  while (hi - lo > 1) {
    Trial t = next == 1 ? one_layer : runner.run(strategy, next, cap);
    std::fprintf(stderr, "bench memory: %s %zu layers: %s, peak %s, %.1f s\n", strategy.c_str(), next,
                 t.fits ? "fits" : t.over ? "over the cap" : "failed", mb(double(t.peak)).c_str(), t.seconds);
    if (!t.fits && !t.over) throw child_failed(strategy, next, t);
    s.trials.push_back(t);
    if (t.fits) {
      lo = next;
      fits.push_back(t);
      s.best = t;
    } else {
      hi = next;
      s.smallest_over = next;
    }
    if (lo == 0 || hi - lo <= 1) break;
    if (fits.size() < 2) {
      next = std::min(lo + 1, hi - 1);
      continue;
    }
    // After a trial over the cap, or where the peaks do not grow (two fits
    // a layer apart can measure the same peak: the aim would be the
    // largest model), halve the interval: a few trials, not one per layer.
    const Trial& a = fits.front();
    const Trial& b = fits.back();
    if (!t.fits || b.peak <= a.peak) {
      next = lo + (hi - lo) / 2;
      continue;
    }
    // Aim from the widest pair of fits (the least noisy slope).
    const double per_layer = (double(b.peak) - double(a.peak)) / (double(b.layers) - double(a.layers));
    const double room = double(cap) - double(b.peak);
    auto aim = static_cast<std::size_t>(double(b.layers) + std::floor(room / per_layer));
    next = std::clamp(aim, lo + 1, hi - 1);
  }
  return s;
}

int run_memory_bench(const MemoryBenchOptions& o) {
  const std::uint64_t cap = parse_size("--cap", o.cap);
  if (o.heads == 0 || o.dim % o.heads != 0)
    throw InvalidInput(str("--heads ", o.heads, " must divide --dim ", o.dim));
  for (const std::string& s : o.strategies) parallel::require_strategy(s);
  const TrialRunner runner(o);
  // The smallest model first, under every strategy, before any progress
  // is printed: a cap too small for it is one line saying what it needs
  // (measured without the cap).
  std::vector<Trial> one_layer;
  for (const std::string& s : o.strategies) {
    one_layer.push_back(runner.run(s, 1, cap));
    if (one_layer.back().fits) continue;
    const Trial need = one_layer.back().over ? runner.run(s, 1, 0) : one_layer.back();
    if (!need.fits) throw child_failed(s, 1, need);
    throw InvalidInput(str("--cap ", o.cap, ": not even a 1-layer gpt of width ", o.dim, " fits under ", s,
                           " at world ", o.world, " (its peak is ", mb(double(need.peak)),
                           "); give a cap of at least that, or a smaller --dim"));
  }
  std::fprintf(stderr,
               "bench memory: the largest gpt (width %zu, context %zu, Adam, %d steps, world %d, activation "
               "checkpointing) under a cap of %s on the process's resident memory\n",
               o.dim, o.context, o.steps, o.world, mb(double(cap)).c_str());
  std::vector<Search> results;
  for (std::size_t i = 0; i < o.strategies.size(); ++i)
    results.push_back(search(runner, o, cap, o.strategies[i], one_layer[i]));
  auto params_of = [](const Trial& t) { return t.summary.value("/gpt/parameters"_json_pointer, 0.0); };
  double ddp_params = 0;
  for (const Search& r : results)
    if (r.strategy == "ddp") ddp_params = params_of(*r.best);

  std::printf("%-7s %7s %12s %10s %10s %10s %10s %8s %10s %12s %8s\n", "", "layers", "parameters", "peak RSS", "params",
              "grads", "opt.state", "B/param", "act.+ws", "tokens/s", "vs ddp");
  nlohmann::json out = nlohmann::json::array();
  for (const Search& r : results) {
    const Trial& t = *r.best;
    const nlohmann::json& m = t.summary["memory_per_rank"];
    auto all = [&](const char* k) { return m.value(k, 0.0) * o.world; };  // every rank of the process
    const double params = params_of(t), tokens = t.summary.value("tokens_per_s", 0.0);
    const double vs = ddp_params > 0 ? params / ddp_params : 0;
    char ratio[32] = "-";  // without ddp in the run
    if (vs > 0) std::snprintf(ratio, sizeof ratio, "%.2fx", vs);
    // Optimizer state bytes per parameter over every rank (Adam: 8 in fp32; --state-dtype int8 about 2).
    const double state_per_param = params > 0 ? all("optimizer_state") / params : 0;
    std::printf("%-7s %7zu %12.0f %10s %10s %10s %10s %8.2f %10s %12.0f %8s\n", r.strategy.c_str(), t.layers, params,
                mb(double(t.peak)).c_str(), mb(all("params") + all("master_params")).c_str(), mb(all("grads")).c_str(),
                mb(all("optimizer_state")).c_str(), state_per_param, mb(all("activations") + all("workspaces")).c_str(),
                tokens, ratio);
    out.push_back({{"strategy", r.strategy},
                   {"layers", t.layers},
                   {"dim", o.dim},
                   {"parameters", params},
                   {"peak_rss", t.peak},
                   {"first_over", r.smallest_over},
                   {"memory",
                    {{"params", all("params") + all("master_params")},
                     {"grads", all("grads")},
                     {"optimizer_state", all("optimizer_state")},
                     {"activations", all("activations")},
                     {"workspaces", all("workspaces")}}},
                   {"state_bytes_per_param", state_per_param},
                   {"tokens_per_s", tokens},
                   {"vs_ddp", vs},
                   {"trials", r.trials.size()}});
  }
  std::printf("(memory columns: every rank of the process together, as distopt train reports them; the cap, %s, "
              "bounds the peak RSS)\n",
              mb(double(cap)).c_str());
  for (const Search& r : results)
    if (r.strategy != "ddp" && ddp_params > 0)
      std::printf("%s trains %.2fx ddp's largest model under the cap\n", r.strategy.c_str(), params_of(*r.best) / ddp_params);
  if (o.json)
    std::printf("%s\n", nlohmann::json{{"cap", cap}, {"world", o.world}, {"results", out}}.dump().c_str());
  return 0;
}

}  // namespace

void add_bench_memory(CLI::App& bench, Runner& run) {
  auto o = std::make_shared<MemoryBenchOptions>();
  CLI::App* m = bench.add_subcommand(
      "memory", "the largest gpt each strategy trains under a cap on resident memory (ZeRO's headline)");
  m->add_option("--cap", o->cap, "the cap on the peak resident memory of the training process, e.g. 1G, 1536M")
      ->required()
      ->check(non_empty());
  m->add_option("--world", o->world, "ranks of the threads backend (default 4)")->check(CLI::Range(1, 64));
  m->add_option("--strategies", o->strategies, "default ddp,zero1,zero2,zero3")->delimiter(',');
  m->add_option("--dim", o->dim, "gpt width (default 256); layers are searched")->check(CLI::Range(8, 65536));
  m->add_option("--heads", o->heads, "attention heads (default 4)")->check(CLI::Range(1, 1024));
  m->add_option("--context", o->context, "tokens a sample reads (default 64)")->check(CLI::Range(1, 65536));
  m->add_option("--steps", o->steps, "training steps per trial (default 2)")->check(CLI::Range(1, 1000));
  m->add_option("--max-layers", o->max_layers, "the largest model tried (default 4096 layers)")
      ->check(CLI::Range(1, 1 << 20));
  m->add_option("--train-args", o->train_args,
                "more distopt train flags for every trial, e.g. \"--prefetch-units 0 --max-buckets-in-flight 1\"");
  m->add_flag("--json", o->json, "print {\"cap\": ..., \"results\": [...]} as the last line of stdout");
  run = [o, m]() -> int { return m->parsed() ? run_memory_bench(*o) : -1; };
}

}  // namespace distopt::cli
