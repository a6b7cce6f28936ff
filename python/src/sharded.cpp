// distopt._core's communicators and sharded optimizer (python/distopt/torch/
// comm.py and distributed.py; docs/python.md, "The sharded optimizer").
//
// Communicators: distopt's MPI one (mpirun), a one-rank one, and one over
// torch.distributed built from point-to-point messages exactly as the MPI
// backend builds its collectives, so the sums are distopt's rank-ordered
// ones (reduce_ordered) and both transports give the same bits. Its
// messages are posted from C++ with the GIL taken; every C++ call that
// communicates releases the GIL first, so that the communicator's
// progress thread can post.
//
// The sharded optimizer runs a C++ strategy (ddp, zero1, zero2) over a
// FlatLayout with one unit per torch parameter. The parameters' values
// live in the strategy's own buffer (torch's parameters become views of
// it). Their gradients: where the strategy keeps the whole gradient in one
// persistent buffer (ddp, zero1: !StrategyInfo::sharded_grads) torch's
// `.grad` views that buffer, as DDP's gradient_as_bucket_view does; zero2
// writes each bucket into a transient buffer, so there `.grad` views a flat
// buffer of this class that a step copies from. A step divides each unit's
// gradient by the world size (as torch's DDP does) and hands it to the
// strategy in backward order (its buckets reduce in distopt's fixed rank
// order), runs the strategy's step (statistics reduced, matrices gathered,
// parameters all-gathered into the same buffer) and waits for every unit.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/push_sum.hpp"
#include "distopt/gossip/topology.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/parallel/strategy.hpp"
#ifdef DISTOPT_PYTHON_MPI
#include "distopt/comm/mpi.hpp"
#endif

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
                       kTagBarrier = 2 * kMaxTag + 4;

  void do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type,
                           ReduceOp op) override {
    const std::size_t es = size_of(type);
    const auto offsets = offsets_of(counts);
    const std::size_t mine = counts[rank_] * es;
    // A member, as the MPI backend's: a receive abandoned after a failure
    // must not land in freed memory.
    if (scratch_.size() < mine * size_) scratch_.resize(mine * size_);
    char* scratch = scratch_.data();
    std::vector<std::unique_ptr<Request>> reqs;
    for (int j = 1; j < size_; ++j) {  // start with the next rank: spreads the load, as the MPI backend does
      const int peer = (rank_ + j) % size_;
      reqs.push_back(post("irecv", scratch + peer * mine, mine, peer, kTagRs, "reduce_scatter"));
    }
    for (int j = 1; j < size_; ++j) {
      const int peer = (rank_ + j) % size_;
      const std::size_t bytes = counts[peer] * es;
      reqs.push_back(post("isend", static_cast<const char*>(send) + offsets[peer] * es, bytes, peer, kTagRs,
                          "reduce_scatter"));
      count_sent(bytes);
    }
    for (auto& r : reqs) r->wait();
    std::vector<const void*> inputs(size_);
    for (int r = 0; r < size_; ++r)
      inputs[r] = r == rank_ ? static_cast<const char*>(send) + offsets[rank_] * es : scratch + r * mine;
    reduce_ordered(inputs.data(), size_, recv, counts[rank_], type, op);
  }

  void do_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, ElemType type) override {
    const std::size_t es = size_of(type);
    const auto offsets = offsets_of(counts);
    char* out = static_cast<char*>(recv);
    if (send != out + offsets[rank_] * es) std::memmove(out + offsets[rank_] * es, send, counts[rank_] * es);
    std::vector<std::unique_ptr<Request>> reqs;
    for (int j = 1; j < size_; ++j) {
      const int peer = (rank_ + size_ - j) % size_;
      reqs.push_back(post("irecv", out + offsets[peer] * es, counts[peer] * es, peer, kTagAg, "all_gather"));
    }
    for (int j = 1; j < size_; ++j) {
      const int peer = (rank_ + j) % size_;
      reqs.push_back(post("isend", out + offsets[rank_] * es, counts[rank_] * es, peer, kTagAg, "all_gather"));
      count_sent(counts[rank_] * es);
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
  std::unique_ptr<Communicator> do_split(int, int) override {
    throw InvalidInput("the torch.distributed transport cannot split (make a process group with torch.distributed.new_group)");
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
  std::vector<char> scratch_;  // reduce_scatter's receives
};

// ---- the MPI environment (one per process) --------------------------------

#ifdef DISTOPT_PYTHON_MPI
std::unique_ptr<MpiEnvironment>& mpi_environment() {
  static std::unique_ptr<MpiEnvironment> env;
  return env;
}
#endif

std::shared_ptr<Communicator> mpi_world() {
#ifdef DISTOPT_PYTHON_MPI
  auto& env = mpi_environment();
  if (!env) env = std::make_unique<MpiEnvironment>(nullptr, nullptr);
  return make_mpi_world();
#else
  throw InvalidInput("this build of distopt has no MPI (configure with Open MPI installed: libopenmpi-dev)");
#endif
}

void mpi_finalize() {
#ifdef DISTOPT_PYTHON_MPI
  mpi_environment().reset();
#endif
}

// ---- collectives on addresses (comm.py checks the tensors) ----------------

ElemType to_elem(const std::string& s) {
  ElemType t;
  if (!parse_elem_type(s, &t)) throw InvalidInput(str("unsupported element type '", s, "'"));
  return t;
}

ReduceOp to_op(const std::string& s) {
  if (s == "sum") return ReduceOp::sum;
  if (s == "avg") return ReduceOp::avg;
  if (s == "max") return ReduceOp::max;
  if (s == "min") return ReduceOp::min;
  throw InvalidInput(str("unknown reduction '", s, "' (sum, avg, max or min)"));
}

void* at(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

// ---- the sharded optimizer -------------------------------------------------

// Parameter i as Python describes it: (name, shape).
using ParamSpec = std::pair<std::string, std::vector<std::int64_t>>;

parallel::FlatLayout layout_of(const std::vector<ParamSpec>& params) {
  parallel::FlatLayout flat;
  for (const auto& [name, shape] : params) {
    ParamSlot s{name, flat.elements, Shape(shape.begin(), shape.end())};
    const std::size_t n = s.numel();
    if (n == 0) throw InvalidInput(str(name, " has no elements"));
    flat.units.push_back({name, flat.elements, flat.elements + n});
    flat.elements += n;
    flat.params.push_back(std::move(s));
  }
  if (flat.params.empty()) throw InvalidInput("the optimizer got an empty parameter list");
  return flat;
}

class PySharded {
 public:
  PySharded(std::shared_ptr<Communicator> comm, const std::string& strategy, const std::string& rule,
            const std::vector<ParamSpec>& params, py::array_t<float, py::array::c_style | py::array::forcecast> initial,
            const py::dict& options, std::size_t bucket_elements)
      : comm_(std::move(comm)), strategy_name_(strategy), layout_(layout_of(params)) {
    const StrategyInfo_& info = parallel::strategy_or_throw(strategy);
    if (info.per_rank_models)
      throw InvalidInput(str("strategy ", strategy, ": the sharded optimizer runs ddp, zero1 and zero2 (gossip "
                             "strategies: distopt train)"));
    if (info.volume_psi > 2)
      throw InvalidInput(str("strategy ", strategy, " gathers parameters per unit of the model as it runs; the "
                             "sharded optimizer runs ddp, zero1 and zero2"));
    if (bucket_elements == 0) throw InvalidInput("bucket_elements must be at least 1");
    spec_.name = rule;
    spec_.options = to_options(options);
    spec_.fallback = std::string(rule_or_throw(rule).companion);
    options_.bucket_elements = bucket_elements;
    direct_grads_ = !info.sharded_grads;
    if (static_cast<std::size_t>(initial.size()) != layout_.elements)
      throw InvalidInput(str("initial values: ", initial.size(), " elements for parameters of ", layout_.elements));
    if (!direct_grads_) grads_.assign(layout_.elements, 0.0f);
    // Every rank starts from rank 0's parameters, as torch's DDP does (in
    // the caller's array: no copy of the model in flight).
    const std::span<float> init(initial.mutable_data(), layout_.elements);
    py::gil_scoped_release release;
    comm_->broadcast(init.data(), init.size(), ElemType::f32, 0);
    adopt(make(init));
    const Optimizer& opt = strategy_->optimizer();
    for (std::size_t g = 0; g < opt.num_groups(); ++g) base_lr_.push_back(opt.lr(g));
  }

  ~PySharded() {
    py::gil_scoped_release release;  // a torch transport's requests take it
    strategy_.reset();
    retired_.clear();
  }

  std::size_t num_params() const { return layout_.params.size(); }
  int rank() const { return comm_->rank(); }
  int world() const { return comm_->size(); }
  const std::string& strategy() const { return strategy_name_; }

  // Parameter i's values and its gradient, as numpy arrays viewing this
  // object's memory (their base keeps it alive).
  py::array param(py::object self, std::size_t i) {
    const ParamSlot& s = slot(i);
    return py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()), values_[i], self);
  }
  py::array grad(py::object self, std::size_t i) {
    const ParamSlot& s = slot(i);
    return py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()), grad_of(i), self);
  }
  void zero_grads() {
    for (std::size_t i = 0; i < layout_.params.size(); ++i) std::fill_n(grad_of(i), layout_.params[i].numel(), 0.0f);
  }

  // One step from the gradients in the flat buffer; clips to max_norm
  // first when it is positive. Returns the gradients' total norm (NaN
  // without clipping).
  double step(double max_norm, double norm_type) {
    py::gil_scoped_release release;
    models::UnitAccess& access = strategy_->access();
    const float world = static_cast<float>(comm_->size());
    for (std::size_t u = layout_.units.size(); u-- > 0;) {
      const auto& unit = layout_.units[u];
      const std::span<float> g = access.grads(u);
      DISTOPT_CHECK(g.size() == unit.end - unit.begin, g.size(), " vs ", unit.end - unit.begin);
      const float* src = grad_of(u);
      DISTOPT_CHECK(!direct_grads_ || src == g.data(), "unit ", u, "'s gradient moved");
      if (comm_->size() > 1)
        for (std::size_t k = 0; k < g.size(); ++k) g[k] = src[k] / world;  // torch's DDP divides by the world
      else if (src != g.data())
        std::memcpy(g.data(), src, g.size_bytes());
      access.grads_done(u);
    }
    double norm = std::nan("");
    if (max_norm > 0)
      strategy_->step([&](Optimizer& opt, const parallel::GradShard& shard) {
        norm = clip_grad_norm(opt, shard.owned, max_norm, norm_type, false, shard.reduce);
        opt.step();
      });
    else
      strategy_->step();
    wait_for_params();
    return norm;
  }

  // Sets an option of the group torch sees (param_groups[0]). A learning
  // rate scales every group alike (Muon's AdamW group for its 1-D
  // parameters keeps its ratio to the main one), as distopt's schedulers
  // scale every group.
  void set_option(const std::string& key, py::handle value) {
    Optimizer& opt = strategy_->optimizer();
    if (key != "lr") {
      opt.set_option(0, key, to_option(key, value));
      return;
    }
    const double lr = value.cast<double>();
    opt.set_lr(0, lr);
    for (std::size_t g = 1; g < opt.num_groups(); ++g)
      if (base_lr_[0] != 0) opt.set_lr(g, lr * (base_lr_[g] / base_lr_[0]));
  }
  py::dict group_options() {
    py::dict d;
    for (const auto& [k, v] : strategy_->optimizer().group(0).options) d[py::str(k)] = from_option(v);
    return d;
  }

  // The whole state tensors, named as distopt's checkpoints name them
  // ("state.<index>.<key>", "param.<name>"), on every rank (collective).
  py::dict consolidated() {
    std::map<std::string, checkpoint::Whole> wholes;
    {
      py::gil_scoped_release release;
      wholes = gather_wholes();
    }
    py::dict out;
    for (auto& [name, w] : wholes) {
      py::array_t<float> a(std::vector<py::ssize_t>(w.shape.begin(), w.shape.end()));
      std::copy(w.values.begin(), w.values.end(), a.mutable_data());
      out[py::str(name)] = a;
    }
    return out;
  }

  // Loads whole state tensors (as consolidated() names them): every rank
  // takes its pieces.
  void load_consolidated(const py::dict& tensors) {
    std::map<std::string, checkpoint::Whole> wholes;
    for (auto [k, v] : tensors) {
      const auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(v);
      if (!a) throw InvalidInput(str("state tensor ", k.cast<std::string>(), " is not a float array"));
      checkpoint::Whole w;
      for (py::ssize_t d = 0; d < a.ndim(); ++d) w.shape.push_back(a.shape(d));
      w.values.assign(a.data(), a.data() + a.size());
      wholes[k.cast<std::string>()] = std::move(w);
    }
    py::gil_scoped_release release;
    checkpoint::load_optimizer_state(*strategy_, wholes);
  }

  // distopt's reshardable checkpoint under `root` (collective): loadable
  // at any world size and by any of the strategies, here or by load().
  std::uint64_t save(const std::string& root, std::uint64_t step, std::size_t keep) {
    py::gil_scoped_release release;
    checkpoint::SaveOptions o;
    o.root = root;
    o.keep = keep;
    return checkpoint::save(*comm_, *strategy_, run_info(), {&strategy_->optimizer()}, o, step, 0);
  }

  // The latest checkpoint under `root`: a strategy is built from it and,
  // once it has taken the saved state, replaces the current one (the
  // parameters' addresses change: the caller views them again; on an error
  // nothing changes). The old strategy's buffers stay allocated until this
  // object goes, so that tensors still viewing them read stale values, not
  // freed memory. Returns the step it was saved at.
  std::uint64_t load(const std::string& root) {
    py::gil_scoped_release release;
    const checkpoint::Loaded loaded = checkpoint::load_latest(root);
    const std::vector<float> initial = checkpoint::initial_params(layout_, loaded.wholes);
    std::unique_ptr<parallel::Strategy> s = make(initial);
    checkpoint::resume(*comm_, *s, loaded, run_info(), {&s->optimizer()},
                       []() -> Scheduler& { throw InvalidInput("the checkpoint holds an SWA run"); });
    adopt(std::move(s));
    return loaded.step;
  }

  py::dict memory() const {
    const parallel::MemoryUse m = strategy_->memory();
    py::dict d;
    d["params"] = m.params;
    d["grads"] = m.grads + grads_.size() * sizeof(float);  // the flat buffer .grad views, where it is ours
    d["master_params"] = m.master_params;
    d["optimizer_state"] = m.optimizer_state;
    return d;
  }
  std::uint64_t bytes_sent() const { return strategy_->bytes_sent(); }

 private:
  using StrategyInfo_ = parallel::StrategyInfo;

  float* grad_of(std::size_t i) { return direct_grads_ ? grad_at_[i] : grads_.data() + layout_.params[i].offset; }

  const ParamSlot& slot(std::size_t i) const {
    if (i >= layout_.params.size()) throw InvalidInput(str("no parameter ", i));
    return layout_.params[i];
  }

  checkpoint::RunInfo run_info() const {
    checkpoint::RunInfo r;
    r.strategy = strategy_name_;
    r.model = "torch";
    r.optimizer = spec_.name;
    return r;
  }

  std::unique_ptr<parallel::Strategy> make(std::span<const float> initial) const {
    return parallel::make_strategy(strategy_name_, *comm_, layout_, initial, spec_, options_);
  }

  // `s` becomes the strategy; the parameters' and gradients' addresses are its.
  void adopt(std::unique_ptr<parallel::Strategy> s) {
    if (strategy_) retired_.push_back(std::move(strategy_));
    strategy_ = std::move(s);
    values_.assign(layout_.units.size(), nullptr);
    models::UnitAccess& access = strategy_->access();
    for (std::size_t u = 0; u < layout_.units.size(); ++u) {
      values_[u] = const_cast<float*>(access.acquire(u, models::Pass::forward).data());
      access.release(u, models::Pass::forward);
    }
    // ddp, zero1: where backward writes unit u's gradient, in every step.
    grad_at_.assign(layout_.units.size(), nullptr);
    if (direct_grads_) {
      for (std::size_t u = 0; u < layout_.units.size(); ++u) {
        const std::span<float> g = access.grads(u);
        std::fill(g.begin(), g.end(), 0.0f);
        grad_at_[u] = g.data();
      }
    }
  }

  // Waits for the parameters' gathers; they land where torch's views are.
  void wait_for_params() {
    models::UnitAccess& access = strategy_->access();
    for (std::size_t u = 0; u < layout_.units.size(); ++u) {
      const float* p = access.acquire(u, models::Pass::forward).data();
      access.release(u, models::Pass::forward);
      DISTOPT_CHECK(p == values_[u], "unit ", u, "'s parameters moved");
    }
  }

  std::map<std::string, checkpoint::Whole> gather_wholes() {
    const std::vector<std::byte> mine = checkpoint::pieces_bytes(checkpoint::strategy_pieces(*strategy_, comm_->rank()));
    const int n = comm_->size();
    std::vector<std::uint64_t> sizes(n);
    sizes[comm_->rank()] = mine.size();
    comm_->all_gather(&sizes[comm_->rank()], sizes.data(), 1, ElemType::i64);
    std::vector<std::size_t> counts(sizes.begin(), sizes.end());
    std::size_t total = 0;
    for (auto c : counts) total += c;
    std::vector<std::byte> all(total);
    comm_->all_gather_v(mine.data(), all.data(), counts, ElemType::u8);
    std::vector<checkpoint::Piece> everything;
    std::size_t at = 0;
    for (int r = 0; r < n; ++r) {
      const auto file = checkpoint::parse_safetensors(std::span(all).subspan(at, counts[r]), str("rank ", r, "'s state"));
      auto p = checkpoint::pieces_of(file, str("rank ", r, "'s state"));
      everything.insert(everything.end(), std::make_move_iterator(p.begin()), std::make_move_iterator(p.end()));
      at += counts[r];
    }
    return checkpoint::assemble(everything);
  }

  std::shared_ptr<Communicator> comm_;
  std::string strategy_name_;
  parallel::FlatLayout layout_;
  parallel::OptimizerSpec spec_;
  parallel::StrategyOptions options_;
  std::unique_ptr<parallel::Strategy> strategy_;
  std::vector<std::unique_ptr<parallel::Strategy>> retired_;  // replaced by load(), still viewed perhaps
  std::vector<double> base_lr_;                               // each group's lr as made
  std::vector<float*> values_;   // unit u's parameters in the strategy's buffer
  bool direct_grads_ = false;    // .grad views the strategy's own gradient buffer (grad_at_)
  std::vector<float*> grad_at_;  // unit u's gradient in the strategy's buffer
  std::vector<float> grads_;     // zero2: the flat buffer .grad views, the model's layout
};

// Push-sum gossip averaging of one vector (docs/gossip.md): each mix()
// sends shares of (x, w) to the topology's peers and adds what arrives.
class PyPushSum {
 public:
  PyPushSum(std::shared_ptr<Communicator> comm, const std::string& topology, std::size_t dim, int peers)
      : comm_(std::move(comm)), topology_(topology, comm_->size(), peers) {
    push_.emplace(*comm_, topology_, dim);
  }
  ~PyPushSum() {
    py::gil_scoped_release release;
    push_.reset();
  }
  double mix(std::uintptr_t x, std::size_t count, double w) {
    py::gil_scoped_release release;
    push_->mix({static_cast<float*>(at(x)), count}, w);
    return w;
  }

 private:
  std::shared_ptr<Communicator> comm_;
  gossip::Topology topology_;
  std::optional<gossip::PushSum> push_;
};

}  // namespace

void bind_sharded(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CommTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const CommError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Comm")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend", [](const Communicator& c) { return std::string(c.backend()); })
      .def_property_readonly("bytes_sent", &Communicator::bytes_sent)
      .def("set_timeout",
           [](Communicator& c, double s) {
             if (!(s > 0 && s <= 365.0 * 86400)) throw InvalidInput(str("timeout: ", s, " s is not in (0, a year]"));
             c.set_timeout(std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(s)));
           })
      .def("all_reduce",
           [](Communicator& c, std::uintptr_t buf, std::size_t n, const std::string& t, const std::string& op) {
             const ElemType e = to_elem(t);
             const ReduceOp o = to_op(op);
             py::gil_scoped_release release;
             c.all_reduce(at(buf), at(buf), n, e, o);
           })
      .def("reduce_scatter",
           [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t n, const std::string& t,
              const std::string& op) {
             const ElemType e = to_elem(t);
             const ReduceOp o = to_op(op);
             py::gil_scoped_release release;
             c.reduce_scatter(at(send), at(recv), n, e, o);
           })
      .def("all_gather",
           [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t n, const std::string& t) {
             const ElemType e = to_elem(t);
             py::gil_scoped_release release;
             c.all_gather(at(send), at(recv), n, e);
           })
      .def("broadcast",
           [](Communicator& c, std::uintptr_t buf, std::size_t n, const std::string& t, int root) {
             const ElemType e = to_elem(t);
             if (root < 0 || root >= c.size()) throw InvalidInput(str("broadcast: no rank ", root));
             py::gil_scoped_release release;
             c.broadcast(at(buf), n, e, root);
           })
      .def("barrier", [](Communicator& c) {
        py::gil_scoped_release release;
        c.barrier();
      });
  m.def("mpi_world", &mpi_world, "distopt's MPI communicator over MPI_COMM_WORLD (under mpirun)");
  m.def("mpi_finalize", &mpi_finalize, "finalizes MPI (atexit)");
  m.def("mpi_built", [] {
#ifdef DISTOPT_PYTHON_MPI
    return true;
#else
    return false;
#endif
  });
  m.def("launched_by_mpirun", [] {
#ifdef DISTOPT_PYTHON_MPI
    return launched_by_mpirun();
#else
    return false;
#endif
  });
  m.def("single", [] { return std::shared_ptr<Communicator>(std::move(make_threads_world(1)[0])); },
        "a communicator of one rank");
  m.def(
      "torch_comm",
      [](int rank, int size, py::object ops) { return std::shared_ptr<Communicator>(std::make_shared<TorchComm>(rank, size, ops)); },
      "a communicator over a Python transport (distopt.torch.comm's torch.distributed one)");

  py::class_<PySharded>(m, "Sharded")
      .def(py::init<std::shared_ptr<Communicator>, const std::string&, const std::string&, const std::vector<ParamSpec>&,
                    py::array_t<float, py::array::c_style | py::array::forcecast>, const py::dict&, std::size_t>(),
           py::arg("comm"), py::arg("strategy"), py::arg("rule"), py::arg("params"), py::arg("initial"),
           py::arg("options"), py::arg("bucket_elements"))
      .def("param", [](py::object self, std::size_t i) { return self.cast<PySharded&>().param(self, i); })
      .def("grad", [](py::object self, std::size_t i) { return self.cast<PySharded&>().grad(self, i); })
      .def("zero_grads", &PySharded::zero_grads)
      .def("step", &PySharded::step, py::arg("max_norm") = 0.0, py::arg("norm_type") = 2.0)
      .def("set_option", &PySharded::set_option)
      .def("group_options", &PySharded::group_options)
      .def("consolidated", &PySharded::consolidated)
      .def("load_consolidated", &PySharded::load_consolidated)
      .def("save", &PySharded::save, py::arg("root"), py::arg("step"), py::arg("keep") = 3)
      .def("load", &PySharded::load)
      .def("memory", &PySharded::memory)
      .def_property_readonly("bytes_sent", &PySharded::bytes_sent)
      .def_property_readonly("rank", &PySharded::rank)
      .def_property_readonly("world", &PySharded::world)
      .def_property_readonly("strategy", &PySharded::strategy)
      .def_property_readonly("num_params", &PySharded::num_params);

  py::class_<PyPushSum>(m, "PushSum")
      .def(py::init<std::shared_ptr<Communicator>, const std::string&, std::size_t, int>(), py::arg("comm"),
           py::arg("topology"), py::arg("dim"), py::arg("peers_per_iteration") = 1)
      .def("mix", &PyPushSum::mix);
}

}  // namespace distopt::python
