// SIGINT and SIGTERM for long-running verbs: the first one asks the work to
// stop at its next step boundary (a flag the trainer polls); a second one,
// half a second or more after the first, ends the process at once with
// 128 + the signal's number (sooner, it is the first one sent twice, as GNU
// timeout does, and changes nothing).
#pragma once

#include <atomic>
#include <csignal>

namespace distopt::cli {

class StopOnSignal {
 public:
  // Installs the handlers; `announce`: the first signal prints one line on
  // stderr (rank 0 only, so that an MPI job says it once).
  explicit StopOnSignal(bool announce);
  ~StopOnSignal();  // restores the previous handlers
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  // The signal number once one arrived, else 0.
  const std::atomic<int>& flag() const;
  // The shell's convention: 130 for SIGINT, 143 for SIGTERM.
  static int exit_code(int signal) { return 128 + signal; }

 private:
  struct sigaction old_int_, old_term_;
};

}  // namespace distopt::cli
