// `distopt train`'s flag table (args.hpp): every flag with its help, the
// checks CLI11 runs on it, and the runner that applies --config and
// --resume, prints the configuration or trains.
#include <algorithm>
#include <memory>
#include <set>
#include <type_traits>

#include "../commands.hpp"
#include "../run_config.hpp"
#include "args.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt::cli {

namespace {

// Hidden widths: neither negative nor zero.
const CLI::Validator positive_counts(
    [](std::string& v) -> std::string {
      if (!v.empty() && (v[0] == '-' || v.find_first_not_of('0') == std::string::npos))
        return "must be positive integers (got " + v + ")";
      return {};
    },
    "N>0");

}  // namespace

Runner add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "train a built-in model on a data set (threads backend by default)");
  train::TrainConfig& c = a->config;
  sub->add_option("--model", c.model,
                  "mlp (784-256-128-10, ReLU; default), logreg, linreg, gpt (a GPT-2-style transformer on bytes: "
                  "--data fortunes or text)")
      ->capture_default_str();
  sub->add_option("--hidden", c.hidden, "mlp hidden widths (default 256,128)")->delimiter(',')->check(positive_counts);
  sub->add_option("--tile-rows", c.tile_rows,
                  "mlp: layers of more outputs than this computed in tiles of this many weight rows, and used a "
                  "tile at a time (zero3 gathers one tile at once); the bits depend on the tile, not the strategy "
                  "(default 0: whole layers)");
  sub->add_option("--data", a->data,
                  "fashion-mnist (default), synthetic, synthetic-regression; text for --model gpt: fortunes "
                  "(Debian's fortunes package; gpt's default), text (--data-file)")
      ->capture_default_str();
  sub->add_option("--data-dir", a->data_dir,
                  "Fashion-MNIST folder (default: Debian's dataset-fashion-mnist), or the fortunes folder "
                  "(default /usr/share/games/fortunes)");
  sub->add_option("--data-file", a->data_file, "--data text: a text file to train on (the last 10% held out)");
  sub->add_option("--warmup-steps", a->warmup_steps,
                  "linear warm-up over N steps, then cosine decay to 0 over the rest of the run (instead of "
                  "--scheduler)");
  sub->add_option("--layers", c.gpt.layers, "gpt: transformer blocks (default 4)")->capture_default_str();
  sub->add_option("--heads", c.gpt.heads, "gpt: attention heads, dividing --dim (default 4)")->capture_default_str();
  sub->add_option("--dim", c.gpt.dim, "gpt: embedding width (default 128)")->capture_default_str();
  sub->add_option("--context", c.gpt.context, "gpt: tokens (bytes) a sample reads (default 64)")->capture_default_str();
  sub->add_flag("--activation-checkpointing", c.activation_checkpointing,
                "gpt: blocks keep only their input and run their forward again in backward (the same bits; "
                "one block's activations instead of every block's)");
  sub->add_option("--matmul-precision", a->matmul_precision,
                  "gpt: f32 (default) or bf16: products of bfloat16-rounded operands summed in float32 (torch's "
                  "float32 matmul precision 'medium'; twice as fast on CPUs with AVX512-BF16 or AMX)")
      ->capture_default_str();
  sub->add_option("--threads", c.threads,
                  "gpt: threads per rank for forward and backward (default 1; the same bits at any count)")
      ->capture_default_str();
  sub->add_option("--train-size,--synthetic-train-size", a->train_size, "synthetic training samples (default 8192)")
      ->check(non_negative("integer"));
  sub->add_option("--test-size,--synthetic-test-size", a->test_size,
                  "synthetic test samples; text: validation windows evaluated (default 2048)")
      ->check(non_negative("integer"));
  sub->add_option("--optimizer", c.optimizer.name, "any optimizer of the library (default adamw)")
      ->capture_default_str();
  sub->add_option("--strategy", c.strategy,
                  "ddp (default), zero1 (sharded optimizer state), zero2 (+ sharded gradients), zero3 (+ sharded "
                  "parameters), or gossip: sgp, osgp, dpsgd, adpsgd, slowmo, diloco (docs/gossip.md)")
      ->capture_default_str();
  parallel::GossipOptions& g = c.parallel.gossip;
  auto gossip_flag = [&](const std::string& name, auto& field, const std::string& help) {
    DISTOPT_CHECK(kGossipFlags.count(name), name);
    sub->add_option(name, field, help)->each([a, name](const std::string&) { a->gossip_flags.insert(name); });
  };
  gossip_flag("--topology", g.topology,
              "gossip graph (default exponential; dpsgd and adpsgd: bipartite-exponential; docs/gossip.md lists them)");
  gossip_flag("--peers-per-iteration", g.peers_per_iteration, "peers per iteration of topology exponential-k");
  gossip_flag("--synch-freq", g.synch_freq,
              "osgp: a round is added synch-freq + 1 steps after it is sent; adpsgd: a step waits for the round "
              "synch-freq + 1 steps old (default 0)");
  gossip_flag("--slowmo-base", g.slowmo_base, "slowmo: localsgd (default) or sgp");
  gossip_flag("--localsgd-frequency", g.localsgd_frequency, "slowmo with localsgd: steps between averages (default 3)");
  gossip_flag("--slowmo-frequency", g.slowmo_frequency, "slowmo: steps between outer updates, tau (default 48)");
  gossip_flag("--slowmo-momentum", g.slowmo_momentum, "slowmo: outer momentum beta (default 0.5)");
  gossip_flag("--slowmo-lr", g.slowmo_lr, "slowmo: outer lr alpha (default 1)");
  gossip_flag("--sync-every", g.sync_every, "diloco: inner steps between outer steps, H (default 100)");
  gossip_flag("--outer-optimizer", g.outer_optimizer,
              "diloco: the outer optimizer, any of the library (default sgd with Nesterov momentum)");
  gossip_flag("--outer-lr", g.outer_lr, "diloco: the outer learning rate (default 0.7)");
  gossip_flag("--outer-momentum", g.outer_momentum,
              "diloco with the outer sgd: its momentum, Nesterov's when positive (default 0.9)");
  gossip_flag("--fragments", g.fragments,
              "diloco: fragments of strided units that sync at staggered steps (Streaming DiLoCo; default 1)");
  gossip_flag("--sync-delay", g.sync_delay,
              "diloco: inner steps a fragment's average runs behind training before it is applied (default 0)");
  gossip_flag("--fragment-alpha", g.fragment_alpha,
              "diloco: a synced fragment becomes (1 - alpha) * global + alpha * local (default 0)");
  sub->add_flag("--fragment-carry", g.fragment_carry,
                "diloco with --sync-delay: a synced fragment keeps the rank's own steps taken while its average was "
                "in flight (the new global plus them, then mixed by --fragment-alpha)")
      ->each([a](const std::string&) { a->gossip_flags.insert("--fragment-carry"); });
  gossip_flag("--outer-dtype", g.outer_dtype,
              "diloco: the pseudo-gradient on the wire: f32 (default), bf16, fp8 or int4 (scaled per block of 64)");
  sub->add_flag("--outer-error-feedback", g.outer_error_feedback,
                "diloco with a compressed --outer-dtype: carry what quantisation lost into the next sync")
      ->each([a](const std::string&) { a->gossip_flags.insert("--outer-error-feedback"); });
  sub->add_option("--link-bandwidth", a->link_bandwidth,
                  "emulate a network link per rank of this many bits per second (e.g. 100M, 1G; default none)");
  sub->add_option("--link-latency", a->link_latency, "emulated link latency in seconds (default 0)");
  sub->add_option("--device", a->device, "cpu (default) or cuda (docs/gpu.md: training on the GPU is not built yet)");
  sub->add_option("--param-dtype", a->param_dtype,
                  "parameters and gradients in f32 (default), bf16 or f16, with fp32 master weights and state");
  sub->add_option(
      "--grad-compression", a->grad_compression,
      "gradients on the wire: none (default), bf16 or fp16 (half the bytes; ddp and zero1-3 still give "
      "each other's bits, not uncompressed ddp's), or int8 (blocks of 256 with a scale, error feedback; "
      "about a quarter of the bytes), or powersgd (matrices at a low rank, error feedback), or onebit (1-bit "
      "Adam with adam/adamw: after --onebit-warmup steps the variance frozen and the moments averaged as "
      "signs, error feedback; ddp, zero1, zero2)");
  sub->add_option("--gather-compression", a->gather_compression,
                  "zero3's parameter gathers: none (default) or int8 (blocks of 256 with a scale: about a quarter of "
                  "the bytes; the model computes with the unpacked values, the optimizer steps the exact shard)");
  sub->add_option("--powersgd-rank", a->powersgd_rank,
                  "PowerSGD's approximation rank (default 1, torch's matrix_approximation_rank)");
  sub->add_option("--powersgd-warmup", a->powersgd_warmup,
                  "steps reduced uncompressed before PowerSGD starts (default 10, torch's start_powerSGD_iter)");
  sub->add_option("--onebit-warmup", a->onebit_warmup,
                  "steps of plain Adam before 1-bit Adam freezes the variance (default 100; DeepSpeed's freeze_step)");
  sub->add_option("--bucket-cap-mb", a->bucket_cap_mb,
                  "gradient bucket size in MiB (default 0.125): buckets of whole layers reduced while backward runs");
  auto live_flag = [&](const std::string& name, auto& field, const std::string& help) {
    sub->add_option(name, field, help)
        ->check(non_negative("integer"))
        ->each([a, name](const std::string&) { a->live_flags.insert(name); });
  };
  live_flag("--prefetch-units", c.parallel.prefetch_units,
            "zero3: units gathered ahead of the one in use (default 1; 0: one unit live at a time)");
  live_flag("--max-live-params", c.parallel.max_live_params,
            "zero3: the most parameter elements gathered at once (default: no limit; at least the largest unit)");
  live_flag("--max-buckets-in-flight", c.parallel.max_buckets_in_flight,
            "zero2, zero3: gradient buckets being written or reduced at once (default 2)");
  sub->add_option("--world", a->world, "ranks of the threads backend (default 1)")->each([a](const std::string&) {
    a->world_given = true;
  });
  sub->add_option("--backend", a->backend,
                  "threads (default), mpi (world size from mpirun; chosen by itself under mpirun) or gloo (one "
                  "process per rank, started by you: --world, --rank, --rendezvous; chosen by itself under srun "
                  "or torchrun, which give them: docs/cluster.md)")
      ->each([a](const std::string&) { a->backend_given = true; })
      ->check(CLI::IsMember({"threads", "mpi", "gloo"}));
  sub->add_option("--rank", a->rank, "gloo: this process's rank, 0 .. --world - 1")
      ->each([a](const std::string&) { a->rank_given = true; });
  sub->add_option("--rendezvous", a->rendezvous,
                  "gloo: a directory every process of the run sees (one machine, or a shared file system), or "
                  "tcp://HOST:PORT, a store rank 0 serves on PORT of HOST (its machine); one per run");
  sub->add_option(
      "--join", a->join,
      "join the gloo run going on at this rendezvous, a directory or tcp://HOST:PORT (started with --on-rank-failure "
      "continue), with the same training flags; it admits this process between two steps");
  sub->add_option("--gloo-host", a->gloo_host, "gloo: the address the others reach this process at (default: the "
                                               "host name)");
  sub->add_option("--epochs", c.epochs, "epochs (default 1)");
  sub->add_option("--batch-size", c.batch_size, "global batch size, the same at every world size (default 128)")
      ->check(non_negative("integer"));
  sub->add_option("--seed", c.seed, "seed of initialization, shuffling and synthetic data (default 0)")
      ->check(non_negative("integer"));
  sub->add_flag("--drop-last", c.drop_last, "skip each epoch's last, partial batch (default: keep it)");
  sub->add_flag("!--keep-denormals", c.flush_denormals,
                "compute with denormal floats (default: flush them to zero, much faster late in training)");
  sub->add_option("--max-steps", c.max_steps, "stop after this many steps (default: all epochs)")
      ->check(non_negative("integer"));
  sub->add_option("--metrics", a->metrics, "write per-step and per-epoch metrics (JSON lines; .csv for CSV)")
      ->each([a](const std::string&) { a->given_outputs.insert("--metrics"); });
  sub->add_option("--export-params", a->export_path, "write the final fp32 parameters as a safetensors file")
      ->each([a](const std::string&) { a->given_outputs.insert("--export-params"); });
  sub->add_option("--on-nonfinite", a->on_nonfinite,
                  "a non-finite loss or gradient norm: error (default: stop, exit status 4), warn (say so once, "
                  "train on) or ignore")
      ->check(CLI::IsMember({"error", "warn", "ignore"}));
  sub->add_option("--on-rank-failure", a->on_rank_failure,
                  "a rank lost (failed, or silent past --comm-timeout): stop (default: every rank ends with the "
                  "error) or continue (the survivors go on: every strategy but adpsgd; threads and gloo backends; "
                  "zero1-3 go back to a checkpoint: --checkpoint-dir or --memory-checkpoint)")
      ->check(CLI::IsMember({"stop", "continue"}));
  sub->add_flag("--memory-checkpoint", c.memory_checkpoint,
                "zero1-3 with --on-rank-failure continue: every --checkpoint-every steps each rank keeps its "
                "checkpoint in memory and a copy of its neighbour's, so survivors go back without the disk");
  sub->add_option("--comm-timeout", a->comm_timeout,
                  "seconds a rank waits for the others before the job ends naming the silent rank (default 300, "
                  "or DISTOPT_COMM_TIMEOUT)");
  sub->add_option("--progress", a->progress, "auto (bar on a terminal, else lines), bar, lines, none")
      ->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  sub->add_flag("--json", a->json, "print the summary as one JSON object, the last line of stdout");
  sub->add_option("--scheduler", a->scheduler,
                  "lr scheduler, torch's lower-cased class name (steplr, onecyclelr, ...) or a JSON spec "
                  "{\"name\": ..., \"options\": {...}, \"schedulers\": [...]}");
  sub->add_option("--scheduler-option", a->scheduler_options,
                  "scheduler option KEY=VALUE, torch-named (e.g. step_size=3, milestones=2,5); repeatable");
  sub->add_option("--scheduler-interval", a->scheduler_interval,
                  "step the scheduler after every optimizer step (default) or every epoch; "
                  "reducelronplateau: every epoch, on the test loss")
      ->check(CLI::IsMember({"step", "epoch"}));
  sub->add_option("--clip-grad-norm", c.clip_grad_norm,
                  "clip the gradient's total norm to this value after its reduction (torch's clip_grad_norm_)");
  sub->add_option("--clip-norm-type", a->clip_norm_type, "norm of --clip-grad-norm: 2 (default), 1, inf or any p > 0");
  sub->add_option("--clip-grad-value", c.clip_grad_value, "clamp every gradient element into [-v, v]");
  sub->add_option("--loss-scale", a->loss_scale,
                  "none (default) or dynamic: torch's GradScaler (scaled backward, skip on inf/NaN, adaptive scale)")
      ->check(CLI::IsMember({"none", "dynamic"}));
  auto scaler_flag = [a](auto& field) {
    return [a, &field](std::remove_reference_t<decltype(field)> v) {
      field = v;
      a->scaler_option_given = true;
    };
  };
  sub->add_option_function<double>("--init-scale", scaler_flag(a->scaler.init_scale),
                                   "loss scaling: initial scale (default 65536)");
  sub->add_option_function<double>("--growth-factor", scaler_flag(a->scaler.growth_factor),
                                   "loss scaling: growth factor, > 1 (default 2)");
  sub->add_option_function<double>("--backoff-factor", scaler_flag(a->scaler.backoff_factor),
                                   "loss scaling: backoff factor, < 1 (default 0.5)");
  sub->add_option_function<std::int64_t>("--growth-interval", scaler_flag(a->scaler.growth_interval),
                                         "loss scaling: good steps before the scale grows (default 2000)");
  sub->add_option("--swa-start", c.swa_start,
                  "stochastic weight averaging: average the parameters at the end of this epoch and every later one");
  sub->add_option("--swa-lr", c.swa_lr,
                  "with --swa-start: SWALR anneals the lr to this value, per epoch, from then on");
  sub->add_option("--swa-anneal-strategy", c.swa_anneal_strategy, "SWALR's anneal_strategy: cos (default) or linear")
      ->check(CLI::IsMember({"cos", "linear"}));
  sub->add_option("--ema-decay", c.ema_decay,
                  "exponential moving average of the parameters after every step, with this decay (e.g. 0.999)");
  sub->add_option("--export-averaged", a->export_averaged,
                  "write the averaged (SWA/EMA) model's fp32 parameters as a safetensors file")
      ->each([a](const std::string&) { a->given_outputs.insert("--export-averaged"); });
  sub->add_option("--swa-anneal-epochs", c.swa_anneal_epochs, "SWALR's anneal_epochs (default 10)")
      ->check(non_negative("integer"));
  // Every optimizer option of every rule, torch-named (--weight-decay or --weight_decay).
  std::set<std::string> seen;
  for (const RuleInfo* rule : all_rules())
    for (const OptionSpec& s : rule->options) {
      const std::string name(s.name);
      if (!seen.insert(name).second) continue;
      std::string dashed = name;
      std::replace(dashed.begin(), dashed.end(), '_', '-');
      std::string names = "--" + dashed + (dashed != name ? ",--" + name : "");
      sub->add_option_function<std::string>(
          names, [a, name](const std::string& v) { a->option_text[name] = v; },
          std::string("optimizer option ") + name);
    }
  sub->add_option_function<std::string>(
      "--state-dtype,--state_dtype", [a](const std::string& v) { a->option_text[std::string(kStateDTypeOption)] = v; },
      "the optimizer state's storage: f32 (default), bf16 (every state tensor, rounded to nearest-even), int8 or "
      "int4 (blocks of 256 / 128 with an fp32 scale each; tensors under 4096 elements keep f32); adam, adamw, sgd "
      "with momentum, lion");
  sub->add_option("--checkpoint-dir", c.checkpoint_dir,
                  "write checkpoints under DIR (DIR/step-N/: a file per rank and a manifest; docs/formats.md)");
  sub->add_option("--checkpoint-every", c.checkpoint_every,
                  "steps between checkpoints (default 0: only one when training ends)")
      ->check(non_negative("integer"));
  sub->add_option("--keep-checkpoints", c.keep_checkpoints,
                  "the newest checkpoints kept in --checkpoint-dir (default 3)")
      ->check(non_negative("integer"));
  sub->add_flag("--resume", a->resume,
                "go on from the latest complete checkpoint in --checkpoint-dir, at any world size and strategy; the "
                "run's flags come from it, flags given again override them");
  sub->add_flag("--print-config", a->print_config,
                "print the effective configuration as JSON (the format of --config) and exit without training");
  add_config_file(*sub, a->config_file);
  // An empty value is an error for every option but the outputs, which
  // name the empty file themselves.
  for (CLI::Option* opt : sub->get_options()) {
    const std::string name = opt->get_name();
    if (opt->get_expected_min() == 0 || name == "--metrics" || name == "--export-params" ||
        name == "--export-averaged" || name == "--help")
      continue;
    opt->check(non_empty());
  }
  return [a, sub] {
    if (!a->config_file.empty()) apply_config_file(*sub, a->config_file);
    if (a->resume) load_resume(*sub, *a);
    // gpt's own data set, fortunes, in place of the default before the run
    // is recorded: a checkpoint's configuration, resumed, names what the
    // run read (and --print-config shows it).
    CLI::Option* data = sub->get_option("--data");
    if (a->config.model == "gpt" && data->count() == 0 && a->data == "fashion-mnist") {
      data->default_str("fortunes");
      a->data = "fortunes";
    }
    a->config.checkpoint_run = effective_config(*sub);
    if (a->print_config) {
      std::fputs(effective_config(*sub).c_str(), stdout);
      return 0;
    }
    return run_train(*a);
  };
}

}  // namespace distopt::cli
