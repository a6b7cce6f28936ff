// `distopt train --resume` (args.hpp): the latest complete checkpoint in
// --checkpoint-dir, read and verified by checkpoint::load_latest; the run's
// flags from its manifest where the command line (or --config) did not
// give them; the flags that would make it meaningless refused, the ones
// that change the run reported (docs/formats.md, "Checkpoints").
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "../run_config.hpp"
#include "args.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/core/error.hpp"

namespace distopt::cli {

void load_resume(CLI::App& command, TrainArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  if (a.config.checkpoint_dir.empty()) throw InvalidInput("--resume needs --checkpoint-dir");
  auto loaded = std::make_shared<checkpoint::Loaded>(checkpoint::load_latest(a.config.checkpoint_dir));
  const std::filesystem::path* latest = &loaded->dir;
  const nlohmann::json saved = nlohmann::json::parse(loaded->config);
  const nlohmann::json given = nlohmann::json::parse(effective_config(command));
  // Error feedback belongs to its scheme (int8's residuals would be read
  // as 1-bit Adam's), and 1-bit Adam's variance was frozen where its
  // warm-up ended: another scheme with feedback, or another warm-up, would
  // make the run meaningless. (--grad-compression none drops the feedback
  // with a warning: checkpoint::resume.)
  const auto flag = [&](const char* key) -> const nlohmann::json* {
    const CLI::Option* opt = command.get_option_no_throw(std::string("--") + key);
    return opt != nullptr && opt->count() > 0 && given.contains(key) ? &given[key] : nullptr;
  };
  static const std::set<std::string> kFeedback = {"int8", "powersgd", "onebit"};
  const std::string scheme = saved.value("grad-compression", std::string("none"));
  if (const nlohmann::json* now = flag("grad-compression"); now != nullptr && now->is_string() &&
                                                            kFeedback.count(scheme) &&
                                                            kFeedback.count(now->get<std::string>()) && *now != scheme)
    throw InvalidInput(str("--resume: the checkpoint in ", latest->string(), " holds --grad-compression ", scheme,
                           "'s error feedback; --grad-compression ", now->get<std::string>(),
                           " would read it as its own (resume with ", scheme, ", or none to drop it)"));
  if (const nlohmann::json* now = flag("onebit-warmup");
      now != nullptr && scheme == "onebit" && *now != saved.value("onebit-warmup", nlohmann::json(100)))
    throw InvalidInput(str("--resume: the checkpoint in ", latest->string(), " is of --onebit-warmup ",
                           saved.value("onebit-warmup", nlohmann::json(100)).dump(),
                           ", where 1-bit Adam freezes its variance; --onebit-warmup ", now->dump(),
                           " would make it meaningless"));
  for (const auto& [key, value] : given.items()) {
    const CLI::Option* opt = command.get_option_no_throw("--" + key);
    if (opt == nullptr || opt->count() == 0 || (saved.contains(key) && saved[key] == value)) continue;
    static const std::set<std::string> kMeaning = {"model", "hidden", "data",  "train-size", "test-size", "optimizer",
                                                   "seed",  "layers", "heads", "dim",        "context",   "data-file"};
    const std::string had = saved.contains(key) ? "--" + key + " " + saved[key].dump() : "the default --" + key;
    if (kMeaning.count(key))
      throw InvalidInput(str("--resume: the checkpoint in ", latest->string(), " is of ", had, "; --", key, " ",
                             value.dump(), " would make it meaningless"));
    if (!saved.contains(key)) continue;  // a flag the saved run left at its default: nothing to report against
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr || std::string(rank) == "0")
      std::fprintf(stderr, "distopt: resuming with --%s %s (the checkpoint's run had %s)\n", key.c_str(),
                   value.dump().c_str(), saved[key].dump().c_str());
  }
  // Resumed under another strategy: the saved gossip flags that do not
  // apply to it are left behind (the run starts from the ranks' mean).
  nlohmann::json carried = saved;
  // Checkpoints of gpt runs up to 0.3.0 recorded the default --data
  // (fashion-mnist) for the fortunes they read: gpt's own default again.
  if (saved.value("model", "") == "gpt" && saved.value("data", "") == "fashion-mnist") carried.erase("data");
  // Resumed with another scheme: the saved scheme's own options stay behind.
  if (const nlohmann::json* now = flag("grad-compression"); now != nullptr && *now != scheme)
    for (const char* key : {"powersgd-rank", "powersgd-warmup", "onebit-warmup"}) carried.erase(key);
  const CLI::Option* strategy = command.get_option_no_throw("--strategy");
  if (strategy != nullptr && strategy->count() > 0) {
    parallel::GossipOptions options;
    options.slowmo_base = given.value("slowmo-base", saved.value("slowmo-base", options.slowmo_base));
    options.outer_optimizer = given.value("outer-optimizer", saved.value("outer-optimizer", options.outer_optimizer));
    for (const auto& [key, value] : saved.items())
      if (kGossipFlags.count("--" + key) && !gossip_flag_misfit("--" + key, a.config.strategy, options).empty())
        carried.erase(key);
  }
  apply_config_text(command, carried.dump(), (*latest / "manifest.json").string());
  a.config.resume = std::move(loaded);
  a.resume_load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace distopt::cli
