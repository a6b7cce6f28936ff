// PySharded's members (sharded.hpp has the class and what it does): the
// sharded optimizer over a C++ strategy, its step and its checkpoints.
#include "sharded.hpp"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::python {

std::vector<std::string> sharded_strategies() {
  std::vector<std::string> out;
  for (const parallel::StrategyInfo* s : parallel::all_strategies())
    if (!s->per_rank_models && !s->sharded_params) out.emplace_back(s->name);
  return out;
}

std::string sharded_strategy_list() {
  const std::vector<std::string> names = sharded_strategies();
  std::string out;
  for (std::size_t k = 0; k < names.size(); ++k)
    out += (k == 0 ? "" : k + 1 == names.size() ? " and " : ", ") + names[k];
  return out;
}

namespace {

// ---- the sharded optimizer -------------------------------------------------


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

}  // namespace

PySharded::PySharded(std::shared_ptr<Communicator> comm, const std::string& strategy, const std::string& rule,
                     const std::vector<ParamSpec>& params,
                     py::array_t<float, py::array::c_style | py::array::forcecast> initial, const py::dict& options,
                     std::size_t bucket_elements)
    : comm_(std::move(comm)), strategy_name_(strategy), layout_(layout_of(params)) {
  const StrategyInfo_& info = parallel::strategy_or_throw(strategy);
  if (info.per_rank_models)
    throw InvalidInput(str("strategy ", strategy, ": the sharded optimizer runs ", sharded_strategy_list(),
                           " (gossip strategies: distopt train)"));
  if (info.sharded_params)
    throw InvalidInput(str("strategy ", strategy, " gathers parameters per unit of the model as it runs; the "
                           "sharded optimizer runs ", sharded_strategy_list()));
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

PySharded::~PySharded() {
  py::gil_scoped_release release;  // a torch transport's requests take it
  strategy_.reset();
  retired_.clear();
}

py::array PySharded::param(py::object self, std::size_t i) {
  const ParamSlot& s = slot(i);
  return py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()), values_[i], self);
}

py::array PySharded::grad(py::object self, std::size_t i) {
  const ParamSlot& s = slot(i);
  return py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()), grad_of(i), self);
}

void PySharded::zero_grads() {
  for (std::size_t i = 0; i < layout_.params.size(); ++i) std::fill_n(grad_of(i), layout_.params[i].numel(), 0.0f);
}

double PySharded::step(double max_norm, double norm_type) {
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

void PySharded::set_option(const std::string& key, py::handle value) {
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

py::dict PySharded::group_options() {
  py::dict d;
  for (const auto& [k, v] : strategy_->optimizer().group(0).options) d[py::str(k)] = from_option(v);
  return d;
}

py::dict PySharded::consolidated() {
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

void PySharded::load_consolidated(const py::dict& tensors) {
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

std::uint64_t PySharded::save(const std::string& root, std::uint64_t step, std::size_t keep) {
  py::gil_scoped_release release;
  checkpoint::SaveOptions o;
  o.root = root;
  o.keep = keep;
  return checkpoint::save(*comm_, *strategy_, run_info(), {&strategy_->optimizer()}, o, step, 0);
}

std::uint64_t PySharded::load(const std::string& root) {
  py::gil_scoped_release release;
  const checkpoint::Loaded loaded = checkpoint::load_latest(root);
  const std::vector<float> initial = checkpoint::initial_params(layout_, loaded.wholes);
  std::unique_ptr<parallel::Strategy> s = make(initial);
  checkpoint::resume(*comm_, *s, loaded, run_info(), {&s->optimizer()},
                     []() -> Scheduler& { throw InvalidInput("the checkpoint holds an SWA run"); });
  adopt(std::move(s));
  return loaded.step;
}

py::dict PySharded::memory() const {
  const parallel::MemoryUse m = strategy_->memory();
  py::dict d;
  d["params"] = m.params;
  d["grads"] = m.grads + grads_.size() * sizeof(float);  // the flat buffer .grad views, where it is ours
  d["master_params"] = m.master_params;
  d["optimizer_state"] = m.optimizer_state;
  return d;
}

const ParamSlot& PySharded::slot(std::size_t i) const {
  if (i >= layout_.params.size()) throw InvalidInput(str("no parameter ", i));
  return layout_.params[i];
}

checkpoint::RunInfo PySharded::run_info() const {
  checkpoint::RunInfo r;
  r.strategy = strategy_name_;
  r.model = "torch";
  r.optimizer = spec_.name;
  return r;
}

std::unique_ptr<parallel::Strategy> PySharded::make(std::span<const float> initial) const {
  return parallel::make_strategy(strategy_name_, *comm_, layout_, initial, spec_, options_);
}

void PySharded::adopt(std::unique_ptr<parallel::Strategy> s) {
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

void PySharded::wait_for_params() {
  models::UnitAccess& access = strategy_->access();
  for (std::size_t u = 0; u < layout_.units.size(); ++u) {
    const float* p = access.acquire(u, models::Pass::forward).data();
    access.release(u, models::Pass::forward);
    DISTOPT_CHECK(p == values_[u], "unit ", u, "'s parameters moved");
  }
}

std::map<std::string, checkpoint::Whole> PySharded::gather_wholes() {
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

}  // namespace distopt::python
