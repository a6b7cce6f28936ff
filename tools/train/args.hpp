// `distopt train` (tools/train/): what its files share. The verb is split by
// job: flags.cpp (the flag table), preflight.cpp (checks and preparation
// before any work), data.cpp (data sets and the warm-up schedule),
// observers.cpp (progress and metrics), report.cpp (summary and exports),
// run.cpp (one run for every backend), resume.cpp (--resume). The command
// line contract is docs/formats.md's.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "distopt/data/dataset.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/train/trainer.hpp"

namespace distopt::cli {

struct TrainArgs {
  train::TrainConfig config;
  std::string data = "fashion-mnist", data_dir, data_file, backend = "threads", metrics, export_path, progress = "auto";
  std::string config_file;  // --config
  std::size_t train_size = 8192, test_size = 2048;
  int world = 1;
  bool json = false, print_config = false, resume = false;
  double resume_load_seconds = 0;  // --resume: verifying the checkpoint, reading its headers (the
                                   // values are read as the ranks set up: TrainResult::resume_seconds)
  // The process's memory besides the ranks' (the summary's memory_process):
  // resident bytes before the data is loaded (code, libraries, the
  // runtime), the data set's bytes, and the ranks this process runs.
  std::uint64_t runtime_rss = 0, data_bytes = 0;
  int ranks_here = 1;
  std::map<std::string, std::string> option_text;  // optimizer options as given, torch names
  std::string scheduler, scheduler_interval = "step";
  std::size_t warmup_steps = 0;                // --warmup-steps: linear warm-up, then cosine decay over the run
  std::vector<std::string> scheduler_options;  // KEY=VALUE
  std::string clip_norm_type = "2", loss_scale = "none", export_averaged;
  std::string param_dtype = "f32";
  std::string grad_compression = "none", gather_compression = "none";
  long long powersgd_rank = 1, powersgd_warmup = 10;  // checked in prepare()
  long long onebit_warmup = 100;                      // checked in prepare()
  std::string device = "cpu";
  std::string matmul_precision = "f32";
  std::string on_nonfinite = "error", comm_timeout;
  std::string on_rank_failure = "stop";
  // --backend gloo: this process's rank, the rendezvous directory, the
  // address the others reach it at.
  int rank = 0;
  bool rank_given = false;
  std::string rendezvous, gloo_host;
  std::string join;  // --join DIR: the rendezvous of a running gloo run to join
  std::set<std::string> gossip_flags;  // gossip options given on the command line
  std::set<std::string> live_flags;    // --prefetch-units, --max-live-params, --max-buckets-in-flight given
  std::string link_bandwidth = "none";
  double link_latency = 0;
  std::set<std::string> given_outputs;  // output flags given on the command line, even as ''
  bool world_given = false, backend_given = false;

  double bucket_cap_mb = 0.125;
  GradScalerOptions scaler;  // --init-scale, --growth-factor, ... (torch's names)
  bool scaler_option_given = false;
};

// preflight.cpp: everything checked and prepared before a launcher starts
// (options, scheduler, dtypes, gossip flags, data and model, outputs).
void prepare(TrainArgs& a);
// Sizes asked for against this machine's memory, for `ranks` ranks in this
// process, before anything is allocated.
void check_memory(const TrainArgs& a, int ranks);
// Why gossip flag `flag` ("--topology") does not apply to strategy `s`
// configured with `options` (slowmo's base, diloco's outer optimizer), or
// "" when it does; the gossip flags.
std::string gossip_flag_misfit(const std::string& flag, const std::string& s, const parallel::GossipOptions& options);
extern const std::set<std::string> kGossipFlags;

// data.cpp
data::Split load_data(const TrainArgs& a);
// --warmup-steps: linear warm-up then cosine decay, once the run's length is known.
void warmup_cosine(TrainArgs& a, const data::Split& d);
// Features and outputs of the data set a run asks for.
struct DataDims {
  std::size_t features, outputs;
};
DataDims dims_of(const TrainArgs& a);
bool is_text(const std::string& data);

// report.cpp
// Outputs are written to NAME.tmp.<pid> and renamed: removes the temporary
// files of NAME whose process no longer exists on this machine (killed),
// saying so: "left by WHOSE (process N) that was killed".
void remove_stale_temp_files(const std::string& output, const char* whose = "an earlier run");
void print_result(const train::TrainResult& r, const TrainArgs& a, int world);
void report_stop(const train::TrainResult& r);
void export_params(const train::TrainResult& r, const TrainArgs& a);

// run.cpp
int run_train(TrainArgs& a);

// resume.cpp
void load_resume(CLI::App& command, TrainArgs& a);

}  // namespace distopt::cli
