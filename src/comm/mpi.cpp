// MPI backend: see include/distopt/comm/mpi.hpp and docs/algorithms.md.
#include "distopt/comm/mpi.hpp"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "distopt/core/copy.hpp"
#include "seconds.hpp"

namespace distopt {

namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(str(what, ": MPI error: ", std::string(text, static_cast<std::size_t>(len))));
}

int to_int(std::size_t bytes, const char* what) {
  if (bytes > static_cast<std::size_t>(INT_MAX))
    throw InvalidInput(str(what, ": a message of ", bytes, " bytes exceeds MPI's int count"));
  return static_cast<int>(bytes);
}

using comm_detail::seconds;

class MpiComm;

// Between polls of a wait: yield for the first second (a collective's
// messages progress only inside MPI calls, so a busy poll keeps transfers
// at full speed), then sleep 1 ms, so that ranks waiting for a stalled
// peer do not burn their cores until the timeout.
class Backoff {
 public:
  void pause() {
    if (Communicator::Clock::now() - start_ < std::chrono::seconds(1))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

 private:
  Communicator::Clock::time_point start_ = Communicator::Clock::now();
};

// Waits for `reqs` until the deadline, polling; names the peers of the
// requests still open on expiry. `peers[i]` is -1 for "the collective".
void wait_all(std::vector<MPI_Request>& reqs, const std::vector<int>& peers, const char* op, int rank,
              std::chrono::milliseconds timeout) {
  if (reqs.empty()) return;
  const auto until = Communicator::Clock::now() + timeout;
  Backoff backoff;
  for (;;) {
    int done = 0;
    check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), op);
    if (done) return;
    if (Communicator::Clock::now() > until) break;
    backoff.pause();
  }
  // The peers of the requests still open, each once (a rank may owe both a
  // send and a receive).
  std::vector<int> open;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    int flag = 1;
    if (reqs[i] != MPI_REQUEST_NULL) MPI_Request_get_status(reqs[i], &flag, MPI_STATUS_IGNORE);
    if (!flag && std::find(open.begin(), open.end(), peers[i]) == open.end()) open.push_back(peers[i]);
  }
  if (open.empty()) {  // everything arrived at the last moment
    check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), op);
    return;
  }
  std::sort(open.begin(), open.end());
  // A barrier or a broadcast's root cannot tell which ranks are missing (-1).
  std::string missing;
  for (int p : open)
    if (p >= 0) missing += (missing.empty() ? "rank(s) " : ", ") + std::to_string(p);
  if (open.front() < 0) missing += missing.empty() ? "the other ranks" : " and the other ranks";
  throw CommTimeout(str(op, " on rank ", rank, ": timed out after ", seconds(timeout), " waiting for ", missing,
                        " (mpi backend)"));
}

class MpiRequest final : public Request {
 public:
  MpiRequest(MPI_Request r, const char* op, int rank, int peer, int tag, std::size_t expect_bytes,
             std::chrono::milliseconds timeout)
      : req_(r), op_(op), rank_(rank), peer_(peer), tag_(tag), expect_(expect_bytes), timeout_(timeout) {}
  ~MpiRequest() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (req_ != MPI_REQUEST_NULL && !done_ && !finalized) {  // abandoned: let MPI finish it
      if (std::string_view(op_) == "recv") MPI_Cancel(&req_);
      MPI_Request_free(&req_);
    }
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    MPI_Status status;
    check(MPI_Test(&req_, &flag, &status), op_);
    if (flag) finish(status);
    return done_;
  }
  void wait() override {
    if (done_) return;
    const auto until = Communicator::Clock::now() + timeout_;
    Backoff backoff;
    while (!test()) {
      if (Communicator::Clock::now() > until)
        throw CommTimeout(str(op_, " on rank ", rank_, ": timed out after ", seconds(timeout_), " waiting for rank ",
                              peer_, " (tag ", tag_, ", mpi backend)"));
      backoff.pause();
    }
  }

 private:
  void finish(const MPI_Status& status) {
    done_ = true;
    if (std::string_view(op_) != "recv") return;
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (static_cast<std::size_t>(got) != expect_)
      throw CommError(str("recv on rank ", rank_, " from rank ", peer_, " (tag ", tag_, "): expected ", expect_,
                          " bytes, the message has ", got));
  }
  MPI_Request req_;
  const char* op_;
  int rank_, peer_, tag_;
  std::size_t expect_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
};

class MpiComm final : public Communicator {
 public:
  // Takes ownership of `comm`; collectives run on a duplicate so that user
  // point-to-point tags never meet internal messages.
  explicit MpiComm(MPI_Comm comm) : p2p_(comm) {
    check(MPI_Comm_set_errhandler(p2p_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_dup(p2p_, &coll_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(coll_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(p2p_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(p2p_, &size_), "MPI_Comm_size");
  }
  ~MpiComm() override {
    stop_progress();
    // A communicator that outlives MPI (a Python object collected after
    // the interpreter's atexit finalized it) has nothing left to free.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm_free(&coll_);
    MPI_Comm_free(&p2p_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }

 protected:
  std::unique_ptr<Request> do_isend(const void* buf, std::size_t bytes, int peer, int tag) override {
    MPI_Request r;
    check(MPI_Isend(buf, to_int(bytes, "send"), MPI_BYTE, peer, tag, p2p_, &r), "MPI_Isend");
    count_sent(bytes);
    return std::make_unique<MpiRequest>(r, "send", rank_, peer, tag, bytes, timeout());
  }
  std::unique_ptr<Request> do_irecv(void* buf, std::size_t bytes, int peer, int tag) override {
    MPI_Request r;
    check(MPI_Irecv(buf, to_int(bytes, "recv"), MPI_BYTE, peer, tag, p2p_, &r), "MPI_Irecv");
    return std::make_unique<MpiRequest>(r, "recv", rank_, peer, tag, bytes, timeout());
  }

  // The reduce-scatter and all-gather are the base's rank-ordered ones
  // (src/comm/ordered.cpp) on this exchange: the receives posted first,
  // then the sends, on the collectives' communicator with the
  // collective's tag.
  void exchange(const char* op, std::span<const Message> sends, std::span<const Message> recvs) override {
    const int tag = std::string_view(op) == "all_gather" ? kTagAg : kTagRs;
    std::vector<MPI_Request> reqs;
    std::vector<int> peers;
    for (const Message& m : recvs) {
      reqs.emplace_back();
      peers.push_back(m.peer);
      check(MPI_Irecv(m.data, to_int(m.bytes, op), MPI_BYTE, m.peer, tag, coll_, &reqs.back()), "MPI_Irecv");
    }
    for (const Message& m : sends) {
      reqs.emplace_back();
      peers.push_back(m.peer);
      check(MPI_Isend(m.data, to_int(m.bytes, op), MPI_BYTE, m.peer, tag, coll_, &reqs.back()), "MPI_Isend");
      count_sent(m.bytes);
    }
    wait_all(reqs, peers, op, rank_, timeout());
  }

  void do_broadcast(void* buf, std::size_t bytes, int root) override {
    std::vector<MPI_Request> reqs(1);
    check(MPI_Ibcast(buf, to_int(bytes, "broadcast"), MPI_BYTE, root, coll_, reqs.data()), "MPI_Ibcast");
    if (rank_ == root) count_sent(bytes * static_cast<std::size_t>(size_ - 1));
    wait_all(reqs, {rank_ == root ? -1 : root}, "broadcast", rank_, timeout());
  }

  void do_barrier() override {
    std::vector<MPI_Request> reqs(1);
    check(MPI_Ibarrier(coll_, reqs.data()), "MPI_Ibarrier");
    wait_all(reqs, {-1}, "barrier", rank_, timeout());
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override {
    MPI_Comm out;
    check(MPI_Comm_split(coll_, color < 0 ? MPI_UNDEFINED : color, key, &out), "MPI_Comm_split");
    if (out == MPI_COMM_NULL) return nullptr;
    auto comm = std::make_unique<MpiComm>(out);
    comm->set_timeout(timeout());
    return comm;
  }

 private:
  static constexpr int kTagRs = 1, kTagAg = 2;
  MPI_Comm p2p_ = MPI_COMM_NULL, coll_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

}  // namespace

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) throw CommError("MPI is already initialized (one MpiEnvironment per process)");
  int provided = 0;
  check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_MULTIPLE) {
    MPI_Finalize();
    throw CommError("this MPI library does not provide MPI_THREAD_MULTIPLE, which distopt needs");
  }
}

MpiEnvironment::~MpiEnvironment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void MpiEnvironment::abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

std::unique_ptr<Communicator> make_mpi_world() {
  MPI_Comm comm;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  return std::make_unique<MpiComm>(comm);
}

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr;
}

}  // namespace distopt
