// A fixed pool of worker threads for data-parallel loops.
//
// parallel_for(n, fn) calls fn(i) once for every i in [0, n). Items are
// handed out dynamically (one atomic counter), the calling thread works too,
// and the call returns when every item is done. An exception thrown by fn is
// rethrown in the caller after all threads stopped (the first one wins; the
// remaining items are skipped). A pool of size 1 runs everything inline.
// One parallel_for at a time per pool: calls from several threads serialize.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace distopt {

class ThreadPool {
 public:
  // `num_threads` counts the caller: 1 means no worker thread. 0 picks
  // std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads = 1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  template <class Fn>
  void parallel_for(std::size_t n, Fn&& fn) {
    if (n == 0) return;
    if (workers_.empty() || n == 1) {
      for (std::size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    run(n, &fn, [](void* f, std::size_t i) { (*static_cast<std::remove_reference_t<Fn>*>(f))(i); });
  }

 private:
  using Invoker = void (*)(void*, std::size_t);
  void run(std::size_t n, void* fn, Invoker invoke);
  void work();           // takes items of the current job until none are left
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  int busy_ = 0;  // workers still inside the current job

  // The current job.
  void* fn_ = nullptr;
  Invoker invoke_ = nullptr;
  std::size_t count_ = 0;
  std::atomic<std::size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

}  // namespace distopt
