// distopt replay CASE.json [--json]
// distopt replay --check CASE.json... [--json] [--atol A] [--rtol R]
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "commands.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/replay/replay.hpp"

namespace distopt::cli {

namespace {
struct ReplayArgs {
  std::vector<std::string> files;
  bool check = false;
  bool json = false;
  bool verbose = false;
  int threads = 1;
  std::string device = "cpu";
  replay::Tolerance tol;
};

std::string json_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) continue;
    out += ch;
  }
  return out;
}

int run_replay(const ReplayArgs& a) {
  Device device = Device::cpu;
  if (!parse_device(a.device, &device)) throw InvalidInput(str("--device: '", a.device, "' is not cpu or cuda"));
  require_device(device);
  ThreadPool pool(a.threads);
  if (!a.check) {
    if (a.files.size() != 1) throw InvalidInput("replay takes one case file (use --check for several)");
    const replay::Case c = replay::load_case(a.files[0]);
    const replay::Result r = replay::run(c, &pool, {}, device);
    if (!a.json) std::fprintf(stderr, "%s: %s, %zu steps, %zu parameters\n", c.source.c_str(),
                              c.optimizer.c_str(), c.steps.size(), c.params.size());
    std::printf("%s\n", replay::to_json(r).c_str());
    return 0;
  }
  // --check: every file is judged; a file that cannot be read as a case
  // counts as a failure with its error, and makes the status 2 (bad input)
  // rather than 1 (a mismatch).
  // On the device, a case whose rule has no kernel there is skipped, not failed.
  std::size_t passed = 0, failed = 0, unreadable = 0, skipped = 0;
  std::string failures;
  for (const std::string& f : a.files) {
    std::string verdict;
    bool loaded = false;
    try {
      const replay::Case c = replay::load_case(f);
      loaded = true;
      if (!c.expected) throw InvalidInput(str(f, ": no 'expected' member to check against"));
      if (device == Device::cuda && !rule_runs_on(c.optimizer, device)) {
        ++skipped;
        if (a.verbose)
          std::fprintf(stderr, "SKIP %s: %s\n", f.c_str(), why_rule_cannot_run(c.optimizer, device).c_str());
        continue;
      }
      const replay::Comparison cmp = replay::compare(replay::run(c, &pool, {}, device), *c.expected, a.tol);
      if (cmp.ok()) {
        ++passed;
        if (a.verbose) std::fprintf(stderr, "PASS %s (%zu values, max |diff| %.3g)\n", f.c_str(), cmp.compared,
                                  cmp.max_abs_error);
        continue;
      }
      verdict = str(cmp.mismatches, " of ", cmp.compared, " values differ; first: ", cmp.first_mismatch);
    } catch (const Error& e) {
      verdict = e.what();
      if (!loaded) ++unreadable;
    }
    ++failed;
    std::fprintf(stderr, "FAIL %s: %s\n", f.c_str(), verdict.c_str());
    failures += str(failures.empty() ? "" : ", ", "{\"file\": \"", json_escape(f), "\", \"error\": \"",
                    json_escape(verdict), "\"}");
  }
  if (a.json)
    std::printf("{\"passed\": %zu, \"failed\": %zu, \"unreadable\": %zu, \"skipped\": %zu, \"device\": \"%s\", "
                "\"failures\": [%s]}\n",
                passed, failed, unreadable, skipped, a.device.c_str(), failures.c_str());
  else {
    const std::string skip = skipped > 0 ? str(", ", skipped, " skipped (no CUDA kernel for their rule)") : "";
    if (unreadable > 0)
      std::printf("replay --check: %zu passed, %zu failed (%zu of them unreadable)%s\n", passed, failed, unreadable,
                  skip.c_str());
    else
      std::printf("replay --check: %zu passed, %zu failed%s\n", passed, failed, skip.c_str());
  }
  return unreadable > 0 ? 2 : failed == 0 ? 0 : 1;
}
}  // namespace

Runner add_replay(CLI::App& app) {
  auto args = std::make_shared<ReplayArgs>();
  CLI::App* sub = app.add_subcommand("replay", "replay an optimizer trajectory (distopt-replay/1 case files)");
  sub->add_option("cases", args->files, "case file(s); with --check, directories are searched for *.json")
      ->required();
  sub->add_flag("--check", args->check, "compare each case with its 'expected' member; exit 1 on any mismatch, 2 if a case cannot be read");
  sub->add_flag("-v,--verbose", args->verbose, "with --check, also list the cases that pass");
  sub->add_flag("--json", args->json, "print one JSON object as the last line of stdout");
  sub->add_option("--threads", args->threads, "threads for the optimizer step")->check(CLI::Range(1, 256));
  sub->add_option("--device", args->device,
                  "cpu (default) or cuda: parameters, gradients and state on the GPU (docs/gpu.md)");
  sub->add_option("--atol", args->tol.atol, "absolute tolerance of --check")->check(non_negative("number"));
  sub->add_option("--rtol", args->tol.rtol, "relative tolerance of --check")->check(non_negative("number"));
  return [args] {
    if (args->check) {  // expand directories
      std::vector<std::string> files;
      for (const std::string& f : args->files) {
        if (std::filesystem::is_directory(f)) {
          std::vector<std::string> found;
          for (const auto& e : std::filesystem::directory_iterator(f))
            if (e.path().extension() == ".json") found.push_back(e.path().string());
          std::sort(found.begin(), found.end());
          if (found.empty()) throw InvalidInput(str(f, ": no *.json case files in this directory"));
          files.insert(files.end(), found.begin(), found.end());
        } else {
          files.push_back(f);
        }
      }
      args->files = std::move(files);
    }
    return run_replay(*args);
  };
}

}  // namespace distopt::cli
