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
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "bindings.hpp"
#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::python {

namespace {

// The registry's strategies that `keep` admits, in its order.
std::vector<std::string> strategies_where(bool (*keep)(const parallel::StrategyInfo&)) {
  std::vector<std::string> out;
  for (const parallel::StrategyInfo* s : parallel::all_strategies())
    if (keep(*s)) out.emplace_back(s->name);
  return out;
}

// A unit's gradient as torch computed it (`src`) into the strategy's
// buffer (`dst`, which may be the same memory): divided by the world size,
// as torch's DDP divides it. Every path into a strategy here hands it so.
void hand_over(std::span<float> dst, const float* src, int world) {
  if (world > 1)
    for (std::size_t k = 0; k < dst.size(); ++k) dst[k] = src[k] / static_cast<float>(world);
  else if (src != dst.data()) std::memcpy(dst.data(), src, dst.size_bytes());
}

}  // namespace

std::vector<std::string> sharded_strategies() {
  return strategies_where([](const parallel::StrategyInfo& s) { return !s.per_rank_models && !s.sharded_params; });
}

std::vector<std::string> gathering_strategies() {
  return strategies_where([](const parallel::StrategyInfo& s) { return !s.per_rank_models && s.sharded_params; });
}

std::vector<std::string> gossip_strategies() {
  return strategies_where([](const parallel::StrategyInfo& s) { return s.per_rank_models; });
}

// ---- the sharded optimizer -------------------------------------------------

parallel::FlatLayout layout_of(const std::vector<ParamSpec>& params, const std::vector<UnitSpec>& units) {
  parallel::FlatLayout flat;
  for (const auto& [name, shape] : params) {
    ParamSlot s{name, 0, Shape(shape.begin(), shape.end())};
    if (s.numel() == 0) throw InvalidInput(str(name, " has no elements"));
    flat.params.push_back(std::move(s));
  }
  if (flat.params.empty()) throw InvalidInput("the optimizer got an empty parameter list");
  // One unit per parameter, or the units given: a unit's parameters in
  // order, each tensor of 4096 or more elements on a multiple of 256 of its
  // unit (place_in_unit, as the C++ models place theirs), so that quantized
  // state's blocks never straddle a shard; the gaps hold zeros.
  std::vector<UnitSpec> each;
  if (units.empty())
    for (const ParamSlot& s : flat.params) each.emplace_back(s.name, 1);
  std::size_t first = 0;
  for (const auto& [name, count] : units.empty() ? each : units) {
    if (count == 0 || count > flat.params.size() - first)
      throw InvalidInput(
          str("unit ", name, ": ", count, " parameters from parameter ", first, " of ", flat.params.size()));
    const std::size_t begin = flat.elements;
    std::size_t at = 0;
    for (std::size_t i = first; i < first + count; ++i) {
      at = place_in_unit(at, flat.params[i].numel());
      flat.params[i].offset = begin + at;
      at += flat.params[i].numel();
    }
    flat.elements = begin + at;
    flat.units.push_back({name, begin, flat.elements});
    first += count;
  }
  if (first != flat.params.size())
    throw InvalidInput(str("the units hold ", first, " of the ", flat.params.size(), " parameters"));
  return flat;
}

UnitOffsets unit_offsets(const std::vector<ParamSpec>& params, const std::vector<UnitSpec>& units) {
  const parallel::FlatLayout flat = layout_of(params, units);
  UnitOffsets out;
  std::size_t u = 0;
  for (const ParamSlot& s : flat.params) {
    while (s.offset >= flat.units[u].end) ++u;
    out.offsets.push_back(s.offset - flat.units[u].begin);
  }
  for (const parallel::UnitRange& r : flat.units) out.lengths.push_back(r.end - r.begin);
  return out;
}

namespace {

// StrategyOptions' live limits and gradient compression (PowerSGD's rank
// and warm-up too) from Python's keyword names.
void set_strategy_options(parallel::StrategyOptions& o, const py::dict& given) {
  for (const auto& [k, v] : given) {
    const std::string key = py::str(k);
    if (key == "grad_compression") {
      const std::string name = py::str(v);
      const auto c = parallel::parse_grad_compression(name);
      if (!c) throw InvalidInput(str("compression '", name, "' is not one of ", parallel::grad_compression_names()));
      o.grad_compression = *c;
      continue;
    }
    if (key == "int8_gather") {
      o.int8_gather = v.cast<bool>();
      continue;
    }
    const long long n = v.cast<long long>();
    if (key == "powersgd_rank" && n >= 1 && n <= 65535) o.powersgd_rank = static_cast<int>(n);
    else if (key == "powersgd_warmup" && n >= 0) o.powersgd_warmup = static_cast<std::size_t>(n);
    else if (key == "powersgd_rank" || key == "powersgd_warmup")
      throw InvalidInput(
          str(key, key == "powersgd_rank" ? " must be in [1, 65535]" : " must be 0 or more", " (got ", n, ")"));
    else if (key == "onebit_warmup" && n >= 1) o.onebit_warmup = static_cast<std::size_t>(n);
    else if (key == "onebit_warmup")
      throw InvalidInput(str("onebit_warmup must be at least 1 step: the variance is frozen after it (got ", n, ")"));
    else if (key == "prefetch_units" && n >= 0) o.prefetch_units = static_cast<int>(n);
    else if (key == "max_live_params" && n >= 0) o.max_live_params = static_cast<std::size_t>(n);
    else if (key == "max_buckets_in_flight" && n >= 1) o.max_buckets_in_flight = static_cast<int>(n);
    else if (key == "prefetch_units" || key == "max_live_params" || key == "max_buckets_in_flight")
      throw InvalidInput(str(key, " must be at least ", key == "max_buckets_in_flight" ? 1 : 0, " (got ", n, ")"));
    else
      throw InvalidInput(
          str("unknown strategy option ", key,
              " (prefetch_units, max_live_params, "
              "max_buckets_in_flight, grad_compression, powersgd_rank, powersgd_warmup, onebit_warmup, int8_gather)"));
  }
}

}  // namespace

std::vector<std::vector<std::vector<float>>> replay_strategy(
    const std::string& strategy, const std::string& rule, const std::vector<ParamSpec>& params,
    std::span<const float> initial, const OptionMap& options, const parallel::GossipOptions& gossip,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  const parallel::FlatLayout layout = layout_of(params);
  if (initial.size() != layout.elements)
    throw InvalidInput(str("initial values: ", initial.size(), " elements for parameters of ", layout.elements));
  if (grads.empty() || grads[0].empty()) throw InvalidInput("replay_strategy: no steps or no ranks");
  const int world = static_cast<int>(grads[0].size());
  for (const auto& step : grads) {
    if (step.size() != grads[0].size()) throw InvalidInput("replay_strategy: every step needs every rank's gradient");
    for (const auto& g : step)
      if (g.size() != layout.elements)
        throw InvalidInput(str("replay_strategy: a gradient of ", g.size(), " elements for ", layout.elements));
  }
  parallel::OptimizerSpec spec{rule, options, std::string(rule_or_throw(rule).companion)};
  parallel::StrategyOptions so;
  so.gossip = gossip;
  std::vector<std::vector<std::vector<float>>> out(world);
  spawn(world, [&](Communicator& comm) {
    const int r = comm.rank();
    auto s = parallel::make_strategy(strategy, comm, layout, initial, spec, so);
    models::UnitAccess& access = s->access();
    for (const auto& step : grads) {
      const std::vector<float>& mine = step[r];
      for (std::size_t u = layout.units.size(); u-- > 0;) {
        hand_over(access.grads(u), mine.data() + layout.units[u].begin, world);
        access.grads_done(u);
      }
      s->step();
      std::vector<float>& model = out[r].emplace_back(layout.elements);
      for (std::size_t u = 0; u < layout.units.size(); ++u) {
        const std::span<const float> p = access.acquire(u, models::Pass::forward);
        std::copy(p.begin(), p.end(), model.begin() + static_cast<std::ptrdiff_t>(layout.units[u].begin));
        access.release(u, models::Pass::forward);
      }
    }
  });
  return out;
}

namespace {
std::set<PySharded*>& live_sharded() {  // the Python thread's only (under the GIL)
  static std::set<PySharded*> live;
  return live;
}
}  // namespace

PySharded::PySharded(std::shared_ptr<Communicator> comm, const std::string& strategy, const std::string& rule,
                     const std::vector<ParamSpec>& params,
                     py::array_t<float, py::array::c_style | py::array::forcecast> initial, const py::dict& options,
                     std::size_t bucket_elements, const py::dict& gossip, const std::vector<UnitSpec>& units,
                     const py::dict& strategy_options)
    : comm_(std::move(comm)), strategy_name_(strategy), layout_(layout_of(params, units)) {
  const StrategyInfo_& info = parallel::strategy_or_throw(strategy);
  per_rank_ = info.per_rank_models;
  gathers_ = info.sharded_params;
  if (per_rank_) options_.gossip = gossip_options(strategy, gossip);
  else if (!gossip.empty()) throw InvalidInput(str("gossip options apply to the gossip strategies, not ", strategy));
  set_strategy_options(options_, strategy_options);
  if (gathers_) options_.prefetch_units = 0;  // Python prefetches (gather_start), into torch's storage
  if (bucket_elements == 0) throw InvalidInput("bucket_elements must be at least 1");
  for (std::size_t u = 0; u < layout_.units.size(); ++u)
    for (std::size_t i = unit_of_.size(); i < layout_.params.size() && layout_.params[i].offset < layout_.units[u].end;
         ++i)
      unit_of_.push_back(u);
  spec_.name = rule;
  spec_.options = to_options(options);
  spec_.fallback = std::string(rule_or_throw(rule).companion);
  options_.bucket_elements = bucket_elements;
  hooked_ = info.sharded_grads;
  pending_ = layout_.units.size();
  if (per_rank_) model_.assign(layout_.elements, 0.0f);
  if (static_cast<std::size_t>(initial.size()) != layout_.elements)
    throw InvalidInput(str("initial values: ", initial.size(), " elements for parameters of ", layout_.elements));
  // Every rank starts from rank 0's parameters, as torch's DDP does (in
  // the caller's array: no copy of the model in flight).
  const std::span<float> init(initial.mutable_data(), layout_.elements);
  py::gil_scoped_release release;
  comm_->broadcast(init.data(), init.size(), ElemType::f32, 0);
  adopt(make(std::span<const float>(init)));
  const Optimizer& opt = strategy_->optimizer();
  for (std::size_t g = 0; g < opt.num_groups(); ++g) base_lr_.push_back(opt.lr(g));
  py::gil_scoped_acquire gil;
  live_sharded().insert(this);
}

void retire_all_sharded() {
  for (PySharded* s : live_sharded()) s->retire();
}

void PySharded::retire() {
  py::gil_scoped_release release;  // a torch transport's requests take it
  for (auto& [u, r] : gathers_in_flight_)
    if (r) r->wait();
  gathers_in_flight_.clear();
  strategy_.reset();
  retired_.clear();
}

PySharded::~PySharded() {
  live_sharded().erase(this);
  retire();
}

py::array PySharded::param(py::object self, std::size_t i) {
  const ParamSlot& s = slot(i);
  if (gathers_) throw InvalidInput(str("strategy ", strategy_name_, " holds parameter shards (gather each unit)"));
  const std::size_t u = unit_of_[i];
  return py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()),
                            values_[u] + (s.offset - layout_.units[u].begin), self);
}

py::array PySharded::grad(py::object self, std::size_t i) {
  const ParamSlot& s = slot(i);
  if (hooked_) throw InvalidInput(str("strategy ", strategy_name_, " has no gradient buffer (deliver each unit)"));
  const std::size_t u = unit_of_[i];
  return py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()),
                            grad_at_[u] + (s.offset - layout_.units[u].begin), self);
}

void PySharded::zero_grads() {
  if (hooked_) return;  // nothing of ours: torch's .grad tensors
  for (std::size_t u = 0; u < layout_.units.size(); ++u)
    std::fill_n(grad_at_[u], layout_.units[u].end - layout_.units[u].begin, 0.0f);
}

double PySharded::step(double max_norm, double norm_type) {
  py::gil_scoped_release release;
  models::UnitAccess& access = strategy_->access();
  if (per_rank_) check_model_unchanged();
  if (hooked_ && pending_ != 0)
    throw InvalidInput(str("step: ", pending_, " of ", layout_.units.size(), " gradients not delivered"));
  for (auto& [u, r] : gathers_in_flight_)  // they read the shards the update writes
    if (r) r->wait();
  gathers_in_flight_.clear();
  // ddp, zero1, gossip: backward wrote each gradient into the strategy's
  // own buffer (zero2's were delivered during backward).
  for (std::size_t u = hooked_ ? 0 : layout_.units.size(); u-- > 0;) {
    const auto& unit = layout_.units[u];
    const std::span<float> g = access.grads(u);
    DISTOPT_CHECK(g.size() == unit.end - unit.begin, g.size(), " vs ", unit.end - unit.begin);
    DISTOPT_CHECK(grad_at_[u] == g.data(), "unit ", u, "'s gradient moved");
    hand_over(g, g.data(), comm_->size());
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
  ++steps_;
  pending_ = layout_.units.size();
  wait_for_params();
  return norm;
}

std::size_t PySharded::unit_padded(std::size_t u) const {
  if (u >= layout_.units.size()) throw InvalidInput(str("no unit ", u));
  return strategy_->layout().units()[u].padded;
}

void PySharded::gather_start(std::size_t u, std::uintptr_t address) {
  if (!gathers_) throw InvalidInput(str("strategy ", strategy_name_, " holds whole parameters"));
  if (u >= layout_.units.size()) throw InvalidInput(str("no unit ", u));
  if (address == 0) throw InvalidInput(str("gather_start: unit ", u, " into a null address"));
  if (gathers_in_flight_.contains(u)) throw InvalidInput(str("gather_start: unit ", u, " is being gathered"));
  const std::span<const float> own = strategy_->own_params();  // zero3, f32: the shard buffer itself
  const auto& unit = strategy_->layout().units()[u];
  py::gil_scoped_release release;
  gathers_in_flight_[u] =
      comm_->iall_gather(own.data() + unit.shard_offset, reinterpret_cast<void*>(address), unit.shard, ElemType::f32);
}

void PySharded::gather_wait(std::size_t u) {
  const auto it = gathers_in_flight_.find(u);
  if (it == gathers_in_flight_.end()) return;  // complete already (a step waited for it)
  std::unique_ptr<Request> r = std::move(it->second);
  gathers_in_flight_.erase(it);
  py::gil_scoped_release release;
  if (r) r->wait();
}

void PySharded::deliver_parts(std::size_t u, const py::list& grads) {
  if (!hooked_) throw InvalidInput(str("strategy ", strategy_name_, " takes its gradients at the step"));
  if (pending_ == 0 || u + 1 != pending_)
    throw InvalidInput(str("deliver: unit ", u, " out of order (next: ", next_unit(), ")"));
  const auto& unit = layout_.units[u];
  // One gradient per parameter of the unit, each placed at its parameter's
  // offset; the gaps between them (place_in_unit) are zeros.
  const auto first = static_cast<std::size_t>(std::lower_bound(unit_of_.begin(), unit_of_.end(), u) - unit_of_.begin());
  std::vector<py::array_t<float, py::array::c_style | py::array::forcecast>> parts;
  for (const auto& g : grads) {
    parts.push_back(py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(g));
    if (!parts.back()) throw InvalidInput(str("deliver: unit ", u, ": a gradient is not a float array"));
    const std::size_t i = first + parts.size() - 1;
    if (i >= unit_of_.size() || unit_of_[i] != u)
      throw InvalidInput(str("deliver: unit ", u, " has ", parts.size() - 1, " parameters, got more gradients"));
    if (static_cast<std::size_t>(parts.back().size()) != layout_.params[i].numel())
      throw InvalidInput(str("deliver: unit ", u, ": the gradient of ", layout_.params[i].name, " has ",
                             parts.back().size(), " elements, the parameter ", layout_.params[i].numel()));
  }
  if (first + parts.size() < unit_of_.size() && unit_of_[first + parts.size()] == u)
    throw InvalidInput(str("deliver: unit ", u, ": ", parts.size(), " gradients for more parameters"));
  py::gil_scoped_release release;
  models::UnitAccess& access = strategy_->access();
  const std::span<float> dst = access.grads(u);
  DISTOPT_CHECK(dst.size() == unit.end - unit.begin, dst.size(), " vs ", unit.end - unit.begin);
  std::size_t at = 0;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const ParamSlot& s = layout_.params[first + k];
    const std::size_t from = s.offset - unit.begin, n = s.numel();
    std::fill(dst.begin() + static_cast<std::ptrdiff_t>(at), dst.begin() + static_cast<std::ptrdiff_t>(from), 0.0f);
    hand_over(dst.subspan(from, n), parts[k].data(), comm_->size());
    at = from + n;
  }
  std::fill(dst.begin() + static_cast<std::ptrdiff_t>(at), dst.end(), 0.0f);
  --pending_;
  access.grads_done(u);
}

void PySharded::deliver(std::size_t u, py::handle g) {
  py::list one;
  one.append(g);
  deliver_parts(u, one);
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
  checkpoint::load_optimizer_state(*strategy_, checkpoint::WholeTensors(wholes));
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
  const checkpoint::LoadedTensors saved(loaded);
  std::unique_ptr<parallel::Strategy> s = make(checkpoint::initial_params(layout_, saved));
  std::string warning = checkpoint::resume(*comm_, *s, loaded, run_info(), {&s->optimizer()}, []() -> Scheduler& {
    throw InvalidInput("the checkpoint holds an SWA run");
  });
  adopt(std::move(s));
  pending_ = layout_.units.size();
  steps_ = loaded.step;
  load_warning_ = std::move(warning);
  return loaded.step;
}

py::dict PySharded::memory() const {
  const parallel::MemoryUse m = strategy_->memory();
  py::dict d;
  d["params"] = m.params + model_.size() * sizeof(float);  // a gossip model's copy torch views
  d["grads"] = m.grads;
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
  r.gossip = options_.gossip;
  return r;
}

std::unique_ptr<parallel::Strategy> PySharded::make(const parallel::InitialParams& initial) const {
  return parallel::make_strategy(strategy_name_, *comm_, layout_, initial, spec_, options_);
}

void PySharded::adopt(std::unique_ptr<parallel::Strategy> s) {
  if (strategy_) retired_.push_back(std::move(strategy_));
  strategy_ = std::move(s);
  values_.assign(layout_.units.size(), nullptr);
  models::UnitAccess& access = strategy_->access();
  for (std::size_t u = 0; u < layout_.units.size() && !gathers_; ++u) {
    values_[u] = per_rank_ ? model_.data() + layout_.units[u].begin
                           : const_cast<float*>(access.acquire(u, models::Pass::forward).data());
    if (!per_rank_) access.release(u, models::Pass::forward);
  }
  if (per_rank_) wait_for_params();
  // ddp, zero1: where backward writes unit u's gradient, in every step.
  grad_at_.assign(layout_.units.size(), nullptr);
  if (!hooked_) {
    for (std::size_t u = 0; u < layout_.units.size(); ++u) {
      const std::span<float> g = access.grads(u);
      std::fill(g.begin(), g.end(), 0.0f);
      grad_at_[u] = g.data();
    }
  }
}

void PySharded::wait_for_params() {
  if (gathers_) return;  // each unit gathered when the model runs it (gather_start)
  models::UnitAccess& access = strategy_->access();
  for (std::size_t u = 0; u < layout_.units.size(); ++u) {
    const std::span<const float> p = access.acquire(u, models::Pass::forward);
    if (per_rank_) std::copy(p.begin(), p.end(), values_[u]);
    else DISTOPT_CHECK(p.data() == values_[u], "unit ", u, "'s parameters moved");
    access.release(u, models::Pass::forward);
  }
}

void PySharded::check_model_unchanged() {
  models::UnitAccess& access = strategy_->access();
  for (std::size_t u = 0; u < layout_.units.size(); ++u) {
    const std::span<const float> p = access.acquire(u, models::Pass::forward);
    const bool same = std::memcmp(p.data(), values_[u], p.size_bytes()) == 0;
    access.release(u, models::Pass::forward);
    if (!same)
      throw InvalidInput(str(layout_.units[u].name,
                             " was written since the last step (in place, or inside `with "
                             "model.averaged()`): a gossip rank's model is the strategy's, which the step would "
                             "overwrite it with; load values with load(), or make the optimizer after loading them"));
  }
}

double PySharded::consensus_distance() {
  py::gil_scoped_release release;
  return strategy_->consensus_distance();
}

std::vector<py::array> PySharded::averaged() {
  std::vector<std::vector<float>> values(layout_.params.size());
  {
    py::gil_scoped_release release;
    strategy_->for_each_current_param([&](std::size_t p, std::span<const float> v) {
      values.at(p).insert(values[p].end(), v.begin(), v.end());  // a tiled parameter comes in pieces
    });
  }
  std::vector<py::array> out;
  for (std::size_t p = 0; p < values.size(); ++p) {
    const ParamSlot& s = layout_.params[p];
    DISTOPT_CHECK(values[p].size() == s.numel(), values[p].size(), " vs ", s.numel());
    py::array_t<float> a(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()));
    std::copy(values[p].begin(), values[p].end(), a.mutable_data());
    out.push_back(std::move(a));
  }
  return out;
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
