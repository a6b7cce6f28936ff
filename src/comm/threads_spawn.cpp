// spawn() of the threads backend (include/distopt/comm/threads.hpp): runs
// each rank of a new world on its own thread and ends the run -- aborts the
// world when a rank fails (or, Elastic::on, goes on without it), abandons
// ranks that do not stop, and rethrows the failure that caused the others.
#include "distopt/comm/threads.hpp"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "threads_impl.hpp"

namespace distopt {

using threads_detail::seconds;
using threads_detail::World;

SpawnResult spawn(int n, const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout,
                  Elastic elastic) {
  // Shared with the rank threads, so that an abandoned one (below) never
  // touches freed memory of this function.
  struct State {
    std::vector<std::unique_ptr<Communicator>> comms;
    std::function<void(Communicator&)> fn;
    std::vector<std::exception_ptr> errors;
    // One byte per rank: ranks write their own entries concurrently (a
    // vector<bool> packs them into shared words, a data race).
    std::vector<unsigned char> consequence, finished;
    std::mutex m;
    std::condition_variable cv;
    int running = 0;
  };
  auto st = std::make_shared<State>();
  st->comms = make_threads_world(n, elastic);
  st->fn = fn;
  st->errors.resize(n);
  st->consequence.assign(n, 0);
  st->finished.assign(n, 0);
  World& world = threads_detail::world_of(*st->comms[0]);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    st->comms[r]->set_timeout(timeout);
    auto body = [st, r, &world = world] {
      const auto finish = [&] {
        std::lock_guard lock(st->m);
        st->finished[r] = 1;
        --st->running;
        st->cv.notify_all();
      };
      // A rank that fails: the others go on without it (elastic), or stop.
      // It counts as ended before they can see it fail, so that survivors
      // done with the run never find it still running and abandon it.
      const auto failed = [&](const std::string& what) {
        st->errors[r] = std::current_exception();
        finish();
        if (world.elastic) world.lose({r});
        else world.abort(what);
      };
      try {
        st->fn(*st->comms[r]);
      } catch (const CommAborted&) {
        st->errors[r] = std::current_exception();
        st->consequence[r] = 1;
        finish();
        return;
      } catch (const std::exception& e) {
        failed(str("rank ", r, " failed: ", e.what()));
        return;
      } catch (...) {
        failed(str("rank ", r, " failed"));
        return;
      }
      finish();
    };
    try {
      {
        std::lock_guard lock(st->m);
        ++st->running;
      }
      threads.emplace_back(body);
    } catch (const std::system_error& e) {
      // The system refused another thread (a memory or process limit): wake
      // the ranks that started, join them, and say so in one line.
      {
        std::lock_guard lock(st->m);
        --st->running;
      }
      world.abort(str("rank ", r, " could not start"));
      for (auto& t : threads) t.join();
      throw CommError(str("cannot start ", n, " ranks as threads: thread ", r + 1, " of ", n,
                          " failed to start (", e.what(), "); use fewer ranks (--world) or raise the limit"));
    }
  }
  // Every rank ends, or the world aborts and the ranks that can see it end;
  // one that has not ended kAbandonAfter later is stuck outside the
  // communicator and is left behind. Once a rank has ended, the others have
  // the time-out (plus kAbandonAfter) to end too: after the last collective nothing is left to
  // wait for, so one that does not is stalled (the world is aborted with
  // that reason, and it is abandoned as above).
  //
  // Elastic: the run is over once every rank not lost has ended; lost ranks
  // still running then (stalled) are abandoned without an error, and a
  // rank that has not ended the time-out after the first one did is lost.
  auto over = [&] {
    if (st->running == 0) return true;
    if (!world.elastic) return false;
    for (int r = 0; r < n; ++r)
      if (!st->finished[r] && !world.lost[r]) return false;
    return true;
  };
  // The others' grace once one has ended: the time-out, plus kAbandonAfter
  // so that a rank waiting in a communicator call begun just before (a
  // mismatched collective, a recv) ends with that call's own time-out.
  const auto grace = timeout + kAbandonAfter;
  std::vector<int> stuck, abandoned;
  {
    std::unique_lock lock(st->m);
    // Elastic: the clock starts when a rank not lost ends well (a failing
    // rank ends too, and the survivors go on for as long as they train).
    auto ended_well = [&] {
      for (int r = 0; r < n; ++r)
        if (st->finished[r] && !st->errors[r] && !world.lost[r]) return true;
      return false;
    };
    if (world.elastic) {
      // A loss (World::lose) does not notify st->cv: poll for it gently.
      while (!ended_well() && !over() && !world.aborted) st->cv.wait_for(lock, std::chrono::milliseconds(50));
    } else {
      st->cv.wait(lock, [&] { return st->running < n || world.aborted.load(); });
    }
    if (world.elastic) {
      const auto until = std::chrono::steady_clock::now() + grace;
      while (!over() && !world.aborted && std::chrono::steady_clock::now() < until)
        st->cv.wait_for(lock, std::chrono::milliseconds(50));
      if (!over() && !world.aborted) {
        std::vector<int> late;
        for (int r = 0; r < n; ++r)
          if (!st->finished[r] && !world.lost[r]) late.push_back(r);
        lock.unlock();
        world.lose(late);
        lock.lock();
      }
      for (int r = 0; r < n; ++r)
        if (!st->finished[r]) abandoned.push_back(r);
    } else if (!st->cv.wait_for(lock, grace, [&] { return st->running == 0 || world.aborted.load(); })) {
      std::string late, done;
      for (int r = 0; r < n; ++r) {
        std::string& list = st->finished[r] ? done : late;
        list += (list.empty() ? "" : ", ") + std::to_string(r);
      }
      lock.unlock();
      world.abort(str("rank(s) ", late, " did not end within ", seconds(grace), " of rank(s) ", done,
                      " (threads backend)"));
      lock.lock();
    }
    // (An elastic world that went on has listed its lost ranks still running.)
    if (!(world.elastic && !world.aborted) && !st->cv.wait_for(lock, kAbandonAfter, [&] { return st->running == 0; }))
      for (int r = 0; r < n; ++r)
        if (!st->finished[r]) stuck.push_back(r);
  }
  for (int r = 0; r < n; ++r) {
    if (std::find(stuck.begin(), stuck.end(), r) != stuck.end() ||
        std::find(abandoned.begin(), abandoned.end(), r) != abandoned.end())
      threads[r].detach();
    else
      threads[r].join();
  }
  if (world.elastic && !world.aborted) {
    // The survivors went on: the run is theirs, unless none of them ended
    // well. Read under the lock, and nothing of an abandoned rank (it may
    // still write its entries).
    std::exception_ptr first;
    {
      std::lock_guard lock(st->m);
      for (int r = 0; r < n; ++r) {
        if (std::find(abandoned.begin(), abandoned.end(), r) != abandoned.end()) continue;
        if (!st->errors[r]) return SpawnResult{abandoned};
        if (!first) first = st->errors[r];
      }
    }
    if (!abandoned.empty()) {
      if (first) std::rethrow_exception(first);
      throw RanksAbandoned("every rank was lost");
    }
  }
  if (!stuck.empty()) {
    std::string who;
    for (int r : stuck) who += (who.empty() ? "" : ", ") + std::to_string(r);
    std::string reason;
    {
      std::lock_guard lock(world.m);
      reason = world.reason;
    }
    throw RanksAbandoned(str(reason, "; rank(s) ", who, " did not stop within ",
                        seconds(std::chrono::duration_cast<std::chrono::milliseconds>(kAbandonAfter)),
                        " and were abandoned"));
  }
  st->comms.clear();
  for (int r = 0; r < n; ++r)
    if (st->errors[r] && !st->consequence[r]) std::rethrow_exception(st->errors[r]);
  for (int r = 0; r < n; ++r)
    if (st->errors[r]) std::rethrow_exception(st->errors[r]);
  return {};
}

}  // namespace distopt
