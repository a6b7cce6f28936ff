#include "signals.hpp"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace distopt::cli {

namespace {

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the handler needs a lock-free flag");
// When the first signal arrived (CLOCK_MONOTONIC, ns; 0: none yet).
std::atomic<long long> g_first_ns{0};
static_assert(std::atomic<long long>::is_always_lock_free, "the handler needs a lock-free time");
bool g_announce = false;

// One request, sent twice: GNU timeout signals the command and then its
// process group, so the command can receive the same SIGTERM twice within
// microseconds. A repeat this soon after the first is not the user's
// second signal.
constexpr long long kRepeatNs = 500'000'000;

void write_all(const char* text) {
  std::size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(2, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Async-signal-safe: clock_gettime, atomics, write(2) and _exit only. The
// time decides which signal is the first, also when two arrive at once on
// two threads.
extern "C" void on_signal(int sig) {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  const long long t = std::max(1LL, static_cast<long long>(now.tv_sec) * 1'000'000'000LL + now.tv_nsec);
  long long first = 0;
  if (!g_first_ns.compare_exchange_strong(first, t)) {
    if (t - first < kRepeatNs) return;  // the same request again
    ::_exit(StopOnSignal::exit_code(sig));
  }
  g_signal.store(sig);
  if (g_announce)
    write_all(sig == SIGINT ? "\ndistopt: interrupted (SIGINT): stopping after this step; press Ctrl-C again to quit at "
                              "once\n"
                            : "\ndistopt: terminated (SIGTERM): stopping after this step\n");
}

}  // namespace

StopOnSignal::StopOnSignal(bool announce) {
  g_signal.store(0);
  g_first_ns.store(0);
  g_announce = announce;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

StopOnSignal::~StopOnSignal() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

const std::atomic<int>& StopOnSignal::flag() const { return g_signal; }

}  // namespace distopt::cli
