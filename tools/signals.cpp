#include "signals.hpp"

#include <unistd.h>

#include <cstring>

namespace distopt::cli {

namespace {

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the handler needs a lock-free flag");
bool g_announce = false;

void write_all(const char* text) {
  std::size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(2, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Async-signal-safe: an atomic exchange, write(2) and _exit only.
extern "C" void on_signal(int sig) {
  int none = 0;
  if (!g_signal.compare_exchange_strong(none, sig)) ::_exit(StopOnSignal::exit_code(sig));
  if (g_announce)
    write_all(sig == SIGINT ? "\ndistopt: interrupted (SIGINT): stopping after this step; press Ctrl-C again to quit at "
                              "once\n"
                            : "\ndistopt: terminated (SIGTERM): stopping after this step\n");
}

}  // namespace

StopOnSignal::StopOnSignal(bool announce) {
  g_signal.store(0);
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
