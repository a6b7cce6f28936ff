// The engine core under ddp and zero1-3 (engine.hpp): buffers, the memory
// meter and pool, the optimizer's views, the buckets in flight, the step
// (the compressed reductions are in compressed.cpp).
#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "distopt/core/error.hpp"

namespace distopt::parallel::detail {

Pool::~Pool() { free_idle(); }

std::vector<Buffer>::const_iterator Pool::best_fit(std::size_t bytes) const {
  auto best = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it)
    if (it->size_bytes() >= bytes && (best == idle_.end() || it->size_bytes() < best->size_bytes())) best = it;
  return best;
}

std::size_t Pool::fit(std::size_t bytes) const {
  const auto best = best_fit(bytes);
  return best != idle_.end() ? best->size_bytes() : bytes;
}

void Pool::free_idle() {
  for (const Buffer& b : idle_) meter_.sub(kind_, b.size_bytes());
  idle_.clear();
}

Buffer Pool::take(std::size_t bytes, int slot) {
  const auto best = best_fit(bytes);
  if (best != idle_.end()) {
    Buffer b = std::move(idle_[static_cast<std::size_t>(best - idle_.cbegin())]);
    idle_.erase(best);
    if (lean_) free_idle();
    return b;
  }
  free_idle();
  meter_.add(kind_, bytes);
  return Buffer(bytes, slot);
}

Held::Held(Held&& o) noexcept : meter_(o.meter_), pool_(o.pool_), kind_(o.kind_), buf_(std::move(o.buf_)) {
  o.meter_ = nullptr;
  o.pool_ = nullptr;
}

Held& Held::operator=(Held&& o) noexcept {
  release();
  meter_ = o.meter_;
  pool_ = o.pool_;
  kind_ = o.kind_;
  buf_ = std::move(o.buf_);
  o.meter_ = nullptr;
  o.pool_ = nullptr;
  return *this;
}

void Held::release() {
  if (meter_ != nullptr) meter_->sub(kind_, buf_.size_bytes());
  if (pool_ != nullptr) pool_->give(std::move(buf_));
  meter_ = nullptr;
  pool_ = nullptr;
  buf_ = Buffer();
}

void to_f32(DType t, const void* src, float* dst, std::size_t n) {
  dispatch_dtype(t, [&]<class T>() {
    const T* s = static_cast<const T*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(s[i]);
  });
}

void from_f32(DType t, const float* src, void* dst, std::size_t n) {
  dispatch_dtype(t, [&]<class T>() {
    T* d = static_cast<T*>(dst);
    for (std::size_t i = 0; i < n; ++i) d[i] = from_float<T>(src[i]);
  });
}

void finish(std::unique_ptr<Request>& r) {
  if (!r) return;
  r->wait();
  r.reset();
}

void finish_quietly(std::unique_ptr<Request>& r) noexcept {
  try {
    finish(r);
  } catch (...) {
    r.reset();
  }
}

Engine::Engine(const StrategyArgs& a, Holding holding)
    : StrategyCore(a),
      dtype_(a.options.param_dtype),
      type_(elem_type_of(a.options.param_dtype)),
      es_(size_of(a.options.param_dtype)),
      rank_(static_cast<std::size_t>(a.comm.rank())),
      compression_(a.options.grad_compression),
      wire_dtype_(a.options.grad_compression == GradCompression::bf16   ? DType::bf16
                  : a.options.grad_compression == GradCompression::fp16 ? DType::f16
                                                                        : a.options.param_dtype),
      wire_type_(elem_type_of(wire_dtype_)),
      wire_es_(size_of(wire_dtype_)) {
  if (a.options.grad_compression != GradCompression::none && dtype_ != DType::f32)
    throw InvalidInput(str("--grad-compression ", name_of(a.options.grad_compression), " with --param-dtype ",
                           name_of(dtype_), ": the gradients are ", name_of(dtype_),
                           " on the wire already (compression is for f32 parameters)"));
  if (a.options.int8_gather && !holding.params)
    throw InvalidInput(
        str("--gather-compression int8 applies to zero3, which gathers its parameters before use; "
            "strategy ",
            info_.name, " holds them whole"));
  if (a.options.int8_gather && dtype_ != DType::f32)
    throw InvalidInput(str("--gather-compression int8 with --param-dtype ", name_of(dtype_),
                           ": the packets are made from fp32 shards (compression is for f32 parameters)"));
  const FlatLayout& flat = a.layout;
  const InitialParams& initial = a.initial;
  const OptimizerSpec& spec = a.optimizer;
  Communicator& comm = a.comm;
  DISTOPT_CHECK(initial.size() == flat.elements, initial.size(), " vs ", flat.elements);
  // What the strategy declares (checkpoints and require_exact read it) is
  // what it holds.
  DISTOPT_CHECK(info_.replicated_params == !holding.state && info_.whole_tensor_needs_gather == holding.state &&
                    info_.sharded_grads == holding.grads && info_.sharded_params == holding.params,
                info_.name, " declares what it does not hold");
  check_agreement(comm, info_.name, layout_, spec, a.options);
  const std::vector<ShardLayout::Piece> pieces = layout_.pieces(comm.rank());
  const std::size_t padded = layout_.padded_elements(), shard = layout_.shard_elements();
  // Read unit by unit (only the rank's piece of each where it keeps a
  // shard) through one unit's buffer: the whole model is never held here.
  std::vector<float> values;
  if (holding.params) {
    params_ = Held(meter_, Meter::params, shard * es_, 0);
    for (const auto& u : layout_.units()) {
      const std::size_t first = std::min(rank_ * u.shard, u.size());  // unit-local
      const std::size_t n = std::min(u.shard, u.size() - first);
      values.assign(u.shard, 0.0f);  // padding past the unit's end stays 0
      initial.read(u.begin + first, std::span<float>(values.data(), n));
      from_f32(dtype_, values.data(), params_.bytes() + u.shard_offset * es_, u.shard);
    }
  } else {
    params_ = Held(meter_, Meter::params, padded * es_, 0);
    for (const auto& u : layout_.units()) {
      values.resize(u.size());
      initial.read(u.begin, values);
      from_f32(dtype_, values.data(), params_.bytes() + u.padded_offset * es_, u.size());
    }
  }
  std::vector<float>().swap(values);
  grads_ = Held(meter_, Meter::grads, (holding.grads ? shard : padded) * es_, 1);
  if (compression_ == GradCompression::powersgd) {
    if (a.options.powersgd_rank < 1 || a.options.powersgd_rank > 65535)  // 16 bits in the agreement check
      throw InvalidInput(str("--powersgd-rank must be in [1, 65535] (got ", a.options.powersgd_rank, ")"));
    powersgd_ = std::make_unique<PowerSgd>(layout_, a.options.powersgd_rank);
    powersgd_warmup_ = a.options.powersgd_warmup;
  }
  if (compression_ == GradCompression::onebit) {
    if (holding.params)
      throw InvalidInput(
          str("--grad-compression onebit runs with ddp, zero1 and zero2: each rank advances the "
              "whole first moment with its own gradient, which needs the parameters whole (strategy ",
              info_.name, " shards them)"));
    if (a.options.onebit_warmup < 1)
      throw InvalidInput("--onebit-warmup must be at least 1 step: the variance is frozen after the warm-up");
    onebit_warmup_ = a.options.onebit_warmup;
    residual_ = Held(meter_, Meter::grads, padded * sizeof(float), 10);
    sum_residual_ = Held(meter_, Meter::grads, shard * sizeof(float), 11);
    moment_ = Held(meter_, Meter::grads, padded * sizeof(float), 12);
    denominator_ = Held(meter_, Meter::grads, padded * sizeof(float), 13);
    std::memset(residual_.bytes(), 0, residual_.size_bytes());
    std::memset(sum_residual_.bytes(), 0, sum_residual_.size_bytes());
    const auto& params = layout_.params();
    gaps_.resize(layout_.units().size());
    for (std::size_t u = 0, p = 0; u < layout_.units().size(); ++u) {
      const auto& unit = layout_.units()[u];
      std::size_t at = 0;  // unit-local
      for (; p < params.size() && layout_.unit_of(p) == u; ++p) {
        const std::size_t begin = layout_.padded_offset(p) - unit.padded_offset;
        if (begin > at) gaps_[u].emplace_back(at, begin);
        at = begin + params[p].numel();
      }
      if (at < unit.padded) gaps_[u].emplace_back(at, unit.padded);
    }
  }
  if (compression_ == GradCompression::int8 || powersgd_) {
    residual_ = Held(meter_, Meter::grads, padded * sizeof(float), 10);
    std::memset(residual_.bytes(), 0, residual_.size_bytes());
    if (info_.replicated_params && compression_ == GradCompression::int8) {
      sum_residual_ = Held(meter_, Meter::grads, shard * sizeof(float), 11);
      std::memset(sum_residual_.bytes(), 0, sum_residual_.size_bytes());
    }
  }
  std::vector<Param> views;
  for (const ParamSlot& s : layout_.params()) {
    const auto& piece = pieces[views.size()];
    if (!holding.state) {
      const std::size_t at = layout_.padded_offset(piece.param);
      views.push_back({s.name, {params_.bytes() + at * es_, dtype_, s.shape}, {grads_.bytes() + at * es_, dtype_, s.shape}, true});
      // Statistics of tensor_stats rules over the same piece as zero1-3's.
      views.back().stat_begin = piece.param_begin;
      views.back().stat_count = piece.count;
      owned_.push_back({grads_.bytes() + piece.padded_offset * es_, dtype_, {std::int64_t(piece.count)}});
      continue;
    }
    const Shape shape{std::int64_t(piece.count)};
    // zero1/2 step the own region of the padded buffer in place and gather
    // it; zero3 steps its shard buffer. Gradients: zero1 reduce-scatters
    // in place into the padded buffer, zero2/3 into the shard buffer.
    const std::size_t p_at = holding.params ? piece.shard_offset : piece.padded_offset;
    const std::size_t g_at = holding.grads ? piece.shard_offset : piece.padded_offset;
    views.push_back({s.name, {params_.bytes() + p_at * es_, dtype_, shape}, {grads_.bytes() + g_at * es_, dtype_, shape}, true});
    views.back().tensor_shape = s.shape;  // rows and columns for the rules that need them
    views.back().tensor_offset = piece.param_begin;
    owned_.push_back(views.back().grad);
  }
  optimizer_ = std::make_unique<Optimizer>(spec.name, optimizer_groups(spec, std::move(views)), spec.options);
  param_group_.resize(optimizer_->num_params());
  for (std::size_t g = 0; g < optimizer_->num_groups(); ++g) {
    for (std::size_t i : optimizer_->group(g).params) param_group_[i] = g;
    const RuleInfo& rule = optimizer_->rule_of_group(g);
    if (compression_ == GradCompression::onebit && rule.moment == nullptr)
      throw InvalidInput(str("--grad-compression onebit is 1-bit Adam: it runs with --optimizer adam or adamw (",
                             rule.name, " has no 1-bit form; 1-bit LAMB is not built)"));
    if (compression_ == GradCompression::onebit &&
        state_dtype_of(optimizer_->group(g).options) != quant::StateDType::f32)
      throw InvalidInput(
          "--grad-compression onebit keeps the optimizer state in f32 (its moments are averaged "
          "compressed already): drop the quantized state dtype");
  }
  // tensor_stats rules: each rank's partial statistics of its pieces,
  // summed over the ranks in rank order -- the same numbers in the same
  // order under every strategy (docs/sharding.md, "Non-pointwise rules").
  if (comm.size() > 1)
    optimizer_->set_stats_reduce([this](std::span<double> v) {
      blocked([&] { comm_.all_reduce(v.data(), v.data(), v.size(), ElemType::f64, ReduceOp::sum); });
    });
  // whole_tensor rules: each tensor's pieces, all-gathered in rank order
  // (a rank's piece of a tensor precedes the next rank's).
  if (holding.state) {
    for (std::size_t p = 0; p < layout_.params().size(); ++p) {
      std::vector<std::size_t> counts;
      for (int r = 0; r < comm.size(); ++r) counts.push_back(layout_.pieces(r)[p].count);
      piece_counts_[layout_.params()[p].name] = std::move(counts);
    }
    optimizer_->set_tensor_gather([this](const Param& p, std::span<const float> piece, std::span<float> whole) {
      const std::vector<std::size_t>& counts = piece_counts_.at(p.name);
      // Held whole by one rank: that rank steps it alone (no gather there).
      if (std::count(counts.begin(), counts.end(), std::size_t{0}) + 1 == std::ptrdiff_t(counts.size())) return false;
      blocked([&] { comm_.all_gather_v(piece.data(), whole.data(), counts, ElemType::f32); });
      return true;
    });
  }
}

// Waits for every reduction still using our buffers, ignoring their
// errors: after a failure the buffers must not be freed under a collective
// that still writes into them. (A strategy drains its own requests in its
// destructor, which runs first.)
Engine::~Engine() {
  for (InFlight& f : in_flight_)
    for (auto& r : f.requests) finish_quietly(r);
}

MemoryUse Engine::memory() const {
  MemoryUse m;
  m.params = meter_.peak(Meter::params);
  m.grads = meter_.peak(Meter::grads);
  m.master_params = optimizer_->master_bytes();
  m.optimizer_state = optimizer_->state_bytes() - m.master_params;
  return m;
}

std::unique_ptr<models::UnitAccess> Engine::access_to(std::span<const float> own) {
  return std::make_unique<ValuesAccess>(comm_, layout_, own, info_.replicated_params);
}

void Engine::for_each_param(std::span<const float> own, const ParamVisitor& each) {
  if (info_.replicated_params) {
    DISTOPT_CHECK(own.size() == layout_.padded_elements(), own.size(), " vs ", layout_.padded_elements());
    for_each_padded_param(layout_, own, each);
    return;
  }
  const auto& params = layout_.params();
  DISTOPT_CHECK(own.size() == layout_.shard_elements(), own.size(), " vs ", layout_.shard_elements());
  // Unit by unit through one unit's buffer from the pool (zero3: one the
  // last pass left idle); units hold consecutive parameters, so the visits
  // are in slot order.
  std::size_t p = 0;
  for (std::size_t u = 0; u < layout_.units().size(); ++u) {
    const auto& unit = layout_.units()[u];
    if (unit.tile > 0) {
      // A tiled unit: each parameter in pieces of at most a tile, each
      // gathered from the ranks whose shards hold it.
      Held buffer(param_pool_, unit.tile * sizeof(float), 3);
      auto* values = reinterpret_cast<float*>(buffer.bytes());
      for (; p < params.size() && layout_.unit_of(p) == u; ++p) {
        const std::size_t first = params[p].offset - unit.begin, last = first + params[p].numel();
        for (std::size_t b = first; b < last; b += unit.tile) {
          const std::size_t e = std::min(last, b + unit.tile);
          const ShardLayout::Range r = layout_.range(u, comm_.rank(), b, e);
          comm_.all_gather_v(own.data() + r.shard_at, values, r.counts, ElemType::f32);
          each(p, {values, e - b});
        }
      }
      continue;
    }
    Held buffer(param_pool_, unit.padded * sizeof(float), 3);
    auto* values = reinterpret_cast<float*>(buffer.bytes());
    comm_.all_gather(own.data() + unit.shard_offset, values, unit.shard, ElemType::f32);
    for (; p < params.size() && layout_.unit_of(p) == u; ++p)
      each(p, {values + (layout_.padded_offset(p) - unit.padded_offset), params[p].numel()});
  }
  DISTOPT_CHECK(p == params.size(), p, " of ", params.size(), " parameters visited");
}

void Engine::for_each_current_param(const ParamVisitor& each) {
  if (info_.sharded_params) {
    for_each_param(own_params(), each);
    return;
  }
  // Every rank holds them whole once the gathers of the last update are in.
  blocked([&] { finish_param_reads(); });
  if (dtype_ == DType::f32) {
    for_each_padded_param(layout_, {reinterpret_cast<const float*>(params_.bytes()), layout_.padded_elements()}, each);
    return;
  }
  const auto& params = layout_.params();
  std::vector<float> values;  // a parameter's fp32 values
  for (std::size_t p = 0; p < params.size(); ++p) {
    const char* at = params_.bytes() + layout_.padded_offset(p) * es_;
    values.resize(params[p].numel());
    to_f32(dtype_, at, values.data(), values.size());
    each(p, values);
  }
}

std::span<const float> Engine::acquire(std::size_t u, models::Pass pass) {
  const auto& unit = layout_.units().at(u);
  const char* values = values_of(u, pass);
  if (dtype_ == DType::f32) return {reinterpret_cast<const float*>(values), unit.size()};
  compute_.erase(u);  // a unit acquired again without a release: one copy, counted once
  Held& c = compute_[u];
  c = Held(param_pool_, unit.size() * sizeof(float), 4);
  to_f32(dtype_, values, reinterpret_cast<float*>(c.bytes()), unit.size());
  return {reinterpret_cast<const float*>(c.bytes()), unit.size()};
}

void Engine::release(std::size_t u, models::Pass) { compute_.erase(u); }

std::span<const float> Engine::acquire_range(std::size_t u, std::size_t begin, std::size_t end, models::Pass pass) {
  if (dtype_ == DType::f32) return UnitAccess::acquire_range(u, begin, end, pass);
  DISTOPT_CHECK(begin <= end && end <= layout_.units().at(u).size(), "range [", begin, ", ", end, ") of unit ", u);
  const char* values = values_of(u, pass);
  compute_.erase(u);
  Held& c = compute_[u];
  c = Held(param_pool_, (end - begin) * sizeof(float), 4);
  to_f32(dtype_, values + begin * es_, reinterpret_cast<float*>(c.bytes()), end - begin);
  return {reinterpret_cast<const float*>(c.bytes()), end - begin};
}

std::span<float> Engine::grads(std::size_t u) {
  const auto& unit = layout_.units().at(u);
  grad_target_ = grad_target(u);
  if (dtype_ == DType::f32) return {reinterpret_cast<float*>(grad_target_), unit.size()};
  grad_compute_ = Held(grad_pool_, unit.size() * sizeof(float), 5);
  return {reinterpret_cast<float*>(grad_compute_.bytes()), unit.size()};
}

void Engine::grads_done(std::size_t u) {
  const auto& unit = layout_.units().at(u);
  if (dtype_ != DType::f32) {
    from_f32(dtype_, reinterpret_cast<const float*>(grad_compute_.bytes()), grad_target_, unit.size());
    grad_compute_ = Held();
  }
  const long b = layout_.bucket_ending_at(u);
  if (b >= 0) reduce_bucket(static_cast<std::size_t>(b));
}

void Engine::step(const UpdateFn& update) {
  // A gather still reading the parameters must finish before the update
  // writes them (a unit the model did not use since the last step).
  blocked([&] { finish_param_reads(); });
  blocked([&] {
    while (!in_flight_.empty()) finish_oldest();
  });
  for (std::size_t i = 0; i < optimizer_->num_params(); ++i) optimizer_->param(i).has_grad = true;
  // 1-bit Adam past its warm-up: the gradients are the averaged moments.
  optimizer_->set_frozen_since(wire() == Wire::onebit ? std::optional<std::uint64_t>(onebit_warmup_) : std::nullopt);
  const GradShard shard{owned_, [this](double& v, bool max) {
                          blocked([&] {
                            comm_.all_reduce(&v, &v, 1, ElemType::f64, max ? ReduceOp::max : ReduceOp::sum);
                          });
                        }};
  if (update)
    update(*optimizer_, shard);
  else
    optimizer_->step();
  after_update();
  ++steps_;
}

Strategy::Feedback Engine::feedback() {
  auto span = [](Held& h) {
    return std::span<float>(reinterpret_cast<float*>(h.bytes()), h.size_bytes() / sizeof(float));
  };
  Feedback f{span(residual_), span(sum_residual_), {}};
  if (powersgd_)
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b)
      for (const PowerSgd::Matrix& m : powersgd_->bucket(b).matrices)
        if (m.rank > 0) f.factors.push_back({m.param, m.rank, powersgd_->qs().subspan(m.q_at, m.cols * m.rank)});
  return f;
}

Engine::Wire Engine::wire() const {
  switch (compression_) {
    case GradCompression::none:
      return Wire::plain;
    case GradCompression::bf16:
    case GradCompression::fp16:
      return Wire::rounded;
    case GradCompression::int8:
      return Wire::int8;
    case GradCompression::powersgd:
      return steps_ < powersgd_warmup_ ? Wire::plain : Wire::powersgd;
    case GradCompression::onebit:
      return steps_ < onebit_warmup_ ? Wire::plain : Wire::onebit;
  }
  return Wire::plain;
}
void Engine::finish_oldest() {
  InFlight& f = in_flight_.front();
  DISTOPT_CHECK(!f.requests.empty(), "bucket ", f.bucket, " was never reduced: backward skipped a unit");
  for (auto& r : f.requests) r->wait();
  if (f.then) f.then();
  in_flight_.pop_front();
}

void Engine::reduce_scatter_on_wire(InFlight& f, std::size_t b, const char* g) {
  const auto& bucket = layout_.buckets()[b];
  f.scratch = to_wire(g, bucket.padded);  // zero2/3: their fp32 scratch goes back to the pool
  char* w = f.scratch.bytes();
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    char* at = w + (unit.padded_offset - bucket.padded_offset) * wire_es_;
    f.requests.push_back(
        comm_.ireduce_scatter(at, at + rank_ * unit.shard * wire_es_, unit.shard, wire_type_, ReduceOp::sum));
  }
  f.then = [this, b, w] {
    const auto& bk = layout_.buckets()[b];
    for (std::size_t u = bk.first; u < bk.last; ++u) {
      const auto& unit = layout_.units()[u];
      to_f32(wire_dtype_, w + (unit.padded_offset - bk.padded_offset + rank_ * unit.shard) * wire_es_,
             reinterpret_cast<float*>(grads_.bytes() + own_grad_offset(unit) * es_), unit.shard);
    }
  };
}

void Engine::deliver(std::size_t b, const float* reduced) {
  const auto& bucket = layout_.buckets()[b];
  auto* grads = reinterpret_cast<float*>(grads_.bytes());
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const float* from = reduced + (unit.padded_offset - bucket.padded_offset);
    if (info_.sharded_grads) std::copy_n(from + rank_ * unit.shard, unit.shard, grads + unit.shard_offset);
    else std::copy_n(from, unit.padded, grads + unit.padded_offset);
  }
}

Held Engine::to_wire(const char* g, std::size_t n) {
  DISTOPT_CHECK(dtype_ == DType::f32 && wire_dtype_ != dtype_, "compressing ", name_of(dtype_), " gradients to ",
                name_of(wire_dtype_));
  Held w(grad_pool_, n * wire_es_, 8);
  from_f32(wire_dtype_, reinterpret_cast<const float*>(g), w.bytes(), n);
  return w;
}

}  // namespace distopt::parallel::detail
