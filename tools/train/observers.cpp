// `distopt train`'s observers (observers.hpp): progress, the metrics file,
// and the formatting and output paths they share with the summary.
#include "observers.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "../commands.hpp"

namespace distopt::cli {

std::string human_rate(double r) {
  char b[32];
  if (r >= 1e6) std::snprintf(b, sizeof b, "%.2fM", r / 1e6);
  else if (r >= 1e3) std::snprintf(b, sizeof b, "%.1fk", r / 1e3);
  else std::snprintf(b, sizeof b, "%.0f", r);
  return b;
}

// A float for CSV: %.9g, or an empty field where nothing was measured or
// the value is not finite.
std::string cnum(double v) {
  return std::isfinite(v) ? jnum(v) : std::string();
}

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

void Progress::on_start(int epochs, std::size_t steps) {
  epochs_ = epochs;
  steps_ = steps;
  start_ = Clock::now();
}

void Progress::on_step(const train::StepMetrics& m) {
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
    std::fprintf(stderr, "epoch %d/%d  step %zu/%zu  loss %.4f  %s samples/s  ETA %s\n", m.epoch, epochs_, m.epoch_step,
                 m.epoch_steps, m.loss, human_rate(m.samples_per_s).c_str(), human_time(eta).c_str());
  }
}

void Progress::on_epoch(const train::EpochMetrics& m) {
  if (!bar_ && !lines_) return;
  std::string avg;
  if (m.averaged)
    avg = str("  averaged: test_loss ", fixed4(m.avg_test_loss), "  test_accuracy ", fixed4(m.avg_test_accuracy));
  std::fprintf(stderr, "%sepoch %d/%d  train_loss %s  test_loss %s  test_accuracy %s%s  %s samples/s  %s%s\n",
               bar_ ? "\r" : "", m.epoch, epochs_, fixed4(m.train_loss).c_str(), fixed4(m.test_loss).c_str(),
               fixed4(m.test_accuracy).c_str(), avg.c_str(), human_rate(m.samples_per_s).c_str(),
               human_time(m.wall_s).c_str(), bar_ ? "\x1b[K" : "");
}

void Progress::on_warning(const std::string& what) {
  std::fprintf(stderr, "%sdistopt: warning: %s\n", bar_ ? "\r\x1b[K" : "", printable(what.c_str()).c_str());
}

namespace {
std::string rank_list(const std::vector<int>& ranks, const char* sep) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : sep) + std::to_string(r);
  return out;
}
}  // namespace

void Progress::on_membership(const train::MembershipChange& c) {
  if (c.lost.empty()) {
    std::fprintf(stderr, "%sdistopt: rank(s) %s joined after step %zu; %d ranks go on from step %zu (%.2f s)\n",
                 bar_ ? "\r\x1b[K" : "", rank_list(c.joined, ", ").c_str(), c.step, c.world, c.step, c.seconds);
    return;
  }
  const std::string back =
      c.steps_redone == 0 ? ""
      : c.step == 0       ? str(" (back to the start, no checkpoint yet: ", c.steps_redone, " steps again)")
                          : str(" (back to the checkpoint of step ", c.step, ": ", c.steps_redone, " steps again)");
  std::fprintf(stderr, "%sdistopt: rank(s) %s lost after step %zu; %d ranks go on from step %zu%s (%.2f s lost): %s\n",
               bar_ ? "\r\x1b[K" : "", rank_list(c.lost, ", ").c_str(), c.step + c.steps_redone, c.world, c.step,
               back.c_str(), c.seconds, printable(c.reason.c_str()).c_str());
}

MetricsFile::MetricsFile(const std::string& path)
    : path_(output_path(path)),
      tmp_(path_ + ".tmp." + std::to_string(::getpid())),
      csv_(path_.size() >= 4 && path_.compare(path_.size() - 4, 4, ".csv") == 0),
      out_(tmp_) {
  if (!out_) throw IoError(str(path_, ": cannot create ", tmp_));
  if (csv_)
    out_ << "kind,epoch,step,wall_s,loss,lr,samples_per_s,train_loss,test_loss,test_accuracy,grad_norm,loss_scale,"
            "skipped,avg_test_loss,avg_test_accuracy,consensus_distance,bytes_sent\n";
}

MetricsFile::~MetricsFile() {
  if (!done_) {
    out_.close();
    std::filesystem::remove(tmp_);
  }
}

void MetricsFile::on_step(const train::StepMetrics& m) {
  // Clipping and loss scaling add their figures; absent ones stay empty
  // (CSV) or are left out (JSON).
  const bool has_norm = !(m.grad_norm < 0);  // NaN too: clipping is on
  const bool has_scale = m.loss_scale > 0;
  char b[384];
  if (csv_) {
    char norm[32] = "", scale[32] = "";
    if (has_norm) std::snprintf(norm, sizeof norm, "%s", std::isfinite(m.grad_norm) ? jnum(m.grad_norm).c_str() : "");
    if (has_scale) std::snprintf(scale, sizeof scale, "%.9g", m.loss_scale);
    std::snprintf(b, sizeof b, "step,%d,%zu,%.6f,%s,%s,%.6g,,,,%s,%s,%s,,,,%llu\n", m.epoch, m.step, m.wall_s,
                  cnum(m.loss).c_str(), cnum(m.lr).c_str(), m.samples_per_s, norm, scale,
                  has_scale ? (m.skipped ? "1" : "0") : "", static_cast<unsigned long long>(m.bytes_sent));
  } else {
    std::string extra;
    if (has_norm) extra += str(", \"grad_norm\": ", jnum(m.grad_norm));
    if (has_scale)
      extra += str(", \"loss_scale\": ", jnum(m.loss_scale), ", \"skipped\": ", m.skipped ? "true" : "false");
    std::snprintf(b, sizeof b,
                  "{\"kind\": \"step\", \"epoch\": %d, \"step\": %zu, \"wall_s\": %.6f, \"loss\": %s, \"lr\": "
                  "%s, \"samples_per_s\": %.6g, \"bytes_sent\": %llu%s}\n",
                  m.epoch, m.step, m.wall_s, jnum(m.loss).c_str(), jnum(m.lr).c_str(), m.samples_per_s,
                  static_cast<unsigned long long>(m.bytes_sent), extra.c_str());
  }
  out_ << b;
  // At least once a second, so that a killed run leaves recent lines.
  const auto now = std::chrono::steady_clock::now();
  if (now - last_flush_ >= std::chrono::seconds(1)) {
    out_.flush();
    last_flush_ = now;
  }
}

void MetricsFile::on_epoch(const train::EpochMetrics& m) {
  char avg[96] = "";
  char b[448];
  if (csv_) {
    if (m.averaged)
      std::snprintf(avg, sizeof avg, "%s,%s", cnum(m.avg_test_loss).c_str(), cnum(m.avg_test_accuracy).c_str());
    std::snprintf(b, sizeof b, "epoch,%d,%zu,%.6f,,,%.6g,%s,%s,%s,,,,%s,%s,\n", m.epoch, m.step, m.wall_s,
                  m.samples_per_s, cnum(m.train_loss).c_str(), cnum(m.test_loss).c_str(), cnum(m.test_accuracy).c_str(),
                  m.averaged ? avg : ",", cnum(m.consensus_distance).c_str());
  } else {
    if (m.averaged)
      std::snprintf(avg, sizeof avg, ", \"avg_test_loss\": %s, \"avg_test_accuracy\": %s",
                    jnum(m.avg_test_loss).c_str(), jnum(m.avg_test_accuracy).c_str());
    std::snprintf(
        b, sizeof b,
        "{\"kind\": \"epoch\", \"epoch\": %d, \"step\": %zu, \"wall_s\": %.6f, \"samples_per_s\": %.6g, "
        "\"train_loss\": %s, \"test_loss\": %s, \"test_accuracy\": %s%s%s}\n",
        m.epoch, m.step, m.wall_s, m.samples_per_s, jnum(m.train_loss).c_str(), jnum(m.test_loss).c_str(),
        jnum(m.test_accuracy).c_str(), avg,
        std::isnan(m.consensus_distance) ? "" : str(", \"consensus_distance\": ", jnum(m.consensus_distance)).c_str());
  }
  out_ << b;
  out_.flush();
}

void MetricsFile::on_membership(const train::MembershipChange& c) {
  if (csv_) return;
  out_ << str("{\"kind\": \"membership\", \"step\": ", c.step, ", \"steps_redone\": ", c.steps_redone,
              ", \"world_before\": ", c.world_before,
              ", \"world\": ", c.world, ", \"lost\": [", rank_list(c.lost, ", "), "], \"joined\": [",
              rank_list(c.joined, ", "), "], \"seconds\": ", jnum(c.seconds),
              "}\n");
  out_.flush();
}

void MetricsFile::finish() {
  out_.close();
  if (!out_) throw IoError(str(path_, ": write failed"));
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  if (ec) throw IoError(str(path_, ": cannot replace: ", ec.message()));
  done_ = true;
}

}  // namespace distopt::cli
