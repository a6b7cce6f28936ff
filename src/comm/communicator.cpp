#include "distopt/comm/communicator.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace distopt {

std::chrono::milliseconds Communicator::parse_timeout(const std::string& seconds, const std::string& what) {
  std::size_t used = 0;
  double s = 0;
  try {
    s = std::stod(seconds, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  constexpr double kYear = 365.0 * 24 * 3600;
  if (used == 0 || used != seconds.size() || !(s > 0) || !(s <= kYear))
    throw InvalidInput(str(what, ": '", seconds, "' is not a number of seconds in (0, one year]"));
  return std::chrono::milliseconds(std::max<long long>(1, std::llround(s * 1000)));
}

std::chrono::milliseconds Communicator::default_timeout() {
  const char* env = std::getenv("DISTOPT_COMM_TIMEOUT");
  if (env == nullptr || *env == '\0') return kDefaultTimeout;
  return parse_timeout(env, "DISTOPT_COMM_TIMEOUT");
}

struct Communicator::Task {
  std::function<void()> fn;
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    std::lock_guard lock(m);
    error = e;
    done = true;
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return done; });
    if (error) std::rethrow_exception(error);
  }
};

class Communicator::TaskRequest : public Request {
 public:
  explicit TaskRequest(std::shared_ptr<Task> t) : task_(std::move(t)) {}
  bool test() override {
    std::lock_guard lock(task_->m);
    if (task_->done && task_->error) std::rethrow_exception(task_->error);
    return task_->done;
  }
  // The task carries the communicator's deadlines itself, so this returns.
  void wait() override { task_->wait(); }

 private:
  std::shared_ptr<Task> task_;
};

Communicator::~Communicator() { stop_progress(); }

namespace {
// Point-to-point messages carry their arrival time under a shifted tag.
constexpr int kStampTag = Communicator::kMaxTag;
}  // namespace

void Communicator::count_sent(std::size_t bytes) {
  bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
  if (on_collective_thread_.load(std::memory_order_relaxed) == std::this_thread::get_id())
    collective_bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

void Communicator::set_link_model(const LinkModel& link) {
  if (!(link.bandwidth_bps >= 0 && std::isfinite(link.bandwidth_bps)))
    throw InvalidInput(str("link bandwidth must be a non-negative number of bits per second (got ", link.bandwidth_bps,
                           ")"));
  if (!(link.latency_s >= 0 && std::isfinite(link.latency_s)))
    throw InvalidInput(str("link latency must be a non-negative number of seconds (got ", link.latency_s, ")"));
  link_ = link;
}

Communicator::Clock::time_point Communicator::reserve_link(std::size_t bytes) {
  std::lock_guard lock(link_mutex_);
  const double seconds = link_.bandwidth_bps > 0 ? static_cast<double>(bytes) * 8.0 / link_.bandwidth_bps : 0.0;
  const auto duration = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  const auto latency = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(link_.latency_s));
  // Small messages (control, a step's loss) do not queue behind bulk
  // transfers, as separate streams share a real link; bulk ones queue.
  if (bytes <= kSmallMessage) return Clock::now() + duration + latency;
  const auto start = std::max(Clock::now(), link_free_);
  link_free_ = start + duration;
  return link_free_ + latency;
}

void Communicator::timed(const std::function<void()>& fn) {
  const auto start = Clock::now();
  struct Add {
    std::atomic<std::uint64_t>& ns;
    Clock::time_point start;
    ~Add() {
      ns.fetch_add(static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - start).count()),
                   std::memory_order_relaxed);
    }
  } add{busy_ns_, start};
  // The bytes this collective sends: counted while it runs on this thread,
  // whatever other threads send meanwhile (one collective runs at a time).
  on_collective_thread_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  const std::uint64_t before = collective_bytes_.load(std::memory_order_relaxed);
  fn();
  on_collective_thread_.store(std::thread::id(), std::memory_order_relaxed);
  // Emulated link: the collective ends once this rank's bytes have crossed it.
  if (link_.active())
    std::this_thread::sleep_until(reserve_link(collective_bytes_.load(std::memory_order_relaxed) - before));
}

// A send on an emulated link: the payload, then its arrival time; done once
// the payload has left this rank's link.
class Communicator::EmulatedSend final : public Request {
 public:
  EmulatedSend(std::unique_ptr<Request> payload, std::unique_ptr<std::int64_t> stamp, std::unique_ptr<Request> stamp_req,
               Clock::time_point left)
      : payload_(std::move(payload)), stamp_(std::move(stamp)), stamp_req_(std::move(stamp_req)), left_(left) {}
  ~EmulatedSend() override {
    try {
      if (stamp_req_) stamp_req_->wait();  // its buffer is ours
    } catch (...) {
    }
  }
  bool test() override { return payload_->test() && stamp_req_->test() && Clock::now() >= left_; }
  void wait() override {
    payload_->wait();
    stamp_req_->wait();
    std::this_thread::sleep_until(left_);
  }

 private:
  std::unique_ptr<Request> payload_;
  std::unique_ptr<std::int64_t> stamp_;
  std::unique_ptr<Request> stamp_req_;
  Clock::time_point left_;
};

// A receive on an emulated link: done at the arrival time the sender set.
class Communicator::EmulatedRecv final : public Request {
 public:
  EmulatedRecv(std::unique_ptr<Request> payload, std::unique_ptr<std::int64_t> stamp, std::unique_ptr<Request> stamp_req)
      : payload_(std::move(payload)), stamp_(std::move(stamp)), stamp_req_(std::move(stamp_req)) {}
  bool test() override {
    return stamp_req_->test() && payload_->test() && Clock::now() >= arrival();
  }
  void wait() override {
    stamp_req_->wait();
    payload_->wait();
    std::this_thread::sleep_until(arrival());
  }

 private:
  Clock::time_point arrival() const { return Clock::time_point(Clock::duration(*stamp_)); }
  std::unique_ptr<Request> payload_;
  std::unique_ptr<std::int64_t> stamp_;
  std::unique_ptr<Request> stamp_req_;
};

void Communicator::stop_progress() {
  {
    std::lock_guard lock(queue_mutex_);
    if (!progress_.joinable()) return;
    stop_ = true;
  }
  queue_cv_.notify_all();
  progress_.join();
}

namespace {
bool is_comm_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CommError&) {
    return true;
  } catch (...) {
    return false;
  }
}
}  // namespace

void Communicator::progress_loop() {
  for (;;) {
    std::shared_ptr<Task> task;
    std::exception_ptr error_before;
    {
      std::unique_lock lock(queue_mutex_);
      queue_cv_.wait(lock, [&] { return !queue_.empty() || stop_; });
      if (queue_.empty()) return;  // stop requested and nothing left
      task = queue_.front();
      queue_.pop_front();
      busy_ = true;
      error_before = broken_;
    }
    // After a communication failure the communicator is broken: what is
    // queued behind it fails at once with that failure, instead of each
    // operation waiting out its own timeout.
    std::exception_ptr error = error_before;
    if (!error) {
      try {
        timed(task->fn);
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard lock(queue_mutex_);
      busy_ = false;
      if (error && !broken_ && is_comm_error(error)) broken_ = error;
    }
    queue_cv_.notify_all();
    task->finish(error);
  }
}

std::unique_ptr<Request> Communicator::enqueue(std::function<void()> fn) {
  auto task = std::make_shared<Task>();
  task->fn = std::move(fn);
  {
    std::lock_guard lock(queue_mutex_);
    if (!progress_.joinable()) progress_ = std::thread([this] { progress_loop(); });
    queue_.push_back(task);
  }
  queue_cv_.notify_all();
  return std::make_unique<TaskRequest>(std::move(task));
}

void Communicator::run_ordered(std::function<void()> fn) {
  std::shared_ptr<Task> task;
  {
    std::lock_guard lock(queue_mutex_);
    if (broken_) std::rethrow_exception(broken_);
    if (!queue_.empty() || busy_) {  // pending non-blocking collectives go first
      task = std::make_shared<Task>();
      task->fn = std::move(fn);
      queue_.push_back(task);
    }
  }
  if (!task) {
    try {
      timed(fn);
    } catch (const CommError&) {
      std::lock_guard lock(queue_mutex_);
      if (!broken_) broken_ = std::current_exception();
      throw;
    }
    return;
  }
  queue_cv_.notify_all();
  task->wait();
}

void Communicator::check_rank(int r, const char* what) const {
  if (r < 0 || r >= size()) throw InvalidInput(str(what, ": rank ", r, " is outside the communicator (size ", size(), ")"));
}

namespace {
void check_op(const char* what, ElemType type, ReduceOp op) {
  if (op == ReduceOp::avg && !is_floating(type))
    throw InvalidInput(str(what, ": op avg needs a floating-point type, got ", name_of(type)));
}

std::vector<std::size_t> equal_counts(int n, std::size_t c) { return std::vector<std::size_t>(n, c); }
}  // namespace

// The determinism contract: reduce-scatter of the pieces, then all-gather.
void Communicator::all_reduce_now(const void* send, void* recv, std::size_t count, ElemType type, ReduceOp op) {
  const int n = size();
  std::vector<std::size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = piece_of(count, n, r).count;
  char* mine = static_cast<char*>(recv) + piece_of(count, n, rank()).offset * size_of(type);
  do_reduce_scatter_v(send, mine, counts, type, op);
  do_all_gather_v(mine, recv, counts, type);
}

void Communicator::all_reduce(const void* send, void* recv, std::size_t count, ElemType type, ReduceOp op) {
  check_op("all_reduce", type, op);
  run_ordered([=, this] { all_reduce_now(send, recv, count, type, op); });
}

void Communicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count, ElemType type, ReduceOp op) {
  check_op("reduce_scatter", type, op);
  run_ordered([=, this] { do_reduce_scatter_v(send, recv, equal_counts(size(), recv_count), type, op); });
}

void Communicator::reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type,
                                    ReduceOp op) {
  check_op("reduce_scatter_v", type, op);
  if (counts.size() != static_cast<std::size_t>(size()))
    throw InvalidInput(str("reduce_scatter_v: ", counts.size(), " counts for ", size(), " ranks"));
  std::vector<std::size_t> c(counts.begin(), counts.end());
  run_ordered([=, this] { do_reduce_scatter_v(send, recv, c, type, op); });
}

void Communicator::all_gather(const void* send, void* recv, std::size_t send_count, ElemType type) {
  run_ordered([=, this] { do_all_gather_v(send, recv, equal_counts(size(), send_count), type); });
}

void Communicator::all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type) {
  if (counts.size() != static_cast<std::size_t>(size()))
    throw InvalidInput(str("all_gather_v: ", counts.size(), " counts for ", size(), " ranks"));
  std::vector<std::size_t> c(counts.begin(), counts.end());
  run_ordered([=, this] { do_all_gather_v(send, recv, c, type); });
}

void Communicator::all_to_all(const void* send, void* recv, std::size_t count, ElemType type) {
  run_ordered([=, this] { do_all_to_all(send, recv, count * size_of(type)); });
}

void Communicator::broadcast(void* buf, std::size_t count, ElemType type, int root) {
  check_rank(root, "broadcast");
  run_ordered([=, this] { do_broadcast(buf, count * size_of(type), root); });
}

namespace {
template <class Bytes>
void broadcast_sized(Communicator& comm, Bytes& bytes, int root) {
  std::uint64_t n = bytes.size();
  comm.broadcast(&n, 1, ElemType::i64, root);
  bytes.resize(static_cast<std::size_t>(n));
  comm.broadcast(bytes.data(), bytes.size(), ElemType::u8, root);
}
}  // namespace

void Communicator::broadcast_bytes(std::string& bytes, int root) { broadcast_sized(*this, bytes, root); }
void Communicator::broadcast_bytes(std::vector<char>& bytes, int root) { broadcast_sized(*this, bytes, root); }

void Communicator::barrier() {
  run_ordered([this] { do_barrier(); });
}

void Communicator::send(const void* buf, std::size_t count, ElemType type, int peer, int tag) {
  isend(buf, count, type, peer, tag)->wait();
}

void Communicator::recv(void* buf, std::size_t count, ElemType type, int peer, int tag) {
  irecv(buf, count, type, peer, tag)->wait();
}

std::unique_ptr<Request> Communicator::isend(const void* buf, std::size_t count, ElemType type, int peer, int tag) {
  check_rank(peer, "send");
  if (!link_.active()) return do_isend(buf, count * size_of(type), peer, tag);
  if (tag < 0 || tag >= kMaxTag) throw InvalidInput(str("send: tag ", tag, " is outside [0, 2^20) of an emulated link"));
  const std::size_t bytes = count * size_of(type);
  const Clock::time_point arrival = reserve_link(bytes);
  const Clock::time_point left = arrival - std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(link_.latency_s));
  auto payload = do_isend(buf, bytes, peer, tag);
  auto stamp = std::make_unique<std::int64_t>(arrival.time_since_epoch().count());
  auto stamp_req = do_isend(stamp.get(), sizeof(std::int64_t), peer, tag + kStampTag);
  bytes_sent_.fetch_sub(sizeof(std::int64_t), std::memory_order_relaxed);  // the emulator's, not the user's
  return std::make_unique<EmulatedSend>(std::move(payload), std::move(stamp), std::move(stamp_req), left);
}

std::unique_ptr<Request> Communicator::irecv(void* buf, std::size_t count, ElemType type, int peer, int tag) {
  check_rank(peer, "recv");
  if (!link_.active()) return do_irecv(buf, count * size_of(type), peer, tag);
  if (tag < 0 || tag >= kMaxTag) throw InvalidInput(str("recv: tag ", tag, " is outside [0, 2^20) of an emulated link"));
  auto stamp = std::make_unique<std::int64_t>(0);
  auto stamp_req = do_irecv(stamp.get(), sizeof(std::int64_t), peer, tag + kStampTag);
  auto payload = do_irecv(buf, count * size_of(type), peer, tag);
  return std::make_unique<EmulatedRecv>(std::move(payload), std::move(stamp), std::move(stamp_req));
}

std::unique_ptr<Request> Communicator::iall_reduce(const void* send, void* recv, std::size_t count, ElemType type,
                                                   ReduceOp op) {
  check_op("iall_reduce", type, op);
  return enqueue([=, this] { all_reduce_now(send, recv, count, type, op); });
}

std::unique_ptr<Request> Communicator::ireduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                                       ElemType type, ReduceOp op) {
  check_op("ireduce_scatter", type, op);
  return enqueue([=, this] { do_reduce_scatter_v(send, recv, equal_counts(size(), recv_count), type, op); });
}

std::unique_ptr<Request> Communicator::iall_gather(const void* send, void* recv, std::size_t send_count,
                                                   ElemType type) {
  return enqueue([=, this] { do_all_gather_v(send, recv, equal_counts(size(), send_count), type); });
}

std::unique_ptr<Request> Communicator::iall_to_all(const void* send, void* recv, std::size_t count, ElemType type) {
  return enqueue([=, this] { do_all_to_all(send, recv, count * size_of(type)); });
}

std::unique_ptr<Request> Communicator::ibroadcast(void* buf, std::size_t count, ElemType type, int root) {
  check_rank(root, "ibroadcast");
  return enqueue([=, this] { do_broadcast(buf, count * size_of(type), root); });
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  std::unique_ptr<Communicator> out;
  run_ordered([&] { out = do_split(color, key); });
  if (out) {
    out->set_link_model(link_);
    out->set_timeout(timeout_);
  }
  return out;
}

// Not ordered behind queued collectives: the communicator is broken (a rank
// was lost), and they fail at once.
std::unique_ptr<Communicator> Communicator::shrink() {
  std::unique_ptr<Communicator> out = do_shrink();
  out->set_link_model(link_);
  out->set_timeout(timeout_);
  return out;
}

std::unique_ptr<Communicator> Communicator::do_shrink() {
  throw CommError(str("the ", backend(), " backend cannot re-form a group without its lost ranks"));
}

std::unique_ptr<Communicator> Communicator::grow(int joins) {
  std::unique_ptr<Communicator> out = do_grow(joins);
  out->set_link_model(link_);
  out->set_timeout(timeout_);
  return out;
}

std::unique_ptr<Communicator> Communicator::do_grow(int) {
  throw CommError(str("the ", backend(), " backend cannot admit new ranks"));
}

}  // namespace distopt
