// `distopt train`'s checks and preparation before any work (args.hpp): the
// optimizer's options, the scheduler, dtypes, gossip flags, the data set
// and model, the outputs (each checked writable, none named twice) and the
// memory the run will need: one line naming the flag, before a launcher
// starts and before anything large is allocated.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "../commands.hpp"
#include "args.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/topology.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/option_text.hpp"
#include "distopt/optim/rule.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/parallel/strategy.hpp"
#include "observers.hpp"

namespace distopt::cli {

const std::set<std::string> kGossipFlags = {
    "--topology",         "--peers-per-iteration",  "--synch-freq",    "--slowmo-base", "--localsgd-frequency",
    "--slowmo-frequency", "--slowmo-momentum",      "--slowmo-lr",     "--sync-every",  "--outer-optimizer",
    "--outer-lr",         "--outer-momentum",       "--fragments",     "--sync-delay",  "--fragment-alpha",
    "--outer-dtype",      "--outer-error-feedback", "--fragment-carry"};

// Why a gossip flag does not apply to strategy `s` (with that slowmo base),
// or "" when it does.
// Each strategy says which gossip flags it reads (StrategyInfo::option_misfit);
// one that reads none names the ones that do.
std::string gossip_flag_misfit(const std::string& flag, const std::string& s, const parallel::GossipOptions& options) {
  const parallel::StrategyInfo* info = parallel::find_strategy(s);
  if (info == nullptr || info->option_misfit == nullptr) {
    std::string readers;
    for (const parallel::StrategyInfo* r : parallel::all_strategies())
      if (r->option_misfit != nullptr) readers += (readers.empty() ? "" : ", ") + std::string(r->name);
    return str(flag, " applies to the gossip strategies (", readers, "), not --strategy ", s);
  }
  return info->option_misfit(*info, std::string_view(flag).substr(2), options);
}

namespace {

// Fails now rather than after a long run.
void check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) throw InvalidInput(str(flag, " needs a file name (got an empty one)"));
  const auto real = std::filesystem::path(output_path(path));
  if (std::filesystem::is_directory(real)) throw InvalidInput(str(flag, " ", path, ": is a folder, not a file"));
  const auto parent = std::filesystem::absolute(real).parent_path();
  if (!std::filesystem::is_directory(parent) || ::access(parent.c_str(), W_OK) != 0)
    throw IoError(str(flag, " ", path, ": cannot create (folder ", parent.string(), " is missing or not writable)"));
}

// Every output checked before work starts, and no two naming one file.
void check_outputs(const TrainArgs& a) {
  const std::pair<const char*, const std::string*> outputs[] = {
      {"--metrics", &a.metrics}, {"--export-params", &a.export_path}, {"--export-averaged", &a.export_averaged}};
  std::map<std::string, const char*> seen;
  for (const auto& [flag, path] : outputs) {
    if (!a.given_outputs.count(flag)) continue;
    check_writable(flag, *path);
    const auto [it, fresh] = seen.emplace(output_path(*path), flag);
    if (!fresh) throw InvalidInput(str(it->second, " and ", flag, " both name ", *path, ": give each its own file"));
  }
  for (const auto& [file, flag] : seen) remove_stale_temp_files(file);
}

// Gossip options with a strategy that does not use them: an error, not a
// silent no-op.
void check_gossip_flags(const TrainArgs& a) {
  const std::string& s = a.config.strategy;
  for (const std::string& flag : a.gossip_flags)
    if (const std::string why = gossip_flag_misfit(flag, s, a.config.parallel.gossip); !why.empty())
      throw InvalidInput(why);
  const std::string& topology = a.config.parallel.gossip.topology;
  const auto names = gossip::topology_names();
  if (!topology.empty() && std::find(names.begin(), names.end(), topology) == names.end())
    (void)gossip::Topology(topology, 1);  // throws, listing the known names
}

// Data sets and models that cannot go together, and --data-file without
// --data text: one line before anything is read.
void check_data_and_model(TrainArgs& a) {
  const bool gpt = a.config.model == "gpt";
  // (gpt's own default, fortunes, is set before the run is recorded: flags.cpp.)
  if (gpt && !is_text(a.data))
    throw InvalidInput(
        str("--model gpt reads text: use --data fortunes or --data text --data-file PATH (not --data ", a.data, ")"));
  if (!gpt && is_text(a.data))
    throw InvalidInput(str("--data ", a.data, " is text: it needs --model gpt (not --model ", a.config.model, ")"));
  if (a.data == "text" && a.data_file.empty()) throw InvalidInput("--data text needs --data-file PATH");
  if (a.data != "text" && !a.data_file.empty()) throw InvalidInput("--data-file goes with --data text");
}

std::string gigabytes(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GB", bytes / 1e9);
  return b;
}

// The live limits apply where something is gathered or bucketed in flight.
void check_live_flags(const TrainArgs& a) {
  const parallel::StrategyInfo& s = parallel::strategy_or_throw(a.config.strategy);
  const parallel::StrategyOptions& o = a.config.parallel;
  for (const std::string& flag : a.live_flags) {
    const bool buckets = flag == "--max-buckets-in-flight";
    if (buckets ? !s.sharded_grads : !s.sharded_params)
      throw InvalidInput(str(flag, " applies to ", buckets ? "zero2 and zero3, which reduce-scatter gradient buckets"
                                                            : "zero3, which gathers parameters",
                             "; strategy ", s.name, buckets ? " keeps whole gradients" : " holds them whole"));
  }
  if (o.max_buckets_in_flight < 1)
    throw InvalidInput(str("--max-buckets-in-flight must be at least 1 (got ", o.max_buckets_in_flight, ")"));
}

}  // namespace

// Outputs are written to NAME.tmp.<pid> and renamed; a run killed by
// SIGKILL (or a second Ctrl-C) leaves that file behind. Before writing
// NAME, remove the ones whose process no longer exists on this machine.
void remove_stale_temp_files(const std::string& output, const char* whose) {
  namespace fs = std::filesystem;
  const fs::path real = output_path(output);
  const std::string prefix = real.filename().string() + ".tmp.";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(real.parent_path().empty() ? "." : real.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    std::error_code rm;
    if (fs::remove(entry.path(), rm))
      std::fprintf(stderr, "distopt: removed %s, left by %s (process %d) that was killed\n",
                   printable(entry.path().string().c_str()).c_str(), whose, static_cast<int>(pid));
  }
}


// Sizes the command line asks for, against this machine's memory, before
// anything is allocated: one line naming the flag instead of bad_alloc.
void check_memory(const TrainArgs& a, int world) {
  const double have = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE));
  if (!(have > 0)) return;
  const DataDims dims = dims_of(a);
  const auto features = static_cast<double>(dims.features);
  // Floats a rank keeps per parameter and the units in flight: the strategy's own memory model.
  const parallel::StrategyInfo& info = parallel::strategy_or_throw(a.config.strategy);
  // int8's and PowerSGD's error feedback: a whole gradient's residual, and
  // int8 ddp's of its sums.
  const double feedback = a.grad_compression == "int8"       ? 1 + (info.replicated_params ? 1.0 / world : 0.0)
                          : a.grad_compression == "powersgd" ? 1
                          : a.grad_compression == "onebit"   ? 2 + 1.0 / world
                                                             : 0.0;
  if (a.config.model == "gpt") {
    // Parameters, gradients and optimizer state on every rank, and the
    // activations each rank keeps for backward (its share of a batch).
    const models::GptShape& g = a.config.gpt;
    const double D = double(g.dim), T = double(g.context), L = double(g.layers);
    const double params = 12 * L * D * D + (256 + T) * D;
    // Per token: each block's activations (17 D + H T floats), or with
    // checkpointing each block's input and one block's activations.
    const double block = 17 * D + double(g.heads) * T;
    const double kept = a.config.activation_checkpointing ? L * D + block : L * block;
    const double per_sample = T * (kept + 256 + 8 * D);
    const double rank_batch = std::ceil(double(a.config.batch_size) / world);
    const parallel::MemoryPerRank states = parallel::memory_per_rank(info, world);
    const double states_floats = params * (states.floats_per_param + feedback) + states.largest_units * 12 * D * D;
    const double bytes = (states_floats + per_sample * rank_batch) * 4 * world;
    if (bytes > have)
      throw InvalidInput(str("model gpt with --layers ", g.layers, " --dim ", g.dim, " --context ", g.context,
                             " and --batch-size ", a.config.batch_size, " needs ", gigabytes(bytes), " at ", world,
                             world == 1 ? " rank" : " ranks", " (this machine has ", gigabytes(have), ")"));
    return;
  }
  if (a.data != "fashion-mnist") {
    const double bytes = (double(a.train_size) + double(a.test_size)) * (features + 1) * 4;
    if (bytes > have / 2)
      throw InvalidInput(str("--train-size ", a.train_size, " and --test-size ", a.test_size, " need ",
                             gigabytes(bytes), " for the synthetic data (this machine has ", gigabytes(have), ")"));
  }
  // Parameters, gradients and up to three state tensors of 4 bytes, on every
  // rank of the process, as the strategy shards them.
  std::vector<double> widths{features};
  if (a.config.model == "mlp")
    for (double h : a.config.hidden.empty() ? std::vector<std::size_t>{256, 128} : a.config.hidden) widths.push_back(h);
  widths.push_back(static_cast<double>(dims.outputs));
  // What is held in flight at once: a layer, or under zero3 one tile of a
  // tiled layer (--tile-rows; the others gather nothing and reduce whole
  // layers).
  double params = 0, largest = 0;
  bool tiles = false;
  const auto tile_rows = info.sharded_params ? static_cast<double>(a.config.tile_rows) : 0.0;
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    const double layer = widths[l] * widths[l + 1] + widths[l + 1];
    params += layer;
    const bool tiled = tile_rows > 0 && widths[l + 1] > tile_rows;
    const double at_once = tiled ? std::max(tile_rows * widths[l], widths[l + 1]) : layer;
    if (at_once > largest) largest = at_once, tiles = tiled;
  }
  const parallel::MemoryPerRank states = parallel::memory_per_rank(info, world);
  const double bytes = (params * (states.floats_per_param + feedback) + largest * states.largest_units) * 4 * world;
  if (largest * 4 > have / 4 || bytes > have)
    throw InvalidInput(str(a.config.hidden.empty() ? "the model" : "--hidden", " needs ", gigabytes(largest * 4),
                           tiles ? " for one tile and " : " for one layer and ", gigabytes(bytes),
                           " for parameters, gradients and optimizer state at ", world, world == 1 ? " rank" : " ranks",
                           " (this machine has ", gigabytes(have), ")"));
}

void prepare(TrainArgs& a) {
  const RuleInfo& rule = rule_or_throw(a.config.optimizer.name);
  a.config.optimizer.options = parse_option_values(rule, a.option_text);
  rule.validate(resolve_options(rule, a.config.optimizer.options));
  parallel::require_exact(a.config.strategy, rule);  // one clear error before any data is read
  if (!rule.companion.empty()) {
    // Muon takes matrices only: the rest (biases) go to adamw with its
    // defaults, as torch's Muon documentation tells users to do.
    a.config.optimizer.fallback = std::string(rule.companion);
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr || std::string(rank) == "0")
      std::fprintf(stderr,
                   "distopt: %s takes the weight matrices; the other parameters (biases) go to a second "
                   "group with %s and its defaults\n",
                   std::string(rule.name).c_str(), std::string(rule.companion).c_str());
  }
  check_gossip_flags(a);
  check_data_and_model(a);
  if (a.config.model == "gpt") (void)models::make_gpt(a.config.gpt);  // --heads not dividing --dim, ...
  if (a.config.threads < 1) throw InvalidInput(str("--threads must be at least 1 (got ", a.config.threads, ")"));
  if (a.config.threads > 1 && a.config.model != "gpt")
    throw InvalidInput(str("--threads applies to --model gpt; model ", a.config.model,
                           " runs on one thread a rank (use --world for more)"));
  if (a.matmul_precision == "bf16") a.config.matmul_precision = models::MatmulPrecision::bf16;
  else if (a.matmul_precision != "f32")
    throw InvalidInput(str("--matmul-precision: unknown precision '", a.matmul_precision, "' (known: f32, bf16)"));
  if (a.config.activation_checkpointing && a.config.model != "gpt")
    throw InvalidInput(str("--activation-checkpointing applies to --model gpt; model ", a.config.model,
                           " keeps each layer's output (one tensor per layer)"));
  if (a.matmul_precision != "f32" && a.config.model != "gpt")
    throw InvalidInput(
        str("--matmul-precision applies to --model gpt; model ", a.config.model, " multiplies in float32"));
  if (a.matmul_precision == "bf16" && !models::bf16_products_available())
    throw InvalidInput(
        "--matmul-precision bf16: oneDNN has no bfloat16 products on this CPU (it needs AVX512); use f32");
  if (a.matmul_precision == "bf16" && !models::bf16_products_native()) {
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr || std::string(rank) == "0")
      std::fprintf(stderr,
                   "distopt: --matmul-precision bf16: this CPU has no bfloat16 matrix instructions "
                   "(AVX512-BF16 or AMX); oneDNN emulates them, slower than f32\n");
  }
  // --device cuda: refused in one line before anything is written, saying
  // what is missing (a CUDA build, a device) or, where both are there, that
  // training on the device is still to come (docs/gpu.md).
  Device device = Device::cpu;
  if (!parse_device(a.device, &device)) throw InvalidInput(str("--device: '", a.device, "' is not cpu or cuda"));
  if (device == Device::cuda) {
    require_device(device);
    throw InvalidInput(
        "--device cuda: training on the GPU is not built yet; the optimizer, `distopt replay --device cuda` and "
        "`distopt bench optim --device cuda` run there (docs/gpu.md)");
  }
  // core's names and aliases (bfloat16, float16, half, ...); the summary
  // reports the short name.
  if (!parse_dtype(a.param_dtype, &a.config.parallel.param_dtype))
    throw InvalidInput(str("--param-dtype: unknown dtype '", a.param_dtype, "' (known: f32, bf16, f16)"));
  a.param_dtype = std::string(name_of(a.config.parallel.param_dtype));
  const auto compression = parallel::parse_grad_compression(a.grad_compression);
  if (!compression)
    throw InvalidInput(str("--grad-compression: unknown scheme '", a.grad_compression,
                           "' (known: ", parallel::grad_compression_names(), ")"));
  a.config.parallel.grad_compression = *compression;
  if (*compression != parallel::GradCompression::powersgd && (a.powersgd_rank != 1 || a.powersgd_warmup != 10))
    throw InvalidInput(str("--powersgd-rank and --powersgd-warmup apply to --grad-compression powersgd (this run has ",
                           a.grad_compression, ")"));
  if (*compression != parallel::GradCompression::onebit && a.onebit_warmup != 100)
    throw InvalidInput(
        str("--onebit-warmup applies to --grad-compression onebit (this run has ", a.grad_compression, ")"));
  if (a.onebit_warmup < 1)
    throw InvalidInput(
        str("--onebit-warmup must be at least 1 step: the variance is frozen after it (got ", a.onebit_warmup, ")"));
  a.config.parallel.onebit_warmup = static_cast<std::size_t>(a.onebit_warmup);
  if (a.powersgd_rank < 1 || a.powersgd_rank > 65535)
    throw InvalidInput(str("--powersgd-rank must be in [1, 65535] (got ", a.powersgd_rank, ")"));
  if (a.powersgd_warmup < 0)
    throw InvalidInput(str("--powersgd-warmup must be 0 or more steps (got ", a.powersgd_warmup, ")"));
  if (a.gather_compression != "none" && a.gather_compression != "int8")
    throw InvalidInput(str("--gather-compression: unknown scheme '", a.gather_compression, "' (known: none, int8)"));
  a.config.parallel.int8_gather = a.gather_compression == "int8";
  a.config.parallel.powersgd_rank = static_cast<int>(a.powersgd_rank);
  a.config.parallel.powersgd_warmup = static_cast<std::size_t>(a.powersgd_warmup);
  if (!(a.bucket_cap_mb > 0) || !std::isfinite(a.bucket_cap_mb))
    throw InvalidInput(str("--bucket-cap-mb must be a positive number of MiB (got ", a.bucket_cap_mb, ")"));
  a.config.parallel.bucket_elements = std::max<std::size_t>(
      1, static_cast<std::size_t>(a.bucket_cap_mb * 1048576.0 / double(size_of(a.config.parallel.param_dtype))));
  check_live_flags(a);
  if (a.scheduler.empty() && !a.scheduler_options.empty()) throw InvalidInput("--scheduler-option needs --scheduler");
  if (a.warmup_steps > 0 && !a.scheduler.empty())
    throw InvalidInput(
        "--warmup-steps is a schedule of its own (linear warm-up, then cosine decay): drop --scheduler, "
        "or build the schedule in --scheduler's JSON");
  if (!a.scheduler.empty()) {
    // A JSON spec, or NAME with --scheduler-option KEY=VALUE.
    if (a.scheduler.front() == '{') {
      if (!a.scheduler_options.empty())
        throw InvalidInput("--scheduler-option cannot be combined with a JSON --scheduler (put options in its JSON)");
      a.config.scheduler = parse_scheduler_spec(a.scheduler, "--scheduler");
    } else {
      a.config.scheduler = scheduler_spec_from_options(a.scheduler, a.scheduler_options);
    }
    a.config.scheduler_per_epoch = a.scheduler_interval == "epoch";
    // Build it once on a stand-in parameter: bad names and options fail now.
    // A 1 x 1 matrix: every rule takes it (muon refuses vectors).
    float p = 0, g = 0;
    Optimizer probe(a.config.optimizer.name,
                    {Param{"probe", {&p, DType::f32, {1, 1}}, {&g, DType::f32, {1, 1}}, false}},
                    a.config.optimizer.options);
    try {
      (void)make_scheduler(probe, *a.config.scheduler);
    } catch (const InvalidInput& e) {
      const std::string what = e.what();
      throw InvalidInput(what.rfind(a.config.scheduler->name, 0) == 0 ? what
                                                                      : str(a.config.scheduler->name, ": ", what));
    }
  }
  if (a.given_outputs.count("--export-averaged") && a.config.swa_start == 0 && !a.config.ema_decay)
    throw InvalidInput("--export-averaged needs --swa-start or --ema-decay");
  check_outputs(a);
  if (a.clip_norm_type == "inf") a.config.clip_norm_type = std::numeric_limits<double>::infinity();
  else a.config.clip_norm_type = parse_number("clip-norm-type", a.clip_norm_type);
  if (a.loss_scale == "dynamic") {
    a.config.loss_scale = a.scaler;
  } else if (a.scaler_option_given) {
    throw InvalidInput(
        "--init-scale, --growth-factor, --backoff-factor and --growth-interval need --loss-scale dynamic");
  }
  if (const auto sd = a.option_text.find(std::string(kStateDTypeOption));
      sd != a.option_text.end() && sd->second != "f32" && !a.config.checkpoint_dir.empty() &&
      parallel::strategy_or_throw(a.config.strategy).per_rank_models)
    throw InvalidInput(str("--state-dtype ", sd->second, " with --checkpoint-dir: --strategy ", a.config.strategy,
                           " checkpoints each rank's optimizer state in fp32; ddp and zero1-3 checkpoint quantized "
                           "state (or use --state-dtype f32)"));
  if (a.config.memory_checkpoint) {
    const parallel::StrategyInfo& s = parallel::strategy_or_throw(a.config.strategy);
    if (a.on_rank_failure != "continue")
      throw InvalidInput("--memory-checkpoint is for --on-rank-failure continue (what survivors go back to)");
    if (s.replicated_params)
      throw InvalidInput(str("--memory-checkpoint applies to zero1-3: under --strategy ", a.config.strategy,
                             " every survivor goes on from its own state"));
    if (a.config.checkpoint_every == 0)
      throw InvalidInput("--memory-checkpoint needs --checkpoint-every N (the steps between the checkpoints it keeps)");
  }
  if (a.on_rank_failure == "continue") {
    const parallel::StrategyInfo& s = parallel::strategy_or_throw(a.config.strategy);
    if (!s.cannot_go_on.empty())
      throw InvalidInput(str("--on-rank-failure continue: --strategy ", s.name, " (", s.cannot_go_on,
                             ") cannot go on without a lost rank; ddp, zero1-3, the other gossip strategies and "
                             "diloco can"));
    if (!s.replicated_params && a.config.checkpoint_dir.empty() && !a.config.memory_checkpoint)
      throw InvalidInput(str("--on-rank-failure continue with --strategy ", a.config.strategy,
                             " needs --checkpoint-dir or --memory-checkpoint: a lost rank holds the only copy of its "
                             "shard, so the survivors go back to the last checkpoint"));
    // Gossip survivors re-form their graph at every world down to a
    // majority of the first (a join at a world where it cannot exist is
    // not admitted).
    const std::string_view topology =
        a.config.parallel.gossip.topology.empty() ? s.topology : std::string_view(a.config.parallel.gossip.topology);
    for (int w = a.world - 1; s.per_rank_models && !topology.empty() && w > a.world / 2 && w >= 2; --w) try {
        gossip::Topology(topology, w, a.config.parallel.gossip.peers_per_iteration);
      } catch (const InvalidInput& e) {
        throw InvalidInput(str("--on-rank-failure continue with --strategy ", a.config.strategy, ": the ", w,
                               " survivors of lost ranks could not gossip (", e.what(), "); choose another --topology"));
      }
    a.config.on_rank_failure = train::TrainConfig::OnRankFailure::go_on;
  }
  if (a.on_nonfinite == "warn") a.config.on_nonfinite = train::TrainConfig::OnNonFinite::warn;
  else if (a.on_nonfinite == "ignore") a.config.on_nonfinite = train::TrainConfig::OnNonFinite::ignore;
}

}  // namespace distopt::cli
