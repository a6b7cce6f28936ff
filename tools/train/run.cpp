// `distopt train`'s run (args.hpp): one path for every backend. A launcher
// gives the ranks their communicators -- threads of this process (spawn),
// or this process as one rank of an MPI job -- and checks the command line
// and the memory against them; everything else is the same: the data, the
// observers, train::train, the outputs (written by the process that holds
// rank 0), errors and exit statuses (docs/formats.md).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "../backends.hpp"
#include "../commands.hpp"
#include "../signals.hpp"
#include "args.hpp"
#include "distopt/comm/gloo.hpp"
#include "distopt/comm/launch_env.hpp"
#include "distopt/comm/tcp_store.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "observers.hpp"

namespace distopt::cli {

namespace {

// How a run's ranks start.
class Launcher {
 public:
  virtual ~Launcher() = default;
  virtual int world() const = 0;
  // Whether this process holds rank 0: it reports, writes the outputs and
  // announces signals.
  virtual bool reports() const = 0;
  // Whether this process holds one rank only (its result is its own, not
  // rank 0's).
  virtual bool one_rank_here() const = 0;
  // The rank this process holds where it holds one (else 0).
  virtual int rank_here() const { return 0; }
  // Before any data is read: the command line against the launch, and the
  // memory the ranks of this process will need.
  virtual void check(const TrainArgs& a) const = 0;
  // Runs fn on every rank this process holds, each with its communicator.
  virtual void run(const std::function<void(Communicator&)>& fn) = 0;
  // After the outputs are written: the ranks finish together.
  virtual void finish() {}
  // Whether ranks were left running (lost and stalled, the run went on).
  virtual bool abandoned() const { return false; }
  // DISTOPT_FAULT's stall at the run's end (Fault): stops this
  // process as `kill -STOP` would (MPI), or the calling rank thread.
  [[noreturn]] virtual void stop_here() {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  // An error on this process, after `cleanup`: the threads rethrow it
  // (distopt's one line, status 2); an MPI rank names itself and ends the
  // whole job. Called from a catch block.
  [[noreturn]] virtual void fail(const std::exception& e, const std::function<void()>& cleanup) = 0;
};

class ThreadsLauncher final : public Launcher {
 public:
  ThreadsLauncher(int world, std::chrono::milliseconds timeout, LinkModel link, Elastic elastic)
      : world_(world), timeout_(timeout), link_(link), elastic_(elastic) {
    if (world < 1) throw InvalidInput(str("--world must be at least 1 (got ", world, ")"));
  }
  int world() const override { return world_; }
  bool reports() const override { return true; }
  bool one_rank_here() const override { return world_ == 1; }
  void check(const TrainArgs& a) const override {
    check_memory(a, world_);
    if (a.config.batch_size < static_cast<std::size_t>(world_))
      throw InvalidInput(str("batch size ", a.config.batch_size, " is smaller than the world size ", world_,
                             ": every rank needs at least one sample per step"));
  }
  void run(const std::function<void(Communicator&)>& fn) override {
    const SpawnResult r = spawn(
        world_,
        [&](Communicator& comm) {
          comm.set_link_model(link_);
          fn(comm);
        },
        timeout_, elastic_);
    abandoned_ = !r.abandoned.empty();
  }
  // Lost ranks left running (stalled): the process must end without unwinding.
  bool abandoned() const override { return abandoned_; }
  [[noreturn]] void fail(const std::exception&, const std::function<void()>& cleanup) override {
    cleanup();
    throw;
  }

 private:
  int world_;
  std::chrono::milliseconds timeout_;
  LinkModel link_;
  Elastic elastic_;
  bool abandoned_ = false;
};

class MpiLauncher final : public Launcher {
 public:
  MpiLauncher(std::chrono::milliseconds timeout, LinkModel link) : world_(open_mpi_world(timeout)) {
    world_->comm().set_link_model(link);
  }
  int world() const override { return world_->comm().size(); }
  bool reports() const override { return world_->comm().rank() == 0; }
  bool one_rank_here() const override { return true; }
  int rank_here() const override { return world_->comm().rank(); }
  void check(const TrainArgs& a) const override {
    if (a.world_given && a.world != world())
      throw InvalidInput(str("--world ", a.world, " disagrees with the ", world(),
                             " processes mpirun started (under --backend mpi the world is mpirun's -np)"));
    check_memory(a, 1);
  }
  void run(const std::function<void(Communicator&)>& fn) override { fn(world_->comm()); }
  void finish() override { world_->comm().barrier(); }
  [[noreturn]] void stop_here() override {
    std::raise(SIGSTOP);
    Launcher::stop_here();  // continued: still silent
  }
  [[noreturn]] void fail(const std::exception& e, const std::function<void()>& cleanup) override {
    std::fprintf(stderr, "distopt: error (rank %d): %s\n", world_->comm().rank(), printable(e.what()).c_str());
    std::fflush(stderr);
    cleanup();  // MPI_Abort skips destructors
    world_->abort(2);
    std::_Exit(2);  // not reached: abort ends the job
  }

 private:
  std::unique_ptr<MpiWorld> world_;
};

#ifdef DISTOPT_HAVE_GLOO
// A run's configuration as processes that join it must match it: without
// what is each process's own (its rank, outputs, progress, time-out).
std::string comparable(const std::string& config) {
  static const char* const kOwn[] = {"rank",    "rendezvous", "gloo-host",    "join",         "world",
                                     "backend", "metrics",    "export-params", "export-averaged", "progress",
                                     "json",    "config",     "print-config", "comm-timeout", "resume"};
  nlohmann::json j = nlohmann::json::parse(config);
  for (const char* k : kOwn) j.erase(k);
  return j.dump();
}

// One process of a gloo run: this process holds one rank; the others were
// started by the user (or a script) with the same --world and --rendezvous.
class GlooLauncher final : public Launcher {
 public:
  GlooLauncher(const TrainArgs& a, std::chrono::milliseconds timeout, LinkModel link, Elastic elastic) {
    GlooOptions o;
    o.rendezvous = a.join.empty() ? a.rendezvous : a.join;
    o.rank = a.join.empty() ? a.rank : 0;
    o.size = a.join.empty() ? a.world : 1;
    o.host = a.gloo_host;
    o.timeout = timeout;
    o.elastic = elastic;
    o.join = !a.join.empty();
    joining_ = o.join;
    if (o.join) check_join(a);
    world_ = open_gloo_world(o);
    world_->comm().set_link_model(link);
    if (world_->first_rank() == 0) world_->publish("config", comparable(a.config.checkpoint_run));
  }
  int world() const override { return world_->comm().size(); }
  bool reports() const override { return world_->first_rank() == 0; }
  bool one_rank_here() const override { return true; }
  int rank_here() const override { return world_->first_rank(); }
  void check(const TrainArgs& a) const override { check_memory(a, 1); }
  void run(const std::function<void(Communicator&)>& fn) override { fn(world_->comm()); }
  void finish() override { world_->finish(); }
  [[noreturn]] void stop_here() override {
    std::raise(SIGSTOP);
    Launcher::stop_here();  // continued: still silent
  }
  bool joined() const { return joining_; }
  [[noreturn]] void fail(const std::exception& e, const std::function<void()>& cleanup) override {
    std::fprintf(stderr, "distopt: error (rank %d): %s\n", world_->first_rank(), printable(e.what()).c_str());
    std::fflush(stderr);
    cleanup();
    std::_Exit(2);  // the others see this process's connections close
  }

 private:
  // Before asking to join: the run's configuration (its rank 0 publishes
  // it) against this process's, one differing flag named.
  static void check_join(const TrainArgs& a) {
    const std::string text = published_in(a.join, "config");
    if (text.empty()) throw InvalidInput(str("--join ", a.join, ": no run has published its configuration there"));
    const nlohmann::json run = nlohmann::json::parse(text, nullptr, false);
    const nlohmann::json mine = nlohmann::json::parse(comparable(a.config.checkpoint_run));
    if (run.is_discarded() || !run.is_object())
      throw InvalidInput(str("--join ", a.join, ": the run's published configuration is malformed"));
    for (const auto& [key, value] : run.items())
      if (!mine.contains(key) || mine[key] != value)
        throw InvalidInput(str("--join ", a.join, ": the run has --", key, " ", value.dump(), ", this process ",
                               mine.contains(key) ? str("--", key, " ", mine[key].dump()) : std::string("the default")));
    for (const auto& [key, value] : mine.items())
      if (!run.contains(key))
        throw InvalidInput(str("--join ", a.join, ": this process has --", key, " ", value.dump(), ", the run the default"));
  }
  std::unique_ptr<GlooWorld> world_;
  bool joining_ = false;
};
#endif

// The gloo backend's flags, together or not at all.
void check_gloo_flags(TrainArgs& a) {
  if (!a.join.empty()) {
    if (a.backend_given && a.backend != "gloo") throw InvalidInput("--join is for --backend gloo");
    if (a.rank_given || !a.rendezvous.empty() || a.world_given)
      throw InvalidInput("--join RENDEZVOUS takes no --rank, --rendezvous or --world: the run gives them");
    if (a.on_rank_failure != "continue")
      throw InvalidInput("--join: pass --on-rank-failure continue, as the run's processes were started with");
    a.backend = "gloo";
#ifndef DISTOPT_HAVE_GLOO
    throw InvalidInput("this distopt was built without gloo: install libgloo-dev (scripts/install-deps) and rebuild");
#endif
    return;
  }
  if (a.backend != "gloo") {
    if (a.rank_given || !a.rendezvous.empty() || !a.gloo_host.empty())
      throw InvalidInput("--rank, --rendezvous and --gloo-host are for --backend gloo");
    return;
  }
#ifndef DISTOPT_HAVE_GLOO
  throw InvalidInput("this distopt was built without gloo: install libgloo-dev (scripts/install-deps) and rebuild");
#endif
  if (!a.world_given || !a.rank_given || a.rendezvous.empty())
    throw InvalidInput(
        "--backend gloo needs --world N, --rank R (0 .. N-1) and --rendezvous DIR (or tcp://HOST:PORT) on every "
        "process");
  if (a.rank < 0 || a.rank >= a.world)
    throw InvalidInput(str("--rank ", a.rank, " is not a rank of --world ", a.world, " (0 .. ", a.world - 1, ")"));
}

// Started by srun or torchrun (comm/launch_env.hpp) as one of several
// processes: the gloo backend with the launcher's rank and world, and on
// one machine a rendezvous directory of the run's own under $TMPDIR (the
// processes share their parent, the launcher's agent); across machines
// rank 0's TCP store at MASTER_ADDR:MASTER_PORT (srun: the step's first
// node and slurm_port). --world or --rank that disagree are refused.
void take_launch_env(TrainArgs& a) {
  const std::optional<LaunchEnv> env = launch_env();
  if (!env || env->world == 1) return;
  const bool chosen = !a.backend_given;
  if (chosen) {
    a.backend = "gloo";
  } else if (a.backend == "threads") {
    throw InvalidInput(str("--backend threads under ", env->launcher, " (", env->world_var, "=", env->world,
                           "): each process would train its own copy; use --backend gloo (or mpi)"));
  }
  if (a.backend != "gloo") return;
  if (a.world_given && a.world != env->world)
    throw InvalidInput(str("--world ", a.world, " disagrees with ", env->world_var, "=", env->world, " (the processes ",
                           env->launcher, " started)"));
  if (a.rank_given && a.rank != env->rank)
    throw InvalidInput(str("--rank ", a.rank, " disagrees with ", env->rank_var, "=", env->rank));
  a.world = env->world;
  a.rank = env->rank;
  a.world_given = a.rank_given = true;
  if (a.rendezvous.empty() && env->one_machine) {
    const char* tmp = std::getenv("TMPDIR");
    a.rendezvous = str(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/distopt-", env->launcher, "-", env->job, "-",
                       static_cast<long>(getppid()));
  } else if (a.rendezvous.empty()) {
    const std::string across = str("--backend gloo under ", env->launcher, " across ",
                                   env->machines > 1 ? std::to_string(env->machines) + " machines" : "machines");
    if (env->master_addr.empty() || env->master_port == 0)
      throw InvalidInput(
          str(across, " serves its rendezvous at MASTER_ADDR:MASTER_PORT, ",
              env->launcher == "srun" ? "and SLURM_STEP_NODELIST (or MASTER_ADDR) is not set" : "and they are not set",
              ": give --rendezvous tcp://HOST:PORT (or a directory every machine sees)"));
    // torchrun's agent may hold MASTER_PORT for its own store: the next one.
    const int port = env->master_port + (env->agent_store ? 1 : 0);
    if (port > 65535)
      throw InvalidInput(str(across, ": MASTER_PORT=", env->master_port,
                             " is torchrun's store, and there is no port after it; give --rendezvous tcp://HOST:PORT"));
    a.rendezvous = TcpEndpoint{env->master_addr, port}.text();
    if (env->rank == 0)
      std::fprintf(stderr, "distopt: the rendezvous is rank 0's store at %s (docs/cluster.md)\n", a.rendezvous.c_str());
  }
  if (chosen && env->rank == 0)
    std::fprintf(stderr, "distopt: started by %s as %d processes: using --backend gloo\n", env->launcher.c_str(),
                 env->world);
}

// Started by Open MPI's mpirun: the MPI backend, whatever was (not) said.
// Without it every process would train its own copy and exit 0.
std::unique_ptr<Launcher> launch(TrainArgs& a, std::chrono::milliseconds timeout, LinkModel link) {
  if (const char* launched = std::getenv("OMPI_COMM_WORLD_SIZE"); launched != nullptr) {
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!a.backend_given) {
      a.backend = "mpi";
      if (rank != nullptr && std::string(rank) == "0")
        std::fprintf(stderr, "distopt: started by mpirun with %s processes: using --backend mpi\n", launched);
    } else if (a.backend == "threads" && std::atoi(launched) > 1) {
      throw InvalidInput(str("--backend threads under mpirun (", launched,
                             " processes): each process would train its own copy; use --backend mpi, or run "
                             "without mpirun"));
    }
  }
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr && a.join.empty()) take_launch_env(a);
  check_gloo_flags(a);
  if (a.backend == "mpi" && a.on_rank_failure == "continue")
    throw InvalidInput("--on-rank-failure continue: the mpi backend (Open MPI) ends the job when a process is lost; "
                       "the threads and gloo backends go on");
  if (a.backend == "mpi") return std::make_unique<MpiLauncher>(timeout, link);
#ifdef DISTOPT_HAVE_GLOO
  if (a.backend == "gloo")
    return std::make_unique<GlooLauncher>(a, timeout, link,
                                          a.on_rank_failure == "continue" ? Elastic::on : Elastic::off);
#endif
  return std::make_unique<ThreadsLauncher>(a.world, timeout, link,
                                           a.on_rank_failure == "continue" ? Elastic::on : Elastic::off);
}

}  // namespace

int run_train(TrainArgs& a) {
  prepare(a);
  const std::chrono::milliseconds timeout = a.comm_timeout.empty()
                                                ? Communicator::default_timeout()
                                                : Communicator::parse_timeout(a.comm_timeout, "--comm-timeout");
  LinkModel link;
  link.bandwidth_bps = parse_bandwidth("--link-bandwidth", a.link_bandwidth);
  link.latency_s = a.link_latency;
  if (!(link.latency_s >= 0 && std::isfinite(link.latency_s)))
    throw InvalidInput(str("--link-latency must be a non-negative number of seconds (got ", a.link_latency, ")"));
  const bool tty = ::isatty(2) != 0;
  const bool bar = a.progress == "bar" || (a.progress == "auto" && tty);
  const bool lines = a.progress == "lines" || (a.progress == "auto" && !tty);

  const Fault fault = fault_from_env();
  if (a.backend == "mpi" || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr)
    if (const char* rank = std::getenv("OMPI_COMM_WORLD_RANK"); rank && fault.stalls(std::atoi(rank), Fault::At::init))
      std::raise(SIGSTOP);  // before MPI_Init: as `kill -STOP` of a process that has not started yet
  const std::unique_ptr<Launcher> launcher = launch(a, timeout, link);
  const StopOnSignal stop(launcher->reports());
  a.config.stop_flag = &stop.flag();
  a.config.process_per_rank = a.backend != "threads";
  a.config.joining = !a.join.empty();
  // Survivors of a process world: whichever process holds rank 0 at the end
  // reports, so each keeps its metrics until then.
  const bool any_may_report = a.backend == "gloo" && a.on_rank_failure == "continue";
  // Only rank 0 exports them; the summary needs only their hash.
  a.config.keep_params = a.export_path.empty() && a.export_averaged.empty() ? train::TrainConfig::KeepParams::none
                                                                             : train::TrainConfig::KeepParams::rank0;
  std::optional<MetricsFile> metrics;
  train::TrainResult result;  // this process's: rank 0's where it holds every rank
  try {
    launcher->check(a);
    a.runtime_rss = resident_bytes();
    const data::Split data = load_data(a);
    a.data_bytes = data.bytes();
    a.ranks_here = launcher->one_rank_here() ? 1 : launcher->world();
    warmup_cosine(a, data);
    Progress progress(bar, lines);
    if ((launcher->reports() || any_may_report) && !a.metrics.empty()) metrics.emplace(a.metrics);
    // Where rank 0 may change, every process records its metrics (a
    // promoted rank 0's file holds the whole run); progress is rank 0's.
    train::BothObservers both(&progress, metrics && !any_may_report ? &*metrics : nullptr);
    if (any_may_report && metrics) a.config.every_rank_observer = &*metrics;
    const std::function<void(Communicator&)> each_rank = [&](Communicator& comm) {
      if (a.backend != "mpi" && fault.stalls(comm.rank(), Fault::At::init)) launcher->stop_here();
      train::TrainResult r = train::train(comm, data, a.config, &both);
      // A rank thread has no MPI_Finalize of its own: both points are here.
      if (fault.stalls(comm.rank(), Fault::At::end) ||
          (a.backend == "threads" && fault.stalls(comm.rank(), Fault::At::finalize)))
        launcher->stop_here();
      if (r.rank_at_end == 0 || launcher->one_rank_here()) result = std::move(r);
    };
    try {
      launcher->run(each_rank);
    } catch (const RanksAbandoned& e) {
      // Here, where the data and the observers a stuck rank may still use
      // are alive: the process ends without unwinding.
      exit_abandoned(e, [&] {
        if (metrics) metrics->discard();
      });
    }
    if (any_may_report ? result.rank_at_end == 0 : launcher->reports()) {
      if (metrics) metrics->finish();
      // Those of lost processes of this run.
      if (metrics && !result.membership.empty()) remove_stale_temp_files(a.metrics, "a lost rank of this run");
      export_params(result, a);
      print_result(result, a, launcher->world());
      report_stop(result);
    } else if (metrics) {
      metrics->discard();
    }
    launcher->finish();
    if (launcher->abandoned()) {
      // A lost rank's thread may still use what unwinding would free.
      std::fflush(stdout);
      std::_Exit(result.interrupted ? StopOnSignal::exit_code(result.stop_signal) : 0);
    }
    if (a.backend != "threads" && fault.stalls(launcher->rank_here(), Fault::At::finalize))
      launcher->stop_here();
  } catch (const NonFiniteError& e) {
    // Every rank stopped at the same step with the same finding: one line,
    // the metrics up to that step kept, status 4: the line distopt.cpp
    // prints for it. (Where rank 0 may have changed, the one that holds it.)
    if (any_may_report ? e.rank() == 0 : launcher->reports()) {
      if (metrics) metrics->finish();
      if (metrics && any_may_report) remove_stale_temp_files(a.metrics, "a lost rank of this run");
      std::fprintf(stderr, "distopt: error: %s\n", printable(e.what()).c_str());
    }
    return 4;
  } catch (const std::exception& e) {
    launcher->fail(e, [&] { metrics.reset(); });
  }
  return result.interrupted ? StopOnSignal::exit_code(result.stop_signal) : 0;
}

}  // namespace distopt::cli
