// The gloo backend's data movement (private to src/comm/gloo; see
// transport.cpp): GlooComm, the communicator of a gloo world, and what its
// operations wait on (LiveBuffers), which a failure or a member that left
// the group aborts. GlooComm's members that change the group (do_shrink,
// do_grow, reform, pending_joins) are membership.cpp's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "heartbeat.hpp"
#include "mesh.hpp"

namespace distopt::gloo_detail {

// A wait ended by LiveBuffers::abort_all, with the first reason given.
class WaitAborted : public std::runtime_error {
 public:
  WaitAborted(const std::string& why, bool group_left)
      : std::runtime_error(str("aborted: ", why)), group_left_(group_left) {}
  // A member left the group to re-form it (Shared::watch_for_leavers).
  bool group_left() const { return group_left_; }

 private:
  bool group_left_;
};

// What aborts the waits of a communicator: a failure found by one thread
// aborts another's wait on the same communicator, and a member that left
// the group aborts them all (Shared::abort_upto).
class LiveBuffers {
 public:
  void attach(Mesh* mesh) { mesh_ = mesh; }
  void abort_all(const std::string& why, bool group_left = false) {
    {
      std::lock_guard lock(m_);
      if (why_.empty()) {  // the first reason: the communicator is done
        why_ = why;
        group_left_ = group_left;
      }
    }
    if (mesh_) mesh_->abort_pending();
  }
  // A wait that returned false: aborted, for this reason.
  [[noreturn]] void aborted() {
    std::lock_guard lock(m_);
    throw WaitAborted(why_.empty() ? std::string("an abort") : why_, group_left_);
  }

 private:
  std::mutex m_;
  Mesh* mesh_ = nullptr;
  std::string why_;
  bool group_left_ = false;
};

class GlooComm;

class GlooRequest final : public Request {
 public:
  GlooRequest(GlooComm& comm, std::shared_ptr<Mesh::Op> op, bool send, int peer, int tag)
      : comm_(comm), op_(std::move(op)), send_(send), peer_(peer), tag_(tag) {}
  ~GlooRequest() override;
  // Waits (a test would need a wait that can end early without failing).
  bool test() override {
    wait();
    return true;
  }
  void wait() override;

 private:
  GlooComm& comm_;
  std::shared_ptr<Mesh::Op> op_;
  bool send_;
  int peer_, tag_;
  bool done_ = false;
};

class GlooComm final : public Communicator {
 public:
  // Made in the epoch current when it is made (a re-forming's after it
  // moved to the next).
  GlooComm(std::shared_ptr<Shared> shared, std::shared_ptr<Mesh> mesh, bool top, int epoch);
  ~GlooComm() override;

  int rank() const override { return mesh_->rank(); }
  int size() const override { return mesh_->size(); }
  std::string_view backend() const override { return "gloo"; }

  // A failed wait: names the peer; RankLost in an elastic world's top
  // communicator. Closes every pair first, so that nothing more is written
  // into buffers the caller may free, and peers waiting on this rank learn
  // at once.
  [[noreturn]] void fail(const std::string& op, int peer, const std::exception& e, Clock::time_point until);

 protected:
  std::unique_ptr<Request> do_isend(const void* buf, std::size_t bytes, int peer, int tag) override;
  std::unique_ptr<Request> do_irecv(void* buf, std::size_t bytes, int peer, int tag) override;
  void do_broadcast(void* buf, std::size_t bytes, int root) override;
  void do_barrier() override;
  std::unique_ptr<Communicator> do_split(int color, int key) override;

  // (membership.cpp, as is pending_joins)
  std::unique_ptr<Communicator> do_shrink() override;
  std::unique_ptr<Communicator> do_grow(int joins) override;
  std::unique_ptr<Communicator> reform(int joins);

 public:
  int pending_joins() override;

 private:
  static constexpr std::uint64_t kP2p = 1ull << 40, kCollective = 1ull << 41;
  static std::uint64_t p2p_slot(int tag) { return kP2p + static_cast<std::uint32_t>(tag); }

  // Broadcast, barrier and (the base's rank-ordered ones, src/comm/ordered.cpp)
  // reduce-scatter and all-gather run on it.
  void exchange(const char* op, std::span<const Message> sends, std::span<const Message> recvs) override;

  friend class GlooRequest;
  LiveBuffers live_;
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<Mesh> mesh_;
  bool top_;
  int epoch_;  // the membership epoch it belongs to
  std::uint64_t seq_ = 0;
};

}  // namespace distopt::gloo_detail
