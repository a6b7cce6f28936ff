// `distopt train`'s results: the summary (a line for people, or one JSON
// object as the last line of stdout; docs/formats.md), the stop report and
// the exported parameter files (args.hpp).
#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <cstdio>

#include "../commands.hpp"
#include "args.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/optim/averaging.hpp"
#include "observers.hpp"

namespace distopt::cli {

namespace {

std::size_t parameter_count(const train::TrainResult& r) {
  return r.slots.empty() ? 0 : r.slots.back().offset + r.slots.back().numel();
}

std::string summary_json(const train::TrainResult& r, const TrainArgs& a, int world) {
  char b[2048];
  std::snprintf(b, sizeof b,
                "{\"test_accuracy\": %s, \"test_loss\": %s, \"train_loss\": %s, \"steps\": %zu, \"param_hash\": "
                "\"%s\", \"samples_per_s\": %.6g, \"memory_per_rank\": {\"params\": %zu, \"grads\": %zu, "
                "\"master_params\": %zu, \"optimizer_state\": %zu, \"activations\": %zu, \"workspaces\": %zu}, "
                "\"model\": \"%s\", \"data\": \"%s\", "
                "\"optimizer\": \"%s\", \"strategy\": \"%s\", \"backend\": \"%s\", \"world\": %d, \"epochs\": %d, "
                "\"batch_size\": %zu, \"seed\": %llu, \"param_dtype\": \"%s\", \"grad_compression\": \"%s\", "
                "\"bytes_sent_per_rank\": %llu, "
                "\"interrupted\": %s}",
                jnum(r.test_accuracy).c_str(), jnum(r.test_loss).c_str(), jnum(r.train_loss).c_str(), r.steps,
                r.param_hash.c_str(), r.samples_per_s, r.memory.params, r.memory.grads, r.memory.master_params,
                r.memory.optimizer_state, r.memory.activations, r.memory.workspaces, a.config.model.c_str(),
                a.data.c_str(), a.config.optimizer.name.c_str(), a.config.strategy.c_str(), a.backend.c_str(), world,
                a.config.epochs, a.config.batch_size, static_cast<unsigned long long>(a.config.seed),
                a.param_dtype.c_str(), a.grad_compression.c_str(), static_cast<unsigned long long>(r.bytes_sent),
                r.interrupted ? "true" : "false");
  std::string out = b;
  out.pop_back();  // the closing brace; optional members follow
  if (a.config.parallel.int8_gather) out += ", \"gather_compression\": \"int8\"";
  if (a.config.on_nonfinite != train::TrainConfig::OnNonFinite::error)
    out += str(", \"nonfinite_steps\": ", r.nonfinite_steps);
  if (!std::isnan(r.consensus_distance)) out += str(", \"consensus_distance\": ", jnum(r.consensus_distance));
  if (a.config.on_rank_failure == train::TrainConfig::OnRankFailure::go_on) {
    double lost = 0;
    for (const auto& c : r.membership) lost += c.seconds;
    out += str(", \"membership_changes\": ", r.membership.size(), ", \"world_at_end\": ",
               r.membership.empty() ? world : r.membership.back().world, ", \"seconds_lost\": ", jnum(lost));
  }
  // The process's peak resident memory so far: every rank of the threads
  // backend together, this process's rank under MPI.
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) {
    // What explains it: the runtime before the data, the data, and the
    // ranks' reported categories (each a peak) for every rank here.
    const std::uint64_t peak = std::uint64_t(usage.ru_maxrss) * 1024;
    const parallel::MemoryUse& m = r.memory;
    const std::uint64_t per_rank =
        m.params + m.grads + m.master_params + m.optimizer_state + m.activations + m.workspaces;
    const std::uint64_t accounted = a.runtime_rss + a.data_bytes + per_rank * std::uint64_t(a.ranks_here);
    out += str(", \"peak_rss\": ", peak, ", \"memory_process\": {\"ranks\": ", a.ranks_here,
               ", \"runtime\": ", a.runtime_rss, ", \"data\": ", a.data_bytes, ", \"accounted\": ", accounted,
               ", \"unexplained\": ", jnum((double(peak) - double(accounted)) / double(peak)), "}");
  }
  if (a.config.loss_scale) {
    char m[96];
    std::snprintf(m, sizeof m, ", \"loss_scale\": %.9g, \"skipped_steps\": %zu", r.loss_scale, r.skipped_steps);
    out += m;
  }
  if (a.config.model == "gpt") {
    // Language-model figures: losses in nats per token (byte), the
    // validation loss in bits per byte, and tokens per second.
    const double ctx = static_cast<double>(a.config.gpt.context);
    out += str(", \"val_loss\": ", jnum(r.test_loss), ", \"val_bits_per_byte\": ", jnum(r.test_loss / std::log(2.0)),
               ", \"tokens_per_s\": ", jnum(r.samples_per_s * ctx), ", \"gpt\": {\"layers\": ", a.config.gpt.layers,
               ", \"heads\": ", a.config.gpt.heads, ", \"dim\": ", a.config.gpt.dim,
               ", \"context\": ", a.config.gpt.context, ", \"parameters\": ", parameter_count(r),
               ", \"threads\": ", a.config.threads, ", \"matmul_precision\": \"", a.matmul_precision, "\"}");
  }
  if (r.checkpoints_written > 0 || r.checkpoints_in_memory > 0 || a.config.resume)
    out += str(", \"checkpoints\": {\"written\": ", r.checkpoints_written,
               a.config.memory_checkpoint ? str(", \"in_memory\": ", r.checkpoints_in_memory) : std::string(),
               ", \"seconds\": ", jnum(r.checkpoint_seconds), ", \"last_bytes\": ", r.checkpoint_bytes,
               ", \"resume_load_s\": ", jnum(a.resume_load_seconds + r.resume_seconds), "}");
  if (r.averaged) {
    char m[320];
    std::snprintf(m, sizeof m,
                  ", \"averaged\": {\"kind\": \"%s\", \"n_averaged\": %lld, \"test_accuracy\": %s, \"test_loss\": "
                  "%s, \"param_hash\": \"%s\"}",
                  std::string(averaging_name(r.averaged->kind)).c_str(), static_cast<long long>(r.averaged->n_averaged),
                  jnum(r.averaged->test_accuracy).c_str(), jnum(r.averaged->test_loss).c_str(),
                  r.averaged->param_hash.c_str());
    out += m;
  }
  return out + "}";
}

}  // namespace

void print_result(const train::TrainResult& r, const TrainArgs& a, int world) {
  if (a.json) {
    std::printf("%s\n", summary_json(r, a, world).c_str());
  } else if (a.config.model == "gpt") {
    std::printf(
        "gpt on %s, %s, %s, world %d: val_loss %s (%s bits/byte)  train_loss %s  steps %zu%s  %s tokens/s  "
        "param_hash %s\n",
        a.data.c_str(), a.config.optimizer.name.c_str(), a.config.strategy.c_str(), world, fixed4(r.test_loss).c_str(),
        fixed4(r.test_loss / std::log(2.0)).c_str(), fixed4(r.train_loss).c_str(), r.steps,
        r.interrupted ? " (interrupted)" : "",
        human_rate(r.samples_per_s * static_cast<double>(a.config.gpt.context)).c_str(), r.param_hash.c_str());
  } else {
    std::printf(
        "%s on %s, %s, %s, world %d: test_accuracy %s  test_loss %s  train_loss %s  steps %zu%s  %s "
        "samples/s  param_hash %s\n",
        a.config.model.c_str(), a.data.c_str(), a.config.optimizer.name.c_str(), a.config.strategy.c_str(), world,
        fixed4(r.test_accuracy).c_str(), fixed4(r.test_loss).c_str(), fixed4(r.train_loss).c_str(), r.steps,
        r.interrupted ? " (interrupted)" : "", human_rate(r.samples_per_s).c_str(), r.param_hash.c_str());
    if (!std::isnan(r.consensus_distance))
      std::printf("gossip: the figures are the average model's; consensus distance %.3g\n", r.consensus_distance);
    if (r.nonfinite_steps > 0)
      std::printf("%zu of %zu steps had a non-finite loss or gradient norm\n", r.nonfinite_steps, r.steps);
    if (a.config.loss_scale)
      std::printf("loss scaling: final scale %g, %zu of %zu steps skipped on inf/NaN gradients\n", r.loss_scale,
                  r.skipped_steps, r.steps);
    if (r.averaged)
      std::printf("averaged model (%s, %lld averages): test_accuracy %s  test_loss %s  param_hash %s\n",
                  std::string(averaging_name(r.averaged->kind)).c_str(), static_cast<long long>(r.averaged->n_averaged),
                  fixed4(r.averaged->test_accuracy).c_str(), fixed4(r.averaged->test_loss).c_str(),
                  r.averaged->param_hash.c_str());
  }
  std::fflush(stdout);
}

// After a stop by signal: which one, and that the outputs hold the last step.
void report_stop(const train::TrainResult& r) {
  if (!r.interrupted) return;
  std::fprintf(stderr, "distopt: stopped by %s after step %zu; metrics and outputs hold that step\n",
               r.stop_signal == SIGINT    ? "SIGINT"
               : r.stop_signal == SIGTERM ? "SIGTERM"
                                          : "a signal",
               r.steps);
}

void export_params(const train::TrainResult& r, const TrainArgs& a) {
  auto write = [&](const std::string& path, const std::vector<float>& params, const std::string& hash,
                   std::map<std::string, std::string> metadata) {
    metadata.insert({{"format", "distopt-params/1"}, {"model", a.config.model}, {"param_hash", hash}});
    if (a.config.model == "gpt")  // what distopt sample needs besides the shapes
      metadata.insert({{"heads", std::to_string(a.config.gpt.heads)}, {"layers", std::to_string(a.config.gpt.layers)}});
    checkpoint::write_safetensors(output_path(path), {r.slots, params, std::move(metadata)});
  };
  if (!a.export_path.empty()) write(a.export_path, r.params, r.param_hash, {});
  if (!a.export_averaged.empty() && r.averaged)
    write(a.export_averaged, r.averaged->params, r.averaged->param_hash,
          {{"averaged", std::string(averaging_name(r.averaged->kind))},
           {"n_averaged", std::to_string(r.averaged->n_averaged)}});
}

}  // namespace distopt::cli
