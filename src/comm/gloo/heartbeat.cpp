// The gloo backend's heartbeat: the thread that beats and, with each
// beat, looks for members that left the group; see heartbeat.hpp.
#include "heartbeat.hpp"

#include <exception>
#include <string>

namespace distopt::gloo_detail {

void Shared::watch_for_leavers() {
  if (elastic != Elastic::on) return;
  int now = 0;
  {
    std::unique_lock lock(m, std::try_to_lock);
    if (!lock.owns_lock()) return;
    now = epoch;
  }
  const std::string leaver = read_or_empty(*store, str("leaving/", now + 1));
  if (!leaver.empty())
    abort_upto(now, str("first rank ", leaver, " left the group to re-form it (it lost a peer)"), true);
}

void Shared::start_beating() {
  beater = std::thread([this] {
    std::uint64_t beat = 0;
    std::unique_lock lock(beat_m);
    while (!stop_beating) {
      lock.unlock();
      try {
        store->set(str("hb/", first), bytes_of(std::to_string(++beat)));
      } catch (const std::exception&) {
        // A full disk or a vanished directory: the others will see this
        // process as silent, which is what it then is to them.
      }
      try {
        watch_for_leavers();
      } catch (const std::exception&) {
        // (the rendezvous unreadable: its own waits end at the time-out)
      }
      lock.lock();
      beat_cv.wait_for(lock, kBeat, [&] { return stop_beating; });
    }
  });
}

Shared::~Shared() {
  {
    std::lock_guard lock(beat_m);
    stop_beating = true;
  }
  beat_cv.notify_all();
  if (beater.joinable()) beater.join();
}

}  // namespace distopt::gloo_detail
