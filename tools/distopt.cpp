// distopt: train models with distributed optimizers; replay and check
// optimizer trajectories against PyTorch; benchmark the kernels.
//
// Exit status (docs/reliability.md): 0 success; 1 a failed conformance
// check; 2 bad input, with one line on stderr, "distopt: error: ..."; 3 an
// internal error; 4 training diverged; 130/143 stopped by SIGINT/SIGTERM.
#include <cstdio>
#include <exception>
#include <map>
#include <new>
#include <string>

#include "backends.hpp"
#include "commands.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/version.hpp"
#include "distopt_git_revision.hpp"

using distopt::cli::printable;

int main(int argc, char** argv) {
  CLI::App app{"distopt: distributed optimizers, torch.optim-compatible", "distopt"};
  app.require_subcommand(1);
  // Every backend and device this build has (a device also needs a GPU at run time).
  std::string backends = "threads";
  if (distopt::cli::mpi_available()) backends += ", mpi";
#ifdef DISTOPT_HAVE_GLOO
  backends += ", gloo";
#endif
  const std::string devices = distopt::cuda_built() ? "cpu, cuda" : "cpu";
  app.set_version_flag("--version", std::string("distopt ") + DISTOPT_VERSION_STRING + " (git " + DISTOPT_GIT_REVISION +
                                       "; backends: " + backends + "; devices: " + devices + ")");
  std::map<CLI::App*, distopt::cli::Runner> runners;
  auto add = [&](distopt::cli::Runner (*fn)(CLI::App&)) {
    auto runner = fn(app);
    runners[app.get_subcommands({}).back()] = std::move(runner);
  };
  add(distopt::cli::add_train);
  add(distopt::cli::add_replay);
  add(distopt::cli::add_bench);
  add(distopt::cli::add_gossip);
  add(distopt::cli::add_checkpoint);
  add(distopt::cli::add_sample);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "distopt: error: %s (see distopt --help)\n", printable(e.what()).c_str());
    return 2;
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const distopt::NonFiniteError& e) {
    std::fprintf(stderr, "distopt: error: %s\n", printable(e.what()).c_str());
    return 4;
  } catch (const distopt::Error& e) {
    std::fprintf(stderr, "distopt: error: %s\n", printable(e.what()).c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "distopt: error: out of memory: the run needs more memory than this machine can give "
                 "(a smaller --batch-size, --hidden, --train-size or --world needs less)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distopt: internal error: %s\n", printable(e.what()).c_str());
    return 3;
  }
  return 0;
}
