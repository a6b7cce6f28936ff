// distopt train: trains a built-in model (spec/cli-contract.md).
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <type_traits>

#include "backends.hpp"
#include "commands.hpp"
#include <nlohmann/json.hpp>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/gossip/topology.hpp"
#include "distopt/optim/averaging.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/rule.hpp"
#include "distopt/optim/scheduler.hpp"
#include "distopt/replay/replay.hpp"
#include "distopt/train/trainer.hpp"
#include "run_config.hpp"
#include "signals.hpp"

namespace distopt::cli {

namespace {

struct TrainArgs {
  train::TrainConfig config;
  std::string data = "fashion-mnist", data_dir, data_file, backend = "threads", metrics, export_path, progress = "auto";
  std::string config_file;  // --config
  std::size_t train_size = 8192, test_size = 2048;
  int world = 1;
  bool json = false, print_config = false, resume = false;
  double resume_load_seconds = 0;  // --resume: reading, verifying and assembling the checkpoint
  std::map<std::string, std::string> option_text;  // optimizer options as given, torch names
  std::string scheduler, scheduler_interval = "step";
  std::size_t warmup_steps = 0;  // --warmup-steps: linear warm-up, then cosine decay over the run
  std::vector<std::string> scheduler_options;  // KEY=VALUE
  std::string clip_norm_type = "2", loss_scale = "none", export_averaged;
  std::string param_dtype = "f32";
  std::string matmul_precision = "f32";
  std::string on_nonfinite = "error", comm_timeout;
  std::set<std::string> gossip_flags;  // gossip options given on the command line
  std::string link_bandwidth = "none";
  double link_latency = 0;
  std::set<std::string> given_outputs;  // output flags given on the command line, even as ''
  bool world_given = false, backend_given = false, data_given = false;

  double bucket_cap_mb = 0.125;
  GradScalerOptions scaler;  // --init-scale, --growth-factor, ... (torch's names)
  bool scaler_option_given = false;
};

std::string human_rate(double r) {
  char b[32];
  if (r >= 1e6) std::snprintf(b, sizeof b, "%.2fM", r / 1e6);
  else if (r >= 1e3) std::snprintf(b, sizeof b, "%.1fk", r / 1e3);
  else std::snprintf(b, sizeof b, "%.0f", r);
  return b;
}

// A float for CSV: %.9g, or an empty field where nothing was measured or
// the value is not finite.
std::string cnum(double v) { return std::isfinite(v) ? jnum(v) : std::string(); }

// A figure for people: four decimals, or n/a where nothing was measured.
std::string fixed4(double v) {
  if (std::isnan(v)) return "n/a";
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) s = 0;
  const long t = std::lround(s);
  char b[32];
  if (t >= 3600) std::snprintf(b, sizeof b, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else std::snprintf(b, sizeof b, "%ld:%02ld", t / 60, t % 60);
  return b;
}

// Progress on stderr: a redrawn bar on a terminal, plain lines otherwise.
class Progress final : public train::Observer {
 public:
  Progress(bool bar, bool lines) : bar_(bar), lines_(lines) {}
  void on_start(int epochs, std::size_t steps) override {
    epochs_ = epochs;
    steps_ = steps;
    start_ = Clock::now();
  }
  void on_step(const train::StepMetrics& m) override {
    const auto now = Clock::now();
    const double total_steps = double(epochs_) * double(steps_);
    const double eta = m.wall_s / double(m.step) * (total_steps - double(m.step));
    if (bar_) {
      if (now - last_draw_ < std::chrono::milliseconds(100) && m.epoch_step != m.epoch_steps) return;
      last_draw_ = now;
      const int width = 24, filled = int(double(width) * double(m.epoch_step) / double(m.epoch_steps));
      std::string b(std::size_t(filled), '#');
      b.append(std::size_t(width - filled), '.');
      std::fprintf(stderr, "\repoch %d/%d [%s] %zu/%zu  loss %.4f  %s samples/s  ETA %s \x1b[K", m.epoch, epochs_,
                   b.c_str(), m.epoch_step, m.epoch_steps, m.loss, human_rate(m.samples_per_s).c_str(),
                   human_time(eta).c_str());
      std::fflush(stderr);
    } else if (lines_) {
      // A line at each quarter of an epoch.
      const std::size_t quarter = std::max<std::size_t>(1, m.epoch_steps / 4);
      if (m.epoch_step % quarter != 0 || m.epoch_step == m.epoch_steps) return;
      std::fprintf(stderr, "epoch %d/%d  step %zu/%zu  loss %.4f  %s samples/s  ETA %s\n", m.epoch, epochs_,
                   m.epoch_step, m.epoch_steps, m.loss, human_rate(m.samples_per_s).c_str(), human_time(eta).c_str());
    }
  }
  void on_epoch(const train::EpochMetrics& m) override {
    if (!bar_ && !lines_) return;
    std::string avg;
    if (m.averaged)
      avg = str("  averaged: test_loss ", fixed4(m.avg_test_loss), "  test_accuracy ", fixed4(m.avg_test_accuracy));
    std::fprintf(stderr, "%sepoch %d/%d  train_loss %s  test_loss %s  test_accuracy %s%s  %s samples/s  %s%s\n",
                 bar_ ? "\r" : "", m.epoch, epochs_, fixed4(m.train_loss).c_str(), fixed4(m.test_loss).c_str(),
                 fixed4(m.test_accuracy).c_str(), avg.c_str(), human_rate(m.samples_per_s).c_str(),
                 human_time(m.wall_s).c_str(), bar_ ? "\x1b[K" : "");
  }
  // Warnings print whatever the progress mode, on a line of their own.
  void on_warning(const std::string& what) override {
    std::fprintf(stderr, "%sdistopt: warning: %s\n", bar_ ? "\r\x1b[K" : "", printable(what.c_str()).c_str());
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool bar_, lines_;
  int epochs_ = 0;
  std::size_t steps_ = 0;
  Clock::time_point start_, last_draw_;
};

// Where an output is written: through a symbolic link to its target (the
// temporary file goes beside the target and is renamed onto it).
std::string output_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = path;
  // Follow links by hand: a link to a file not written yet is dangling,
  // and weakly_canonical would stop at it.
  for (int hops = 0; hops < 40 && fs::is_symlink(p, ec); ++hops) {
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) break;
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  const auto real = fs::weakly_canonical(p, ec);
  return ec ? p.string() : real.string();
}

// Metrics per step and per epoch, as JSON lines (default) or CSV (a name
// ending in .csv). Written to NAME.tmp.<pid> and renamed at the end, so an
// earlier file of that name is replaced only by a complete one.
class MetricsFile final : public train::Observer {
 public:
  explicit MetricsFile(const std::string& path)
      : path_(output_path(path)),
        tmp_(path_ + ".tmp." + std::to_string(::getpid())),
        csv_(path_.size() >= 4 && path_.compare(path_.size() - 4, 4, ".csv") == 0),
        out_(tmp_) {
    if (!out_) throw IoError(str(path_, ": cannot create ", tmp_));
    if (csv_)
      out_ << "kind,epoch,step,wall_s,loss,lr,samples_per_s,train_loss,test_loss,test_accuracy,grad_norm,loss_scale,"
              "skipped,avg_test_loss,avg_test_accuracy,consensus_distance\n";
  }
  ~MetricsFile() override {
    if (!done_) {
      out_.close();
      std::filesystem::remove(tmp_);
    }
  }
  void on_step(const train::StepMetrics& m) override {
    // Clipping and loss scaling add their figures; absent ones stay empty
    // (CSV) or are left out (JSON).
    const bool has_norm = !(m.grad_norm < 0);  // NaN too: clipping is on
    const bool has_scale = m.loss_scale > 0;
    char b[384];
    if (csv_) {
      char norm[32] = "", scale[32] = "";
      if (has_norm) std::snprintf(norm, sizeof norm, "%s", std::isfinite(m.grad_norm) ? jnum(m.grad_norm).c_str() : "");
      if (has_scale) std::snprintf(scale, sizeof scale, "%.9g", m.loss_scale);
      std::snprintf(b, sizeof b, "step,%d,%zu,%.6f,%s,%s,%.6g,,,,%s,%s,%s,,,\n", m.epoch, m.step, m.wall_s,
                    cnum(m.loss).c_str(), cnum(m.lr).c_str(), m.samples_per_s, norm, scale,
                    has_scale ? (m.skipped ? "1" : "0") : "");
    } else {
      std::string extra;
      if (has_norm) extra += str(", \"grad_norm\": ", jnum(m.grad_norm));
      if (has_scale)
        extra += str(", \"loss_scale\": ", jnum(m.loss_scale), ", \"skipped\": ", m.skipped ? "true" : "false");
      std::snprintf(b, sizeof b,
                    "{\"kind\": \"step\", \"epoch\": %d, \"step\": %zu, \"wall_s\": %.6f, \"loss\": %s, \"lr\": "
                    "%s, \"samples_per_s\": %.6g%s}\n",
                    m.epoch, m.step, m.wall_s, jnum(m.loss).c_str(), jnum(m.lr).c_str(), m.samples_per_s, extra.c_str());
    }
    out_ << b;
    // At least once a second, so that a killed run leaves recent lines.
    const auto now = std::chrono::steady_clock::now();
    if (now - last_flush_ >= std::chrono::seconds(1)) {
      out_.flush();
      last_flush_ = now;
    }
  }
  void on_epoch(const train::EpochMetrics& m) override {
    char avg[96] = "";
    char b[448];
    if (csv_) {
      if (m.averaged)
        std::snprintf(avg, sizeof avg, "%s,%s", cnum(m.avg_test_loss).c_str(), cnum(m.avg_test_accuracy).c_str());
      std::snprintf(b, sizeof b, "epoch,%d,%zu,%.6f,,,%.6g,%s,%s,%s,,,,%s,%s\n", m.epoch, m.step, m.wall_s,
                    m.samples_per_s, cnum(m.train_loss).c_str(), cnum(m.test_loss).c_str(),
                    cnum(m.test_accuracy).c_str(), m.averaged ? avg : ",", cnum(m.consensus_distance).c_str());
    } else {
      if (m.averaged)
        std::snprintf(avg, sizeof avg, ", \"avg_test_loss\": %s, \"avg_test_accuracy\": %s",
                      jnum(m.avg_test_loss).c_str(), jnum(m.avg_test_accuracy).c_str());
      std::snprintf(b, sizeof b,
                    "{\"kind\": \"epoch\", \"epoch\": %d, \"step\": %zu, \"wall_s\": %.6f, \"samples_per_s\": %.6g, "
                    "\"train_loss\": %s, \"test_loss\": %s, \"test_accuracy\": %s%s%s}\n",
                    m.epoch, m.step, m.wall_s, m.samples_per_s, jnum(m.train_loss).c_str(), jnum(m.test_loss).c_str(),
                    jnum(m.test_accuracy).c_str(), avg,
                    std::isnan(m.consensus_distance)
                        ? ""
                        : str(", \"consensus_distance\": ", jnum(m.consensus_distance)).c_str());
    }
    out_ << b;
    out_.flush();
  }
  // Removes the temporary file only (a stuck rank may still hold this object).
  void discard() { std::remove(tmp_.c_str()); }
  void finish() {
    out_.close();
    if (!out_) throw IoError(str(path_, ": write failed"));
    std::error_code ec;
    std::filesystem::rename(tmp_, path_, ec);
    if (ec) throw IoError(str(path_, ": cannot replace: ", ec.message()));
    done_ = true;
  }

 private:
  std::string path_, tmp_;
  bool csv_;
  std::ofstream out_;
  bool done_ = false;
  std::chrono::steady_clock::time_point last_flush_ = std::chrono::steady_clock::now();
};

class Both final : public train::Observer {
 public:
  Both(train::Observer* a, train::Observer* b) : a_(a), b_(b) {}
  void on_start(int e, std::size_t s) override {
    for (auto* o : {a_, b_})
      if (o) o->on_start(e, s);
  }
  void on_step(const train::StepMetrics& m) override {
    for (auto* o : {a_, b_})
      if (o) o->on_step(m);
  }
  void on_epoch(const train::EpochMetrics& m) override {
    for (auto* o : {a_, b_})
      if (o) o->on_epoch(m);
  }
  void on_warning(const std::string& w) override {
    for (auto* o : {a_, b_})
      if (o) o->on_warning(w);
  }

 private:
  train::Observer *a_, *b_;
};

double parse_number(const std::string& flag, const std::string& text) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(v))
    throw InvalidInput(str("--", flag, ": '", text, "' is not a finite number"));
  return v;
}

// Optimizer options from their command-line text, typed by the rule's spec.
OptionMap parse_options(const RuleInfo& rule, const std::map<std::string, std::string>& given) {
  OptionMap out;
  for (const auto& [name, text] : given) {
    std::string flag = name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : rule.options)
      if (s.name == name) spec = &s;
    if (spec == nullptr) throw InvalidInput(str("--", flag, " is not an option of optimizer ", rule.name));
    switch (spec->default_value.kind()) {
      case OptionValue::Kind::number:
        out[name] = parse_number(flag, text);
        break;
      case OptionValue::Kind::flag:
        if (text == "true" || text == "1" || text.empty()) out[name] = true;
        else if (text == "false" || text == "0") out[name] = false;
        else throw InvalidInput(str("--", flag, ": '", text, "' is not true or false"));
        break;
      case OptionValue::Kind::pair: {
        const auto comma = text.find(',');
        if (comma == std::string::npos)
          throw InvalidInput(str("--", flag, ": '", text, "' is not a pair like 0.9,0.999"));
        out[name] = OptionValue(parse_number(flag, text.substr(0, comma)), parse_number(flag, text.substr(comma + 1)));
        break;
      }
      case OptionValue::Kind::triple: {
        const auto a = text.find(','), b = a == std::string::npos ? a : text.find(',', a + 1);
        if (b == std::string::npos || text.find(',', b + 1) != std::string::npos)
          throw InvalidInput(str("--", flag, ": '", text, "' is not three numbers like 3.4445,-4.775,2.0315"));
        out[name] = OptionValue(parse_number(flag, text.substr(0, a)), parse_number(flag, text.substr(a + 1, b - a - 1)),
                                parse_number(flag, text.substr(b + 1)));
        break;
      }
      case OptionValue::Kind::word:
        if (text.empty() || !OptionValue::word_fits(text))
          throw InvalidInput(str("--", flag, ": '", text, "' is not one of the option's words"));
        out[name] = OptionValue(std::string_view(text));
        break;
    }
  }
  return out;
}

// --scheduler NAME with --scheduler-option KEY=VALUE (a number, true/false,
// a comma list of numbers, or a word), or --scheduler '{JSON spec}'.
SchedulerSpec parse_scheduler(const TrainArgs& a) {
  if (!a.scheduler.empty() && a.scheduler.front() == '{') {
    if (!a.scheduler_options.empty())
      throw InvalidInput("--scheduler-option cannot be combined with a JSON --scheduler (put options in its JSON)");
    return replay::parse_scheduler_spec(a.scheduler, "--scheduler");
  }
  SchedulerSpec spec;
  spec.name = a.scheduler;
  for (const std::string& kv : a.scheduler_options) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      throw InvalidInput(str("--scheduler-option: '", kv, "' is not KEY=VALUE"));
    const std::string key = kv.substr(0, eq), text = kv.substr(eq + 1);
    const std::string flag = "scheduler-option " + key;
    if (text == "true" || text == "false") {
      spec.options[key] = text == "true";
    } else if (text.find(',') != std::string::npos) {
      std::vector<double> list;
      std::size_t begin = 0;
      for (;;) {
        const auto comma = text.find(',', begin);
        list.push_back(parse_number(flag, text.substr(begin, comma - begin)));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
      spec.options[key] = std::move(list);
    } else if (!text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '-' ||
                                 text[0] == '.' || text[0] == '+')) {
      spec.options[key] = parse_number(flag, text);
    } else {
      spec.options[key] = text;
    }
  }
  return spec;
}

// --warmup-steps W: lr * (t + 1) / W for the first W steps (LinearLR from
// 1/W over W - 1 steps), then cosine decay to 0 over the rest of the run
// (CosineAnnealingLR), as SequentialLR -- what nanoGPT and most transformer
// recipes run. The run's length is known once the data is.
void warmup_cosine(TrainArgs& a, const data::Split& d) {
  if (a.warmup_steps == 0) return;
  const std::size_t per_epoch =
      data::BatchSampler(d.train.size(), a.config.batch_size, a.config.seed, a.config.drop_last).batches_per_epoch();
  std::size_t total = static_cast<std::size_t>(a.config.epochs) * per_epoch;
  if (a.config.max_steps > 0) total = std::min<std::size_t>(total, a.config.max_steps);
  if (a.warmup_steps >= total)
    throw InvalidInput(str("--warmup-steps ", a.warmup_steps, " leaves nothing of the run's ", total,
                           " steps to decay over"));
  const auto w = static_cast<double>(a.warmup_steps);
  SchedulerSpec warm{"linearlr", {{"start_factor", 1.0 / w}, {"end_factor", 1.0}, {"total_iters", std::max(w - 1, 1.0)}}, {}};
  SchedulerSpec cosine{"cosineannealinglr", {{"T_max", static_cast<double>(total - a.warmup_steps)}, {"eta_min", 0.0}}, {}};
  a.config.scheduler = SchedulerSpec{"sequentiallr", {{"milestones", std::vector<double>{w}}}, {warm, cosine}};
  a.config.scheduler_per_epoch = false;
}

// Features and outputs of a data set (Fashion-MNIST's and the synthetic
// classification set's are the same): what load_data makes and check_memory sizes.
struct DataDims {
  std::size_t features, outputs;
};
bool is_text(const std::string& data) { return data == "fortunes" || data == "text"; }

DataDims dims_of(const TrainArgs& a) {
  if (a.data == "synthetic-regression") return {32, 1};
  if (is_text(a.data)) return {a.config.gpt.context + 1, 256};
  return {784, 10};
}

// Data sets and models that cannot go together, and --data-file without
// --data text: one line before anything is read.
void check_data_and_model(TrainArgs& a) {
  const bool gpt = a.config.model == "gpt";
  if (gpt && !a.data_given && a.data == "fashion-mnist") a.data = "fortunes";  // gpt's own default
  if (gpt && !is_text(a.data))
    throw InvalidInput(str("--model gpt reads text: use --data fortunes or --data text --data-file PATH (not --data ", a.data, ")"));
  if (!gpt && is_text(a.data))
    throw InvalidInput(str("--data ", a.data, " is text: it needs --model gpt (not --model ", a.config.model, ")"));
  if (a.data == "text" && a.data_file.empty()) throw InvalidInput("--data text needs --data-file PATH");
  if (a.data != "text" && !a.data_file.empty()) throw InvalidInput("--data-file goes with --data text");
}

data::Split load_data(const TrainArgs& a, const std::string& model) {
  const DataDims dims = dims_of(a);
  if (a.data == "fashion-mnist") return data::load_fashion_mnist(a.data_dir.empty() ? data::default_fashion_mnist_dir() : a.data_dir);
  if (a.data == "fortunes")
    return data::text_split(data::load_fortunes(a.data_dir.empty() ? data::default_fortunes_dir() : a.data_dir),
                            a.config.gpt.context, a.config.seed, a.test_size);
  if (a.data == "text") return data::text_split(data::load_text_file(a.data_file), a.config.gpt.context, a.config.seed, a.test_size);
  if (a.data == "synthetic")
    return data::make_synthetic_classification(dims.features, dims.outputs, a.train_size, a.test_size, a.config.seed);
  if (a.data == "synthetic-regression")
    return data::make_synthetic_regression(dims.features, a.train_size, a.test_size, 0.1, a.config.seed);
  (void)model;
  throw InvalidInput(str("unknown data set '", a.data, "' (known: fashion-mnist, synthetic, synthetic-regression, fortunes, text)"));
}

std::string summary_json(const train::TrainResult& r, const TrainArgs& a, int world) {
  char b[1024];
  std::snprintf(b, sizeof b,
                "{\"test_accuracy\": %s, \"test_loss\": %s, \"train_loss\": %s, \"steps\": %zu, \"param_hash\": "
                "\"%s\", \"samples_per_s\": %.6g, \"memory_per_rank\": {\"params\": %zu, \"grads\": %zu, "
                "\"master_params\": %zu, \"optimizer_state\": %zu}, \"model\": \"%s\", \"data\": \"%s\", "
                "\"optimizer\": \"%s\", \"strategy\": \"%s\", \"backend\": \"%s\", \"world\": %d, \"epochs\": %d, "
                "\"batch_size\": %zu, \"seed\": %llu, \"param_dtype\": \"%s\", \"bytes_sent_per_rank\": %llu, "
                "\"interrupted\": %s}",
                jnum(r.test_accuracy).c_str(), jnum(r.test_loss).c_str(), jnum(r.train_loss).c_str(), r.steps, r.param_hash.c_str(),
                r.samples_per_s, r.memory.params, r.memory.grads, r.memory.master_params, r.memory.optimizer_state,
                a.config.model.c_str(), a.data.c_str(), a.config.optimizer.name.c_str(), a.config.strategy.c_str(),
                a.backend.c_str(), world, a.config.epochs, a.config.batch_size,
                static_cast<unsigned long long>(a.config.seed), a.param_dtype.c_str(),
                static_cast<unsigned long long>(r.bytes_sent), r.interrupted ? "true" : "false");
  std::string out = b;
  out.pop_back();  // the closing brace; optional members follow
  if (a.config.on_nonfinite != train::TrainConfig::OnNonFinite::error)
    out += str(", \"nonfinite_steps\": ", r.nonfinite_steps);
  if (!std::isnan(r.consensus_distance)) out += str(", \"consensus_distance\": ", jnum(r.consensus_distance));
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
               ", \"heads\": ", a.config.gpt.heads, ", \"dim\": ", a.config.gpt.dim, ", \"context\": ", a.config.gpt.context,
               ", \"parameters\": ", r.params.size(), ", \"threads\": ", a.config.threads,
               ", \"matmul_precision\": \"", a.matmul_precision, "\"}");
  }
  if (r.checkpoints_written > 0 || a.config.resume)
    out += str(", \"checkpoints\": {\"written\": ", r.checkpoints_written, ", \"seconds\": ", jnum(r.checkpoint_seconds),
               ", \"last_bytes\": ", r.checkpoint_bytes, ", \"resume_load_s\": ", jnum(a.resume_load_seconds), "}");
  if (r.averaged) {
    char m[320];
    std::snprintf(m, sizeof m,
                  ", \"averaged\": {\"kind\": \"%s\", \"n_averaged\": %lld, \"test_accuracy\": %s, \"test_loss\": "
                  "%s, \"param_hash\": \"%s\"}",
                  std::string(averaging_name(r.averaged->kind)).c_str(),
                  static_cast<long long>(r.averaged->n_averaged), jnum(r.averaged->test_accuracy).c_str(),
                  jnum(r.averaged->test_loss).c_str(),
                  r.averaged->param_hash.c_str());
    out += m;
  }
  return out + "}";
}

void print_result(const train::TrainResult& r, const TrainArgs& a, int world) {
  if (a.json) {
    std::printf("%s\n", summary_json(r, a, world).c_str());
  } else if (a.config.model == "gpt") {
    std::printf("gpt on %s, %s, %s, world %d: val_loss %s (%s bits/byte)  train_loss %s  steps %zu%s  %s tokens/s  "
                "param_hash %s\n",
                a.data.c_str(), a.config.optimizer.name.c_str(), a.config.strategy.c_str(), world,
                fixed4(r.test_loss).c_str(), fixed4(r.test_loss / std::log(2.0)).c_str(), fixed4(r.train_loss).c_str(),
                r.steps, r.interrupted ? " (interrupted)" : "",
                human_rate(r.samples_per_s * static_cast<double>(a.config.gpt.context)).c_str(), r.param_hash.c_str());
  } else {
    std::printf("%s on %s, %s, %s, world %d: test_accuracy %s  test_loss %s  train_loss %s  steps %zu%s  %s "
                "samples/s  param_hash %s\n",
                a.config.model.c_str(), a.data.c_str(), a.config.optimizer.name.c_str(), a.config.strategy.c_str(),
                world, fixed4(r.test_accuracy).c_str(), fixed4(r.test_loss).c_str(), fixed4(r.train_loss).c_str(),
                r.steps, r.interrupted ? " (interrupted)" : "", human_rate(r.samples_per_s).c_str(),
                r.param_hash.c_str());
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
               r.stop_signal == SIGINT ? "SIGINT" : r.stop_signal == SIGTERM ? "SIGTERM" : "a signal", r.steps);
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

// Fails now rather than after a long run.
void check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) throw InvalidInput(str(flag, " needs a file name (got an empty one)"));
  const auto real = std::filesystem::path(output_path(path));
  if (std::filesystem::is_directory(real)) throw InvalidInput(str(flag, " ", path, ": is a folder, not a file"));
  const auto parent = std::filesystem::absolute(real).parent_path();
  if (!std::filesystem::is_directory(parent) || ::access(parent.c_str(), W_OK) != 0)
    throw IoError(str(flag, " ", path, ": cannot create (folder ", parent.string(), " is missing or not writable)"));
}

// Outputs are written to NAME.tmp.<pid> and renamed; a run killed by
// SIGKILL (or a second Ctrl-C) leaves that file behind. Before writing
// NAME, remove the ones whose process no longer exists on this machine.
void remove_stale_temp_files(const std::string& output) {
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
      std::fprintf(stderr, "distopt: removed %s, left by an earlier run (process %d) that was killed\n",
                   printable(entry.path().string().c_str()).c_str(), static_cast<int>(pid));
  }
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

std::string gigabytes(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GB", bytes / 1e9);
  return b;
}

// Sizes the command line asks for, against this machine's memory, before
// anything is allocated: one line naming the flag instead of bad_alloc.
void check_memory(const TrainArgs& a, int world) {
  const double have = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE));
  if (!(have > 0)) return;
  const DataDims dims = dims_of(a);
  const auto features = static_cast<double>(dims.features);
  if (a.config.model == "gpt") {
    // Parameters, gradients and optimizer state on every rank, and the
    // activations each rank keeps for backward (its share of a batch).
    const models::GptShape& g = a.config.gpt;
    const double D = double(g.dim), T = double(g.context), L = double(g.layers);
    const double params = 12 * L * D * D + (256 + T) * D;
    const double per_sample = T * (L * (17 * D + double(g.heads) * T) + 256 + 8 * D);
    const double rank_batch = std::ceil(double(a.config.batch_size) / world);
    const double bytes = (params * 5 + per_sample * rank_batch) * 4 * world;
    if (bytes > have)
      throw InvalidInput(str("model gpt with --layers ", g.layers, " --dim ", g.dim, " --context ", g.context,
                             " and --batch-size ", a.config.batch_size, " needs ", gigabytes(bytes), " at ", world,
                             world == 1 ? " rank" : " ranks", " (this machine has ", gigabytes(have), ")"));
    return;
  }
  if (a.data != "fashion-mnist") {
    const double bytes = (double(a.train_size) + double(a.test_size)) * (features + 1) * 4;
    if (bytes > have / 2)
      throw InvalidInput(str("--train-size ", a.train_size, " and --test-size ", a.test_size, " need ", gigabytes(bytes),
                             " for the synthetic data (this machine has ", gigabytes(have), ")"));
  }
  // Parameters, gradients and up to three state tensors of 4 bytes, on every
  // rank of the process (ddp holds them all).
  std::vector<double> widths{features};
  if (a.config.model == "mlp")
    for (double h : a.config.hidden.empty() ? std::vector<std::size_t>{256, 128} : a.config.hidden) widths.push_back(h);
  widths.push_back(static_cast<double>(dims.outputs));
  double params = 0, largest = 0;
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    const double layer = widths[l] * widths[l + 1] + widths[l + 1];
    params += layer;
    largest = std::max(largest, layer);
  }
  const double bytes = params * 4 * 5 * world;
  if (largest * 4 > have / 4 || bytes > have)
    throw InvalidInput(str(a.config.hidden.empty() ? "the model" : "--hidden", " needs ", gigabytes(largest * 4),
                           " for one layer and ", gigabytes(bytes), " for parameters, gradients and optimizer state at ",
                           world, world == 1 ? " rank" : " ranks", " (this machine has ", gigabytes(have), ")"));
}

const std::set<std::string> kGossipFlags = {"--topology",           "--peers-per-iteration", "--synch-freq",
                                             "--slowmo-base",        "--localsgd-frequency",  "--slowmo-frequency",
                                             "--slowmo-momentum",    "--slowmo-lr"};

// Why a gossip flag does not apply to strategy `s` (with that slowmo base),
// or "" when it does.
std::string gossip_flag_misfit(const std::string& flag, const std::string& s, const std::string& slowmo_base) {
  const parallel::StrategyInfo* info = parallel::find_strategy(s);
  if (info == nullptr || !info->per_rank_models)
    return str(flag, " applies to the gossip strategies (sgp, osgp, dpsgd, adpsgd, slowmo), not --strategy ", s);
  if (flag == "--synch-freq" && s != "osgp" && s != "adpsgd")
    return str("--synch-freq applies to --strategy osgp and adpsgd, not ", s);
  if ((flag.rfind("--slowmo", 0) == 0 || flag == "--localsgd-frequency") && s != "slowmo")
    return str(flag, " applies to --strategy slowmo, not ", s);
  if (flag == "--localsgd-frequency" && slowmo_base != "localsgd")
    return "--localsgd-frequency applies to --slowmo-base localsgd";
  if ((flag == "--topology" || flag == "--peers-per-iteration") && s == "slowmo" && slowmo_base == "localsgd")
    return "--topology applies to slowmo with --slowmo-base sgp (local SGD averages exactly)";
  return {};
}

// Gossip options with a strategy that does not use them: an error, not a
// silent no-op.
void check_gossip_flags(const TrainArgs& a) {
  const std::string& s = a.config.strategy;
  for (const std::string& flag : a.gossip_flags)
    if (const std::string why = gossip_flag_misfit(flag, s, a.config.parallel.gossip.slowmo_base); !why.empty())
      throw InvalidInput(why);
  const std::string& topology = a.config.parallel.gossip.topology;
  const auto names = gossip::topology_names();
  if (!topology.empty() && std::find(names.begin(), names.end(), topology) == names.end())
    (void)gossip::Topology(topology, 1);  // throws, listing the known names
}

int run_train(TrainArgs& a) {
  const RuleInfo& rule = rule_or_throw(a.config.optimizer.name);
  a.config.optimizer.options = parse_options(rule, a.option_text);
  rule.validate(resolve_options(rule, a.config.optimizer.options));
  parallel::require_exact(a.config.strategy, rule);  // one clear error before any data is read
  if (!rule.companion.empty()) {
    // Muon takes matrices only: the rest (biases) go to adamw with its
    // defaults, as torch's Muon documentation tells users to do.
    a.config.optimizer.fallback = std::string(rule.companion);
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr || std::string(rank) == "0")
      std::fprintf(stderr, "distopt: %s takes the weight matrices; the other parameters (biases) go to a second "
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
  if (a.matmul_precision != "f32" && a.config.model != "gpt")
    throw InvalidInput(str("--matmul-precision applies to --model gpt; model ", a.config.model,
                           " multiplies in float32"));
  if (a.matmul_precision == "bf16" && !models::bf16_products_native()) {
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr || std::string(rank) == "0")
      std::fprintf(stderr, "distopt: --matmul-precision bf16: this CPU has no bfloat16 matrix instructions "
                           "(AVX512-BF16 or AMX); oneDNN emulates them, slower than f32\n");
  }
  if (a.param_dtype == "f32") a.config.parallel.param_dtype = DType::f32;
  else if (a.param_dtype == "bf16") a.config.parallel.param_dtype = DType::bf16;
  else if (a.param_dtype == "f16") a.config.parallel.param_dtype = DType::f16;
  else throw InvalidInput(str("--param-dtype: unknown dtype '", a.param_dtype, "' (known: f32, bf16, f16)"));
  if (!(a.bucket_cap_mb > 0) || !std::isfinite(a.bucket_cap_mb))
    throw InvalidInput(str("--bucket-cap-mb must be a positive number of MiB (got ", a.bucket_cap_mb, ")"));
  a.config.parallel.bucket_elements = std::max<std::size_t>(
      1, static_cast<std::size_t>(a.bucket_cap_mb * 1048576.0 / double(size_of(a.config.parallel.param_dtype))));
  if (a.scheduler.empty() && !a.scheduler_options.empty())
    throw InvalidInput("--scheduler-option needs --scheduler");
  if (a.warmup_steps > 0 && !a.scheduler.empty())
    throw InvalidInput("--warmup-steps is a schedule of its own (linear warm-up, then cosine decay): drop --scheduler, "
                       "or build the schedule in --scheduler's JSON");
  if (!a.scheduler.empty()) {
    a.config.scheduler = parse_scheduler(a);
    a.config.scheduler_per_epoch = a.scheduler_interval == "epoch";
    // Build it once on a stand-in parameter: bad names and options fail now.
    // A 1 x 1 matrix: every rule takes it (muon refuses vectors).
    float p = 0, g = 0;
    Optimizer probe(a.config.optimizer.name, {Param{"probe", {&p, DType::f32, {1, 1}}, {&g, DType::f32, {1, 1}}, false}},
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
  if (a.clip_norm_type == "inf")
    a.config.clip_norm_type = std::numeric_limits<double>::infinity();
  else
    a.config.clip_norm_type = parse_number("clip-norm-type", a.clip_norm_type);
  if (a.loss_scale == "dynamic") {
    a.config.loss_scale = a.scaler;
  } else if (a.scaler_option_given) {
    throw InvalidInput("--init-scale, --growth-factor, --backoff-factor and --growth-interval need --loss-scale dynamic");
  }
  if (a.on_nonfinite == "warn") a.config.on_nonfinite = train::TrainConfig::OnNonFinite::warn;
  else if (a.on_nonfinite == "ignore") a.config.on_nonfinite = train::TrainConfig::OnNonFinite::ignore;
  const std::chrono::milliseconds timeout =
      a.comm_timeout.empty() ? Communicator::default_timeout() : Communicator::parse_timeout(a.comm_timeout, "--comm-timeout");
  LinkModel link;
  link.bandwidth_bps = parse_bandwidth("--link-bandwidth", a.link_bandwidth);
  link.latency_s = a.link_latency;
  if (!(link.latency_s >= 0 && std::isfinite(link.latency_s)))
    throw InvalidInput(str("--link-latency must be a non-negative number of seconds (got ", a.link_latency, ")"));
  const bool tty = ::isatty(2) != 0;
  const bool bar = a.progress == "bar" || (a.progress == "auto" && tty);
  const bool lines = a.progress == "lines" || (a.progress == "auto" && !tty);

  // Started by Open MPI's mpirun: the MPI backend, whatever was (not) said.
  // Without it every process would train its own copy and exit 0.
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
  if (a.backend == "mpi") {
    auto world = open_mpi_world();
    Communicator& comm = world->comm();
    comm.set_timeout(timeout);
    comm.set_link_model(link);
    const StopOnSignal stop(comm.rank() == 0);
    a.config.stop_flag = &stop.flag();
    std::optional<MetricsFile> metrics;
    try {
      if (a.world_given && a.world != comm.size())
        throw InvalidInput(str("--world ", a.world, " disagrees with the ", comm.size(),
                               " processes mpirun started (under --backend mpi the world is mpirun's -np)"));
      check_memory(a, 1);
      const data::Split data = load_data(a, a.config.model);
      warmup_cosine(a, data);
      Progress progress(bar, lines);
      if (comm.rank() == 0 && !a.metrics.empty()) metrics.emplace(a.metrics);
      Both both(&progress, metrics ? &*metrics : nullptr);
      const train::TrainResult r = train::train(comm, data, a.config, &both);
      if (comm.rank() == 0) {
        if (metrics) metrics->finish();
        export_params(r, a);
        print_result(r, a, comm.size());
        report_stop(r);
      }
      comm.barrier();
      return r.interrupted ? StopOnSignal::exit_code(r.stop_signal) : 0;
    } catch (const NonFiniteError& e) {
      // Every rank stopped at the same step with the same finding: no abort,
      // one line, the metrics up to that step kept.
      if (comm.rank() == 0) {
        if (metrics) metrics->finish();
        std::fprintf(stderr, "distopt: error: %s\n", printable(e.what()).c_str());
      }
      return 4;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "distopt: error (rank %d): %s\n", comm.rank(), printable(e.what()).c_str());
      std::fflush(stderr);
      metrics.reset();  // MPI_Abort skips destructors: remove the temporary file now
      world->abort(2);
    }
  }

  if (a.world < 1) throw InvalidInput(str("--world must be at least 1 (got ", a.world, ")"));
  check_memory(a, a.world);
  if (a.config.batch_size < static_cast<std::size_t>(a.world))
    throw InvalidInput(str("batch size ", a.config.batch_size, " is smaller than the world size ", a.world,
                           ": every rank needs at least one sample per step"));
  const StopOnSignal stop(true);
  a.config.stop_flag = &stop.flag();
  const data::Split data = load_data(a, a.config.model);
  warmup_cosine(a, data);
  Progress progress(bar, lines);
  std::optional<MetricsFile> metrics;
  if (!a.metrics.empty()) metrics.emplace(a.metrics);
  Both both(&progress, metrics ? &*metrics : nullptr);
  train::TrainResult result;
  try {
    spawn(
        a.world,
        [&](Communicator& comm) {
          comm.set_link_model(link);
          train::TrainResult r = train::train(comm, data, a.config, &both);
          if (comm.rank() == 0) result = std::move(r);
        },
        timeout);
  } catch (const NonFiniteError&) {
    if (metrics) metrics->finish();  // the steps up to the divergence
    throw;
  } catch (const RanksAbandoned& e) {
    exit_abandoned(e, [&] {
      if (metrics) metrics->discard();
    });
  }
  if (metrics) metrics->finish();
  export_params(result, a);
  print_result(result, a, a.world);
  report_stop(result);
  return result.interrupted ? StopOnSignal::exit_code(result.stop_signal) : 0;
}

}  // namespace

// --resume: the latest complete checkpoint in --checkpoint-dir, verified;
// the run's flags from its manifest where the command line (or --config)
// did not give them; the flags that would make it meaningless refused, the
// ones that change the run reported.
void load_resume(CLI::App& command, TrainArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  if (a.config.checkpoint_dir.empty()) throw InvalidInput("--resume needs --checkpoint-dir");
  auto loaded = std::make_shared<checkpoint::Loaded>(checkpoint::load_latest(a.config.checkpoint_dir));
  const std::filesystem::path* latest = &loaded->dir;
  const nlohmann::json saved = nlohmann::json::parse(loaded->config);
  const nlohmann::json given = nlohmann::json::parse(effective_config(command));
  for (const auto& [key, value] : given.items()) {
    const CLI::Option* opt = command.get_option_no_throw("--" + key);
    if (opt == nullptr || opt->count() == 0 || (saved.contains(key) && saved[key] == value)) continue;
    static const std::set<std::string> kMeaning = {"model",  "hidden", "data",  "train-size", "test-size", "optimizer",
                                                   "seed",   "layers", "heads", "dim",        "context",   "data-file"};
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
  const CLI::Option* strategy = command.get_option_no_throw("--strategy");
  if (strategy != nullptr && strategy->count() > 0) {
    const std::string base = given.value("slowmo-base", saved.value("slowmo-base", std::string("localsgd")));
    for (const auto& [key, value] : saved.items())
      if (kGossipFlags.count("--" + key) && !gossip_flag_misfit("--" + key, a.config.strategy, base).empty())
        carried.erase(key);
  }
  apply_config_text(command, carried.dump(), (*latest / "manifest.json").string());
  a.config.resume = std::move(loaded);
  a.resume_load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Hidden widths: neither negative nor zero.
const CLI::Validator positive_counts(
    [](std::string& v) -> std::string {
      if (!v.empty() && (v[0] == '-' || v.find_first_not_of('0') == std::string::npos))
        return "must be positive integers (got " + v + ")";
      return {};
    },
    "N>0");

Runner add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "train a built-in model on a data set (threads backend by default)");
  train::TrainConfig& c = a->config;
  sub->add_option("--model", c.model,
                  "mlp (784-256-128-10, ReLU; default), logreg, linreg, gpt (a GPT-2-style transformer on bytes: "
                  "--data fortunes or text)")->capture_default_str();
  sub->add_option("--hidden", c.hidden, "mlp hidden widths (default 256,128)")->delimiter(',')
      ->check(positive_counts);
  sub->add_option("--data", a->data,
                  "fashion-mnist (default), synthetic, synthetic-regression; text for --model gpt: fortunes "
                  "(Debian's fortunes package; gpt's default), text (--data-file)")
      ->capture_default_str()
      ->each([a](const std::string&) { a->data_given = true; });
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
                  "parameters), or gossip: sgp, osgp, dpsgd, adpsgd, slowmo (docs/gossip.md)")
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
  sub->add_option("--link-bandwidth", a->link_bandwidth,
                  "emulate a network link per rank of this many bits per second (e.g. 100M, 1G; default none)");
  sub->add_option("--link-latency", a->link_latency, "emulated link latency in seconds (default 0)");
  sub->add_option("--param-dtype", a->param_dtype,
                  "parameters and gradients in f32 (default), bf16 or f16, with fp32 master weights and state");
  sub->add_option("--bucket-cap-mb", a->bucket_cap_mb,
                  "gradient bucket size in MiB (default 0.125): buckets of whole layers reduced while backward runs");
  sub->add_option("--world", a->world, "ranks of the threads backend (default 1)")
      ->each([a](const std::string&) { a->world_given = true; });
  sub->add_option("--backend", a->backend,
                  "threads (default) or mpi (world size from mpirun; chosen by itself under mpirun)")
      ->each([a](const std::string&) { a->backend_given = true; })
      ->check(CLI::IsMember({"threads", "mpi"}));
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
  sub->add_option("--swa-lr", c.swa_lr, "with --swa-start: SWALR anneals the lr to this value, per epoch, from then on");
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
      sub->add_option_function<std::string>(names, [a, name](const std::string& v) { a->option_text[name] = v; },
                                            std::string("optimizer option ") + name);
    }
  sub->add_option("--checkpoint-dir", c.checkpoint_dir,
                  "write checkpoints under DIR (DIR/step-N/: a file per rank and a manifest; docs/formats.md)");
  sub->add_option("--checkpoint-every", c.checkpoint_every,
                  "steps between checkpoints (default 0: only one when training ends)")
      ->check(non_negative("integer"));
  sub->add_option("--keep-checkpoints", c.keep_checkpoints, "the newest checkpoints kept in --checkpoint-dir (default 3)")
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
    a->config.checkpoint_run = effective_config(*sub);
    if (a->print_config) {
      std::fputs(effective_config(*sub).c_str(), stdout);
      return 0;
    }
    return run_train(*a);
  };
}

}  // namespace distopt::cli
