// The engine core under ddp and zero1-3 (engine.hpp): buffers, the memory
// meter and pool, the optimizer's views, the buckets in flight, the step.
#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "distopt/core/error.hpp"
#include "int8_wire.hpp"
#include "onebit_wire.hpp"

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

void Engine::reduce_int8(InFlight& f, std::size_t b, const char* g) {
  const auto& bucket = layout_.buckets()[b];
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  std::size_t bytes = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) bytes += n * int8_packet_bytes(layout_.units()[u].shard);
  Held out(grad_pool_, bytes, 8), in(grad_pool_, bytes, 9);
  const auto* grad = reinterpret_cast<const float*>(g);
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  std::size_t at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = int8_packet_bytes(unit.shard), local = unit.padded_offset - bucket.padded_offset;
    for (std::size_t d = 0; d < n; ++d)
      int8_pack(grad + local + d * unit.shard, residual + unit.padded_offset + d * unit.shard, unit.shard,
                out.bytes() + at + d * packet);
    f.requests.push_back(comm_.iall_to_all(out.bytes() + at, in.bytes() + at, packet, ElemType::u8));
    at += n * packet;
  }
  f.scratch = std::move(out);  // zero2/3: their fp32 scratch goes back to the pool
  f.received = std::move(in);
  f.then = [this, b, received = f.received.bytes()] { land_int8(b, received); };
}

void Engine::land_int8(std::size_t b, const char* received) {
  const auto& bucket = layout_.buckets()[b];
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  auto* grads = reinterpret_cast<float*>(grads_.bytes());
  std::size_t at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = int8_packet_bytes(unit.shard);
    float* sum = grads + own_grad_offset(unit);
    for (std::size_t s = 0; s < n; ++s) int8_unpack(received + at + s * packet, unit.shard, sum, s > 0);
    at += n * packet;
  }
  if (!info_.replicated_params) return;
  // ddp: the owners' sums back to every rank, as int8 with their own feedback.
  Held out(grad_pool_, at / n, 8), in(grad_pool_, at, 9);
  auto* residual = reinterpret_cast<float*>(sum_residual_.bytes());
  std::vector<std::unique_ptr<Request>> gathers;
  at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = int8_packet_bytes(unit.shard);
    int8_pack(grads + unit.padded_offset + rank_ * unit.shard, residual + unit.shard_offset, unit.shard,
              out.bytes() + at / n);
    gathers.push_back(comm_.iall_gather(out.bytes() + at / n, in.bytes() + at, packet, ElemType::u8));
    at += n * packet;
  }
  try {
    at = 0;
    for (std::size_t u = bucket.first; u < bucket.last; ++u) {
      finish(gathers[u - bucket.first]);
      const auto& unit = layout_.units()[u];
      const std::size_t packet = int8_packet_bytes(unit.shard);
      for (std::size_t s = 0; s < n; ++s)
        int8_unpack(in.bytes() + at + s * packet, unit.shard, grads + unit.padded_offset + s * unit.shard, false);
      at += n * packet;
    }
  } catch (...) {
    for (auto& r : gathers) finish_quietly(r);  // before their buffers go
    throw;
  }
}

void Engine::reduce_powersgd(InFlight& f, std::size_t b, const char* g) {
  const PowerSgd::Bucket& plan = powersgd_->bucket(b);
  const std::size_t first = layout_.buckets()[b].padded_offset;
  const auto* grad = reinterpret_cast<const float*>(g);
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  float* q = powersgd_->qs().data();
  const std::size_t count = plan.whole_elements + plan.p_elements;
  Held sent(grad_pool_, std::max<std::size_t>(count, 1) * sizeof(float), 8);
  auto* reduced = reinterpret_cast<float*>(sent.bytes());
  float *whole = reduced, *p = reduced + plan.whole_elements;
  for (const PowerSgd::Matrix& m : plan.matrices) {
    const std::size_t at = layout_.padded_offset(m.param), n = m.rows * m.cols;
    const float* from = grad + (at - first);
    if (m.rank == 0) {
      whole = std::copy_n(from, n, whole);
      continue;
    }
    float* mat = residual + at;  // M = g + e, kept where e was until the residual is known
    for (std::size_t i = 0; i < n; ++i) mat[i] = from[i] + mat[i];
    orthogonalize(q + m.q_at, m.cols, m.rank);
    times(mat, q + m.q_at, p, m.rows, m.cols, m.rank);
    p += m.rows * m.rank;
  }
  f.requests.push_back(comm_.iall_reduce(reduced, reduced, count, ElemType::f32, ReduceOp::sum));
  f.scratch = std::move(sent);  // zero2/3: their fp32 scratch goes back to the pool
  f.then = [this, b, reduced] { land_powersgd(b, reduced); };
}

void Engine::land_powersgd(std::size_t b, float* reduced) {
  const PowerSgd::Bucket& plan = powersgd_->bucket(b);
  const auto& bucket = layout_.buckets()[b];
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  float* q = powersgd_->qs().data();
  Held factors(grad_pool_, std::max<std::size_t>(plan.q_elements, 1) * sizeof(float), 9);
  auto* qs = reinterpret_cast<float*>(factors.bytes());
  float *p = reduced + plan.whole_elements, *qk = qs;
  for (const PowerSgd::Matrix& m : plan.matrices) {
    if (m.rank == 0) continue;
    orthogonalize(p, m.rows, m.rank);  // the ranks' sum: the same on every rank
    transposed_times(residual + layout_.padded_offset(m.param), p, qk, m.rows, m.cols, m.rank);
    p += m.rows * m.rank;
    qk += m.cols * m.rank;
  }
  comm_.all_reduce(qs, qs, plan.q_elements, ElemType::f32, ReduceOp::sum);
  Held out(grad_pool_, bucket.padded * sizeof(float), 10);
  auto* sum = reinterpret_cast<float*>(out.bytes());
  std::fill_n(sum, bucket.padded, 0.0f);
  const auto n = static_cast<float>(comm_.size());
  const float* whole = reduced;
  p = reduced + plan.whole_elements;
  qk = qs;
  for (const PowerSgd::Matrix& m : plan.matrices) {
    const std::size_t at = layout_.padded_offset(m.param), count = m.rows * m.cols;
    float* to = sum + (at - bucket.padded_offset);
    if (m.rank == 0) {
      std::copy_n(whole, count, to);
      whole += count;
      continue;
    }
    outer(p, qk, to, m.rows, m.cols, m.rank);
    // What this rank still owes, and the next step's warm start. A
    // non-finite gradient (the step will not be taken) must not stay in
    // either: its residual is dropped, and Q -- the ranks' sum, so every
    // rank decides alike -- keeps its last finite value.
    float* mat = residual + at;
    bool finite = true;
    for (std::size_t i = 0; i < count; ++i) {
      mat[i] = mat[i] - to[i] / n;
      finite = finite && std::fabs(mat[i]) <= std::numeric_limits<float>::max();
    }
    if (!finite) std::fill_n(mat, count, 0.0f);
    const std::size_t qn = m.cols * m.rank;
    if (std::all_of(qk, qk + qn, [](float x) { return std::isfinite(x); })) std::copy_n(qk, qn, q + m.q_at);
    p += m.rows * m.rank;
    qk += m.cols * m.rank;
  }
  deliver(b, sum);
}

void Engine::zero_gaps(std::size_t u, std::size_t lo, std::size_t hi, float* at) const {
  for (const auto& [begin, end] : gaps_[u]) {
    const std::size_t from = std::max(begin, lo), to = std::min(end, hi);
    if (from < to) std::fill(at + (from - lo), at + (to - lo), 0.0f);
  }
}

namespace {
// Zeroes what 1-bit Adam holds (denominator inf) among n values.
void zero_held(float* at, const float* denominator, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (std::isinf(denominator[i])) at[i] = 0.0f;
}
}  // namespace

void Engine::gather_moment() {
  auto* m = reinterpret_cast<float*>(moment_.bytes());
  auto* d = reinterpret_cast<float*>(denominator_.bytes());
  std::fill_n(m, layout_.padded_elements(), 0.0f);
  std::fill_n(d, layout_.padded_elements(), 1.0f);
  const std::vector<ShardLayout::Piece> pieces = layout_.pieces(comm_.rank());
  RuleBlob parsed;
  for (std::size_t i = 0; i < optimizer_->num_params(); ++i) {
    if (!optimizer_->has_state(i)) continue;
    const std::size_t g = param_group_[i];
    const MomentForm& form = *optimizer_->rule_of_group(g).moment;
    optimizer_->rule_of_group(g).parse(optimizer_->group(g).options, parsed);
    const std::size_t at = info_.replicated_params ? layout_.padded_offset(i) : pieces[i].padded_offset;
    const std::span<const float> moment = optimizer_->state_tensor(i, form.state);
    const std::span<const float> variance = optimizer_->state_tensor(i, form.variance(parsed));
    std::copy(moment.begin(), moment.end(), m + at);
    form.denominator(parsed, variance.data(), onebit_warmup_, d + at, variance.size());
    // Elements whose gradient was 0 all through the warm-up are held
    // (DeepSpeed's momentum mask, found from v): inf, so their share is 0.
    for (std::size_t k = 0; k < variance.size(); ++k)
      if (variance[k] == 0.0f) d[at + k] = std::numeric_limits<float>::infinity();
  }
  if (!info_.replicated_params)
    for (const auto& unit : layout_.units()) {
      float* at = m + unit.padded_offset;
      comm_.all_gather(at + rank_ * unit.shard, at, unit.shard, ElemType::f32);
      at = d + unit.padded_offset;
      comm_.all_gather(at + rank_ * unit.shard, at, unit.shard, ElemType::f32);
    }
  moment_known_ = true;
  moment_loads_ = optimizer_->state_loads();
}

void Engine::reduce_onebit(InFlight& f, std::size_t b, const char* g) {
  blocked([&] {
    finish_param_reads();  // L2 decay reads the parameters
    if (!moment_known_ || moment_loads_ != optimizer_->state_loads()) gather_moment();
  });
  const auto& bucket = layout_.buckets()[b];
  const auto& params = layout_.params();
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  const auto world = static_cast<float>(n);
  // Each rank's share of the averaged moment: the rule's moment advanced
  // with the rank's own gradient (n times its part of the mean), over n.
  Held shares(grad_pool_, bucket.padded * sizeof(float), 12);
  auto* x = reinterpret_cast<float*>(shares.bytes());
  std::fill_n(x, bucket.padded, 0.0f);
  const auto* grad = reinterpret_cast<const float*>(g);
  const auto* values = reinterpret_cast<const float*>(params_.bytes());
  const auto* moment = reinterpret_cast<const float*>(moment_.bytes());
  RuleBlob parsed;
  for (std::size_t p = 0; p < params.size(); ++p) {
    const std::size_t u = layout_.unit_of(p);
    if (u < bucket.first || u >= bucket.last) continue;
    const std::size_t at = layout_.padded_offset(p), count = params[p].numel();
    float* share = x + (at - bucket.padded_offset);
    const float* mine = grad + (at - bucket.padded_offset);
    for (std::size_t i = 0; i < count; ++i) share[i] = mine[i] * world;
    const std::size_t group = param_group_[p];
    const RuleInfo& rule = optimizer_->rule_of_group(group);
    rule.parse(optimizer_->group(group).options, parsed);
    rule.moment->local(parsed, moment + at, share, values + at, share, count);
    const float* d = reinterpret_cast<const float*>(denominator_.bytes()) + at;
    for (std::size_t i = 0; i < count; ++i) share[i] = share[i] / d[i] / world;
  }
  std::size_t bytes = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) bytes += n * onebit_packet_bytes(layout_.units()[u].shard);
  Held out(grad_pool_, bytes, 8), in(grad_pool_, bytes, 9);
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  const auto* denominator = reinterpret_cast<const float*>(denominator_.bytes());
  std::size_t at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = onebit_packet_bytes(unit.shard), local = unit.padded_offset - bucket.padded_offset;
    for (std::size_t d = 0; d < n; ++d)
      onebit_pack(x + local + d * unit.shard, residual + unit.padded_offset + d * unit.shard, unit.shard,
                  out.bytes() + at + d * packet);
    zero_gaps(u, 0, unit.padded, residual + unit.padded_offset);  // no parameter there owes anything
    zero_held(residual + unit.padded_offset, denominator + unit.padded_offset, unit.padded);
    f.requests.push_back(comm_.iall_to_all(out.bytes() + at, in.bytes() + at, packet, ElemType::u8));
    at += n * packet;
  }
  f.scratch = std::move(out);  // zero2: its fp32 scratch goes back to the pool
  f.received = std::move(in);
  f.then = [this, b, received = f.received.bytes()] { land_onebit(b, received); };
}

void Engine::land_onebit(std::size_t b, const char* received) {
  const auto& bucket = layout_.buckets()[b];
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  std::size_t bytes = 0, elements = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    bytes += onebit_packet_bytes(layout_.units()[u].shard);
    elements += layout_.units()[u].shard;
  }
  Held sums(grad_pool_, elements * sizeof(float), 12), out(grad_pool_, bytes, 8), in(grad_pool_, n * bytes, 9);
  auto* server = reinterpret_cast<float*>(sum_residual_.bytes());
  const auto* denominator = reinterpret_cast<const float*>(denominator_.bytes());
  std::vector<std::unique_ptr<Request>> gathers;
  // The owners: the shares summed in rank order, packed again with their
  // own residual, and gathered by every rank.
  std::size_t at = 0, o = 0;
  auto* acc = reinterpret_cast<float*>(sums.bytes());
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = onebit_packet_bytes(unit.shard), lo = rank_ * unit.shard, hi = lo + unit.shard;
    for (std::size_t s = 0; s < n; ++s) onebit_unpack(received + at + s * packet, unit.shard, acc, s > 0);
    const float* held = denominator + unit.padded_offset + lo;
    zero_gaps(u, lo, hi, acc);
    zero_held(acc, held, unit.shard);
    onebit_pack(acc, server + unit.shard_offset, unit.shard, out.bytes() + o);
    zero_gaps(u, lo, hi, server + unit.shard_offset);
    zero_held(server + unit.shard_offset, held, unit.shard);
    gathers.push_back(comm_.iall_gather(out.bytes() + o, in.bytes() + at, packet, ElemType::u8));
    acc += unit.shard;
    at += n * packet;
    o += packet;
  }
  auto* moment = reinterpret_cast<float*>(moment_.bytes());
  try {
    at = 0;
    for (std::size_t u = bucket.first; u < bucket.last; ++u) {
      finish(gathers[u - bucket.first]);
      const auto& unit = layout_.units()[u];
      const std::size_t packet = onebit_packet_bytes(unit.shard);
      float* m = moment + unit.padded_offset;
      for (std::size_t s = 0; s < n; ++s)
        onebit_unpack(in.bytes() + at + s * packet, unit.shard, m + s * unit.shard, false);
      zero_gaps(u, 0, unit.padded, m);
      const float* d = denominator + unit.padded_offset;
      for (std::size_t i = 0; i < unit.padded; ++i) m[i] = std::isinf(d[i]) ? 0.0f : m[i] * d[i];  // the moment again
      at += n * packet;
    }
  } catch (...) {
    for (auto& r : gathers) finish_quietly(r);  // before their buffers go
    throw;
  }
  deliver(b, moment + bucket.padded_offset);
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
