// `distopt train`'s observers of a run (on the process holding rank 0):
// progress on stderr and the metrics file (docs/formats.md), and the
// number formatting they share with the summary (observers.cpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <string>

#include "distopt/train/trainer.hpp"

namespace distopt::cli {

// 1234567 -> "1.23M", 1234 -> "1.2k".
std::string human_rate(double r);
// A figure for people: four decimals, or n/a where nothing was measured.
std::string fixed4(double v);
// Seconds as m:ss or h:mm:ss.
std::string human_time(double s);
// A float for CSV: %.9g, or an empty field where nothing was measured or
// the value is not finite.
std::string cnum(double v);
// Where an output is written: through a symbolic link to its target (the
// temporary file goes beside the target and is renamed onto it).
std::string output_path(const std::string& path);

// Progress on stderr: a redrawn bar on a terminal, plain lines otherwise.
class Progress final : public train::Observer {
 public:
  Progress(bool bar, bool lines) : bar_(bar), lines_(lines) {}
  void on_start(int epochs, std::size_t steps) override;
  void on_step(const train::StepMetrics& m) override;
  void on_epoch(const train::EpochMetrics& m) override;
  // Warnings print whatever the progress mode, on a line of their own.
  void on_warning(const std::string& what) override;
  void on_membership(const train::MembershipChange& c) override;

 private:
  using Clock = std::chrono::steady_clock;
  bool bar_, lines_;
  int epochs_ = 0;
  std::size_t steps_ = 0;
  Clock::time_point start_, last_draw_;
};

// Metrics per step and per epoch, as JSON lines (default) or CSV (a name
// ending in .csv). Written to NAME.tmp.<pid> and renamed at the end, so an
// earlier file of that name is replaced only by a complete one.
class MetricsFile final : public train::Observer {
 public:
  explicit MetricsFile(const std::string& path);
  ~MetricsFile() override;  // removes the temporary file unless finished
  void on_step(const train::StepMetrics& m) override;
  void on_epoch(const train::EpochMetrics& m) override;
  // JSON lines only: {"kind": "membership", ...} (docs/formats.md).
  void on_membership(const train::MembershipChange& c) override;
  // Removes the temporary file only (a stuck rank may still hold this object).
  void discard() { std::remove(tmp_.c_str()); }
  // Closes the file and renames it onto its name.
  void finish();

 private:
  std::string path_, tmp_;
  bool csv_;
  std::ofstream out_;
  bool done_ = false;
  std::chrono::steady_clock::time_point last_flush_ = std::chrono::steady_clock::now();
};

}  // namespace distopt::cli
