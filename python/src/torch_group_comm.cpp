// A communicator over torch.distributed (distopt._core's torch_comm;
// python/distopt/torch/comm.py's _TorchOps is its transport; docs/python.md)
// built from point-to-point messages exactly as the MPI backend builds its
// collectives, so the sums are distopt's rank-ordered ones (reduce_ordered)
// and both transports give the same bits. Its messages are posted from C++
// with the GIL taken; every C++ call that communicates releases the GIL
// first (sharded_bindings.cpp), so that the communicator's progress thread
// can post.
#include "torch_group_comm.hpp"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "distopt/comm/communicator.hpp"
#include "distopt/core/error.hpp"

namespace distopt::python {
namespace {

// ---- a communicator over torch.distributed -------------------------------

// A message posted through the Python transport (comm.py's _TorchOps):
// `work` is what its isend/irecv returned.
class TorchRequest final : public Request {
 public:
  TorchRequest(py::object ops, py::object work, std::string what, double seconds)
      : ops_(std::move(ops)), work_(std::move(work)), what_(std::move(what)), seconds_(seconds) {}
  ~TorchRequest() override {
    py::gil_scoped_acquire gil;
    work_ = py::object();
    ops_ = py::object();
  }
  // torch 1.x's gloo send and receive work cannot be polled (is_completed
  // is always true there): test() waits for it.
  bool test() override {
    wait();
    return true;
  }
  void wait() override {
    if (done_) return;
    py::gil_scoped_acquire gil;
    try {
      ops_.attr("wait")(work_, seconds_);
      done_ = true;
    } catch (py::error_already_set& e) {
      const std::string why = e.what();
      if (why.find("imed out") != std::string::npos || why.find("imeout") != std::string::npos)
        throw CommTimeout(str(what_, ": no answer within ", seconds_, " s (torch: ", why, ")"));
      throw CommError(str(what_, ": ", why));
    }
  }

 private:
  py::object ops_, work_;
  std::string what_;
  double seconds_;
  bool done_ = false;
};

class DoneRequest final : public Request {
 public:
  bool test() override { return true; }
  void wait() override {}
};

class TorchComm final : public Communicator {
 public:
  TorchComm(int rank, int size, py::object ops) : rank_(rank), size_(size), ops_(std::move(ops)) {
    if (size < 1 || rank < 0 || rank >= size) throw InvalidInput(str("rank ", rank, " of a world of ", size));
  }
  ~TorchComm() override {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;  // the progress thread may be waiting for it
      stop_progress();
    } else {
      stop_progress();
    }
    py::gil_scoped_acquire gil;
    ops_ = py::object();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "torch"; }

 protected:
  // Tags of the collectives' messages, above those point-to-point users may
  // take (below kMaxTag) and those an emulated link adds (tag + kMaxTag).
  static constexpr int kTagRs = 2 * kMaxTag + 1, kTagAg = 2 * kMaxTag + 2, kTagBc = 2 * kMaxTag + 3,
                       kTagBarrier = 2 * kMaxTag + 4, kTagSplit = 2 * kMaxTag + 5;

  // The reduce-scatter and all-gather are the base's rank-ordered ones
  // (src/comm/ordered.cpp) on this exchange: every receive posted, then
  // every send, then all waited.
  void exchange(const char* op, std::span<const Message> sends, std::span<const Message> recvs) override {
    const int tag = std::string_view(op) == "all_gather" ? kTagAg : kTagRs;
    std::vector<std::unique_ptr<Request>> reqs;
    for (const Message& m : recvs) reqs.push_back(post("irecv", m.data, m.bytes, m.peer, tag, op));
    for (const Message& m : sends) {
      reqs.push_back(post("isend", m.data, m.bytes, m.peer, tag, op));
      count_sent(m.bytes);
    }
    for (auto& r : reqs) r->wait();
  }

  void do_broadcast(void* buf, std::size_t bytes, int root) override {
    std::vector<std::unique_ptr<Request>> reqs;
    if (rank_ == root) {
      for (int peer = 0; peer < size_; ++peer)
        if (peer != root) {
          reqs.push_back(post("isend", buf, bytes, peer, kTagBc, "broadcast"));
          count_sent(bytes);
        }
    } else {
      reqs.push_back(post("irecv", buf, bytes, root, kTagBc, "broadcast"));
    }
    for (auto& r : reqs) r->wait();
  }

  // Every rank tells rank 0 it has arrived; rank 0 answers all once each
  // has (messages, so the communicator's timeout holds).
  void do_barrier() override {
    char token = 0;
    std::vector<char> tokens(size_);
    std::vector<std::unique_ptr<Request>> reqs;
    if (rank_ == 0) {
      for (int peer = 1; peer < size_; ++peer) reqs.push_back(post("irecv", &tokens[peer], 1, peer, kTagBarrier, "barrier"));
      for (auto& r : reqs) r->wait();
      reqs.clear();
      for (int peer = 1; peer < size_; ++peer) reqs.push_back(post("isend", &token, 1, peer, kTagBarrier, "barrier"));
    } else {
      reqs.push_back(post("isend", &token, 1, 0, kTagBarrier, "barrier"));
      reqs.push_back(post("irecv", &tokens[0], 1, 0, kTagBarrier, "barrier"));
    }
    for (auto& r : reqs) r->wait();
  }

  std::unique_ptr<Request> do_isend(const void* buf, std::size_t bytes, int peer, int tag) override {
    check_tag(tag);
    count_sent(bytes);
    return post("isend", buf, bytes, peer, tag, "send");
  }
  std::unique_ptr<Request> do_irecv(void* buf, std::size_t bytes, int peer, int tag) override {
    check_tag(tag);
    return post("irecv", buf, bytes, peer, tag, "recv");
  }
  // Every rank's (color, key) to every rank; then each color's members,
  // colors ascending, become a torch.distributed group (new_group is
  // collective over the default group: every process makes every group,
  // in the same order -- comm.py's _TorchOps.split).
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    {
      py::gil_scoped_acquire gil;
      const std::string why = ops_.attr("cannot_split")().cast<std::string>();
      if (!why.empty()) throw InvalidInput(why);  // before any message: the communicator stays whole
    }
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size_));
    all[2 * rank_] = color;
    all[2 * rank_ + 1] = key;
    std::vector<std::unique_ptr<Request>> reqs;
    for (int peer = 0; peer < size_; ++peer)
      if (peer != rank_) reqs.push_back(post("irecv", &all[2 * peer], 8, peer, kTagSplit, "split"));
    for (int peer = 0; peer < size_; ++peer)
      if (peer != rank_) {
        reqs.push_back(post("isend", &all[2 * rank_], 8, peer, kTagSplit, "split"));
        count_sent(8);
      }
    for (auto& r : reqs) r->wait();
    std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, rank)
    for (int r = 0; r < size_; ++r)
      if (all[2 * r] >= 0) members[all[2 * r]].emplace_back(all[2 * r + 1], r);
    std::vector<std::vector<int>> groups;
    int mine = -1, my_rank = -1;
    for (auto& [c, m] : members) {
      std::sort(m.begin(), m.end());
      std::vector<int> ranks;
      for (const auto& [k, r] : m) {
        if (r == rank_) {
          mine = static_cast<int>(groups.size());
          my_rank = static_cast<int>(ranks.size());
        }
        ranks.push_back(r);
      }
      groups.push_back(std::move(ranks));
    }
    py::gil_scoped_acquire gil;
    py::object ops;
    try {
      ops = ops_.attr("split")(groups, mine);
    } catch (py::error_already_set& e) {
      const std::string why = e.what();
      throw CommError(str("split: torch.distributed.new_group: ", why.substr(0, why.find('\n'))));
    }
    if (mine < 0) return nullptr;
    return std::make_unique<TorchComm>(my_rank, static_cast<int>(groups[mine].size()), std::move(ops));
  }

 private:
  double seconds() const { return std::chrono::duration<double>(timeout()).count(); }
  static void check_tag(int tag) {
    if (tag < 0 || tag >= 2 * kMaxTag)
      throw InvalidInput(str("tag ", tag, " is negative or one of the torch transport's own (", 2 * kMaxTag,
                             " and above)"));
  }

  std::unique_ptr<Request> post(const char* fn, const void* buf, std::size_t bytes, int peer, int tag,
                                const char* what) {
    if (bytes == 0) return std::make_unique<DoneRequest>();
    py::gil_scoped_acquire gil;
    try {
      auto view = py::memoryview::from_memory(const_cast<void*>(buf), static_cast<py::ssize_t>(bytes), false);
      py::object work = ops_.attr(fn)(view, peer, tag);
      return std::make_unique<TorchRequest>(ops_, std::move(work), str(what, " with rank ", peer), seconds());
    } catch (py::error_already_set& e) {
      throw CommError(str(what, " with rank ", peer, ": ", e.what()));
    }
  }

  int rank_, size_;
  py::object ops_;
};

}  // namespace

std::shared_ptr<Communicator> make_torch_comm(int rank, int size, py::object ops) {
  return std::shared_ptr<Communicator>(std::make_shared<TorchComm>(rank, size, ops));
}

}  // namespace distopt::python
