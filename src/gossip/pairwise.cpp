#include "distopt/gossip/pairwise.hpp"

#include <algorithm>
#include <chrono>

#include "distopt/core/error.hpp"
#include "distopt/gossip/topology.hpp"

namespace distopt::gossip {

namespace {

// Polls gently: yields for the first millisecond, then sleeps 100 us.
class Poll {
 public:
  void pause() {
    if (Communicator::Clock::now() - start_ < std::chrono::milliseconds(1))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }

 private:
  Communicator::Clock::time_point start_ = Communicator::Clock::now();
};

}  // namespace

int pairwise_partner(int rank, int world, std::uint64_t round) {
  DISTOPT_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of ", world);
  const int m = world % 2 == 0 ? world : world - 1;  // the ranks that pair
  if (m < 2) return -1;
  // Position in this round's order. Even worlds: the rank itself. Odd
  // worlds rotate by two ranks per round (which mixes about as fast as the
  // even worlds nearby; rotating by one is much slower at n = 5, 9, 13):
  // rank 2 round mod n takes position m and rests, the next one takes
  // position 0.
  const int shift =
      world % 2 == 0 ? 0 : static_cast<int>((2 * (round % static_cast<std::uint64_t>(world))) % world) + 1;
  const int pos = (rank - shift + 2 * world) % world;
  if (pos == m) return -1;
  const int d = Topology("bipartite-exponential", m).distances(round).front();
  const int partner_pos = pos % 2 == 1 ? (pos + d) % m : (pos - d + m) % m;
  return (partner_pos + shift) % world;
}

AsyncPairwise::AsyncPairwise(Communicator& comm, std::span<float> x, std::mutex& x_mutex, int tag,
                             std::uint64_t first_round)
    : comm_(comm),
      x_(x),
      x_mutex_(x_mutex),
      tag_(tag),
      unwinding_at_start_(std::uncaught_exceptions()),
      allowed_(first_round),
      completed_(first_round) {
  if (comm.size() > 1) {
    snapshot_.resize(x.size());
    received_.resize(x.size());
  }
  thread_ = std::thread([this] { run(); });
}

AsyncPairwise::~AsyncPairwise() {
  if (std::uncaught_exceptions() > unwinding_at_start_) {
    abandon_ = true;
    {
      std::lock_guard lock(m_);
      finishing_ = true;
    }
    cv_.notify_all();
    thread_.join();
    return;
  }
  try {
    finish();
  } catch (...) {
  }
}

void AsyncPairwise::allow(std::uint64_t rounds) {
  {
    std::lock_guard lock(m_);
    DISTOPT_CHECK(!finishing_, "allow() after finish()");
    allowed_ = std::max(allowed_, rounds);
  }
  cv_.notify_all();
}

void AsyncPairwise::wait_for(std::uint64_t rounds) {
  std::unique_lock lock(m_);
  DISTOPT_CHECK(rounds <= allowed_, "waiting for ", rounds, " rounds, ", allowed_, " allowed");
  cv_.wait(lock, [&] { return completed_ >= rounds || error_; });
  if (error_) std::rethrow_exception(error_);
}

void AsyncPairwise::finish() {
  {
    std::lock_guard lock(m_);
    finishing_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(m_);
  if (error_) std::rethrow_exception(error_);
}

std::uint64_t AsyncPairwise::allowed() const {
  std::lock_guard lock(m_);
  return allowed_;
}

std::uint64_t AsyncPairwise::completed() const {
  std::lock_guard lock(m_);
  return completed_;
}

void AsyncPairwise::run() {
  try {
    for (std::uint64_t r = completed();; ++r) {
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return allowed_ > r || finishing_; });
        if (abandon_ || allowed_ <= r) return;  // stopped, or finished every round allowed
      }
      const int partner = pairwise_partner(comm_.rank(), comm_.size(), r);
      if (partner >= 0) exchange(partner, r);
      if (abandon_) return;
      {
        std::lock_guard lock(m_);
        completed_ = r + 1;
      }
      cv_.notify_all();
    }
  } catch (...) {
    {
      std::lock_guard lock(m_);
      error_ = std::current_exception();
    }
    cv_.notify_all();
  }
}

void AsyncPairwise::exchange(int partner, std::uint64_t round) {
  {
    std::lock_guard lock(x_mutex_);
    std::copy(x_.begin(), x_.end(), snapshot_.begin());
  }
  auto recv = comm_.irecv(received_.data(), received_.size(), ElemType::f32, partner, tag_);
  auto send = comm_.isend(snapshot_.data(), snapshot_.size(), ElemType::f32, partner, tag_);
  const bool received = await(*recv, partner, round, "receiving from");
  if (!received || !await(*send, partner, round, "sending to")) {
    // Stopped with a message in flight: the receive is cancelled with its
    // request; the snapshot is kept, since a send may still read it.
    static std::mutex kept_mutex;
    static auto* kept = new std::vector<std::vector<float>>;  // reachable, for leak checkers
    std::lock_guard lock(kept_mutex);
    kept->push_back(std::move(snapshot_));
    return;
  }
  std::lock_guard lock(x_mutex_);
  for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += 0.5f * (received_[i] - snapshot_[i]);
}

bool AsyncPairwise::await(Request& r, int partner, std::uint64_t round, const char* what) {
  const auto until = Communicator::Clock::now() + comm_.timeout();
  Poll poll;
  while (!r.test()) {
    if (abandon_) return false;
    if (Communicator::Clock::now() > until)
      throw CommTimeout(str("adpsgd on rank ", comm_.rank(), ": timed out after ",
                            std::chrono::duration<double>(comm_.timeout()).count(), " s ", what, " rank ", partner,
                            " in pairwise round ", round, " (", comm_.backend(), " backend)"));
    poll.pause();
  }
  return true;
}

}  // namespace distopt::gossip
