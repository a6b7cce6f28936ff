// ddp, zero1, zero2 and zero3 (include/distopt/parallel/strategy.hpp;
// docs/algorithms.md, "Training step"). One engine, four stages; what each
// stage holds and communicates:
//
//   stage  params            grads                       reduction              after the update
//   ddp    padded, all       padded, all                 all_reduce per bucket  --
//   zero1  padded, all       padded, all                 reduce_scatter per     all_gather per unit
//                                                        bucket during backward
//   zero2  padded, all       own shard + buckets in      reduce_scatter per     all_gather per unit
//                            flight                      bucket during backward
//   zero3  own shard + units own shard + buckets in      as zero2               -- (units are gathered
//          in flight         flight                                            when the model needs them)
//
// The optimizer sees whole tensors (ddp) or the rank's pieces of them
// (zero1-3, one piece per parameter, possibly empty, so every rank's
// optimizer has the same parameter list and state_dict structure). A
// pointwise rule gives bitwise the same values on a piece as on the whole
// tensor, and every gradient element is the same rank-ordered sum whichever
// collective made it, hence the equivalence.
//
// Mixed precision: parameters and gradients are held and communicated in
// the param dtype; the model computes in fp32 on converted copies of the
// units it holds, and the optimizer keeps fp32 master weights for the
// pieces it steps.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>

#include "distopt/core/buffer.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/rule.hpp"
#include "distopt/parallel/strategy.hpp"
#include "internal.hpp"

namespace distopt::parallel {

namespace {

constexpr std::string_view kStrategies[] = {"ddp", "zero1", "zero2", "zero3", "sgp",
                                            "osgp", "dpsgd", "adpsgd", "slowmo"};
constexpr std::string_view kAvailable[] = {"ddp", "zero1", "zero2", "zero3", "sgp", "osgp", "dpsgd", "adpsgd", "slowmo"};

enum class Stage { ddp, zero1, zero2, zero3 };

// Byte counts per category: current and peak.
class Meter {
 public:
  enum Kind { params, grads, kinds };
  void add(Kind k, std::size_t bytes) {
    now_[k] += bytes;
    peak_[k] = std::max(peak_[k], now_[k]);
  }
  void sub(Kind k, std::size_t bytes) { now_[k] -= bytes; }
  std::size_t peak(Kind k) const { return peak_[k]; }

 private:
  std::size_t now_[kinds] = {}, peak_[kinds] = {};
};

// Transient buffers (gathered units, gradient buckets, fp32 copies) come
// from a pool and go back to it, so a step does not map, fault in and zero
// fresh memory for every unit (a fresh 11 MB buffer costs milliseconds).
// The meter counts what the pool has allocated, idle buffers included. A
// request takes the smallest idle buffer that fits; when none fits, the
// idle ones are all smaller than what the model needs now and are freed
// before a new one is allocated, so the pool holds no more than the most
// buffers in use at once, each as large as the largest request.
class Pool {
 public:
  Pool(Meter& meter, Meter::Kind kind) : meter_(meter), kind_(kind) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    for (const Buffer& b : idle_) meter_.sub(kind_, b.size_bytes());
  }
  Buffer take(std::size_t bytes, int slot) {
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it)
      if (it->size_bytes() >= bytes && (best == idle_.end() || it->size_bytes() < best->size_bytes())) best = it;
    if (best != idle_.end()) {
      Buffer b = std::move(*best);
      idle_.erase(best);
      return b;
    }
    for (const Buffer& b : idle_) meter_.sub(kind_, b.size_bytes());
    idle_.clear();
    meter_.add(kind_, bytes);
    return Buffer(bytes, slot);
  }
  void give(Buffer&& b) {
    if (!b.empty()) idle_.push_back(std::move(b));
  }

 private:
  Meter& meter_;
  Meter::Kind kind_;
  std::vector<Buffer> idle_;
};

// A buffer the meter counts while it exists (persistent), or one leased
// from a pool and given back when the lease ends.
class Held {
 public:
  Held() = default;
  Held(Meter& m, Meter::Kind k, std::size_t bytes, int slot) : meter_(&m), kind_(k), buf_(bytes, slot) {
    meter_->add(kind_, bytes);
  }
  Held(Pool& pool, std::size_t bytes, int slot) : pool_(&pool), buf_(pool.take(bytes, slot)) {}
  Held(Held&& o) noexcept : meter_(o.meter_), pool_(o.pool_), kind_(o.kind_), buf_(std::move(o.buf_)) {
    o.meter_ = nullptr;
    o.pool_ = nullptr;
  }
  Held& operator=(Held&& o) noexcept {
    release();
    meter_ = o.meter_;
    pool_ = o.pool_;
    kind_ = o.kind_;
    buf_ = std::move(o.buf_);
    o.meter_ = nullptr;
    o.pool_ = nullptr;
    return *this;
  }
  ~Held() { release(); }
  char* bytes() { return buf_.as<char>(); }
  const char* bytes() const { return buf_.as<char>(); }
  bool empty() const { return buf_.empty(); }

 private:
  void release() {
    if (meter_ != nullptr) meter_->sub(kind_, buf_.size_bytes());
    if (pool_ != nullptr) pool_->give(std::move(buf_));
    meter_ = nullptr;
    pool_ = nullptr;
    buf_ = Buffer();
  }
  Meter* meter_ = nullptr;
  Pool* pool_ = nullptr;
  Meter::Kind kind_ = Meter::params;
  Buffer buf_;
};

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

std::uint64_t fnv(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::uint64_t fnv(std::uint64_t h, std::string_view s) { return fnv(fnv(h, s.data(), s.size()), "\0", 1); }
template <class T>
std::uint64_t fnv_value(std::uint64_t h, T v) {
  return fnv(h, &v, sizeof v);
}
constexpr std::uint64_t kFnvBasis = 14695981039346656037ull;

class Engine final : public Strategy, public models::UnitAccess {
 public:
  Engine(Stage stage, std::string_view name, Communicator& comm, const FlatLayout& flat,
         std::span<const float> initial, const OptimizerSpec& spec, const StrategyOptions& options)
      : stage_(stage),
        name_(name),
        comm_(comm),
        layout_(flat.params, flat.elements, flat.units, comm.size(), options.bucket_elements),
        dtype_(options.param_dtype),
        type_(elem_type_of(options.param_dtype)),
        es_(size_of(options.param_dtype)),
        rank_(static_cast<std::size_t>(comm.rank())) {
    DISTOPT_CHECK(initial.size() == flat.elements, initial.size(), " vs ", flat.elements);
    detail::check_agreement(comm, name, layout_, spec, options);
    const std::vector<ShardLayout::Piece> pieces = layout_.pieces(comm.rank());
    const std::size_t padded = layout_.padded_elements(), shard = layout_.shard_elements();
    if (stage_ == Stage::zero3) {
      params_ = Held(meter_, Meter::params, shard * es_, 0);
      for (const auto& u : layout_.units())
        for (std::size_t k = 0; k < u.shard; ++k) {
          const std::size_t local = rank_ * u.shard + k;  // unit-local element
          const float v = local < u.size() ? initial[u.begin + local] : 0.0f;
          from_f32(dtype_, &v, params_.bytes() + (u.shard_offset + k) * es_, 1);
        }
    } else {
      params_ = Held(meter_, Meter::params, padded * es_, 0);
      for (const auto& u : layout_.units())
        from_f32(dtype_, initial.data() + u.begin, params_.bytes() + u.padded_offset * es_, u.size());
    }
    if (stage_ == Stage::ddp || stage_ == Stage::zero1)
      grads_ = Held(meter_, Meter::grads, padded * es_, 1);
    else
      grads_ = Held(meter_, Meter::grads, shard * es_, 1);
    std::vector<Param> views;
    for (const ParamSlot& s : layout_.params()) {
      const auto& piece = pieces[views.size()];
      if (stage_ == Stage::ddp) {
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
      const std::size_t p_at = stage_ == Stage::zero3 ? piece.shard_offset : piece.padded_offset;
      const std::size_t g_at = stage_ == Stage::zero1 ? piece.padded_offset : piece.shard_offset;
      views.push_back({s.name, {params_.bytes() + p_at * es_, dtype_, shape}, {grads_.bytes() + g_at * es_, dtype_, shape}, true});
      views.back().tensor_shape = s.shape;  // rows and columns for the rules that need them
      views.back().tensor_offset = piece.param_begin;
      owned_.push_back(views.back().grad);
    }
    optimizer_ = std::make_unique<Optimizer>(spec.name, detail::optimizer_groups(spec, std::move(views)), spec.options);
    // tensor_stats rules: each rank's partial statistics of its pieces,
    // summed over the ranks in rank order -- the same numbers in the same
    // order under every strategy (docs/sharding.md, "Non-pointwise rules").
    if (comm.size() > 1)
      optimizer_->set_stats_reduce([this](std::span<double> v) {
        blocked([&] { comm_.all_reduce(v.data(), v.data(), v.size(), ElemType::f64, ReduceOp::sum); });
      });
    // whole_tensor rules: each tensor's pieces, all-gathered in rank order
    // (a rank's piece of a tensor precedes the next rank's).
    if (stage_ != Stage::ddp) {
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
    param_requests_.resize(layout_.units().size());
  }

  ~Engine() override { drain(); }

  std::string_view name() const override { return name_; }
  const ShardLayout& layout() const override { return layout_; }
  models::UnitAccess& access() override { return *this; }
  Optimizer& optimizer() override { return *optimizer_; }
  std::uint64_t bytes_sent() const override { return comm_.bytes_sent(); }
  double exposed_seconds() const override { return exposed_s_; }

  MemoryUse memory() const override {
    MemoryUse m;
    m.params = meter_.peak(Meter::params);
    m.grads = meter_.peak(Meter::grads);
    m.master_params = optimizer_->master_bytes();
    m.optimizer_state = optimizer_->state_bytes() - m.master_params;
    return m;
  }

  // ---- UnitAccess: what the model calls while it runs ----

  std::span<const float> acquire(std::size_t u, models::Pass pass) override {
    const auto& unit = layout_.units().at(u);
    const char* values = nullptr;
    if (stage_ == Stage::zero3) {
      Gathered& g = gathered_[u];
      if (g.buffer.empty()) start_gather(u, g);
      blocked([&] { finish(g.request); });
      values = g.buffer.bytes();
      prefetch(next_unit(u, pass));
    } else {
      blocked([&] { finish(param_requests_[u]); });
      values = params_.bytes() + unit.padded_offset * es_;
    }
    if (dtype_ == DType::f32) return {reinterpret_cast<const float*>(values), unit.size()};
    compute_.erase(u);  // a unit acquired again without a release: one copy, counted once
    Held& c = compute_[u];
    c = Held(param_pool_, unit.size() * sizeof(float), 4);
    to_f32(dtype_, values, reinterpret_cast<float*>(c.bytes()), unit.size());
    return {reinterpret_cast<const float*>(c.bytes()), unit.size()};
  }

  void release(std::size_t u, models::Pass pass) override {
    compute_.erase(u);
    // zero3 frees the unit -- except the last one after forward: backward
    // starts with it (FSDP keeps it too), which saves its second gather.
    const bool last = u + 1 == layout_.units().size();
    if (stage_ == Stage::zero3 && !(pass == models::Pass::forward && last)) gathered_.erase(u);
  }

  std::span<float> grads(std::size_t u) override {
    const auto& unit = layout_.units().at(u);
    grad_target_ = grad_target(u);
    if (dtype_ == DType::f32) return {reinterpret_cast<float*>(grad_target_), unit.size()};
    grad_compute_ = Held(grad_pool_, unit.size() * sizeof(float), 5);
    return {reinterpret_cast<float*>(grad_compute_.bytes()), unit.size()};
  }

  void grads_done(std::size_t u) override {
    const auto& unit = layout_.units().at(u);
    if (dtype_ != DType::f32) {
      from_f32(dtype_, reinterpret_cast<const float*>(grad_compute_.bytes()), grad_target_, unit.size());
      grad_compute_ = Held();
    }
    const long b = layout_.bucket_ending_at(u);
    if (b >= 0) reduce_bucket(static_cast<std::size_t>(b));
  }

  // ---- the step ----

  void step(const UpdateFn& update) override {
    // A gather still reading the parameters must finish before the update
    // writes them (a unit the model did not use since the last step).
    blocked([&] {
      for (auto& r : param_requests_) finish(r);
      for (auto& [u, g] : gathered_) finish(g.request);
    });
    blocked([&] { wait_reductions(); });
    for (std::size_t i = 0; i < optimizer_->num_params(); ++i) optimizer_->param(i).has_grad = true;
    const GradShard shard{owned_, [this](double& v, bool max) {
                            blocked([&] {
                              comm_.all_reduce(&v, &v, 1, ElemType::f64, max ? ReduceOp::max : ReduceOp::sum);
                            });
                          }};
    if (update)
      update(*optimizer_, shard);
    else
      optimizer_->step();
    if (stage_ == Stage::zero3) {
      // Gathered units hold the old values now (a model that did not use
      // the kept last unit in backward leaves it here); none is in flight.
      gathered_.clear();
      // The next forward starts with unit 0: gather it now.
      prefetch(0);
    }
    if (stage_ == Stage::zero1 || stage_ == Stage::zero2) {
      // Gather the updated shards in place; the next forward waits for each
      // unit just before it needs it.
      for (std::size_t u = 0; u < layout_.units().size(); ++u) {
        const auto& unit = layout_.units()[u];
        char* p = params_.bytes() + unit.padded_offset * es_;
        param_requests_[u] = comm_.iall_gather(p + rank_ * unit.shard * es_, p, unit.shard, type_);
      }
    }
  }

  // ---- parameters as values ----

  std::span<const float> own_params() override {
    // zero1/2: the rank's own regions are final after the update; the
    // gathers still running write only the other ranks' regions.
    const bool replicated = stage_ == Stage::ddp;
    if (replicated && dtype_ == DType::f32) return {reinterpret_cast<const float*>(params_.bytes()), layout_.padded_elements()};
    own_.assign(replicated ? layout_.padded_elements() : layout_.shard_elements(), 0.0f);
    if (replicated || stage_ == Stage::zero3) {
      to_f32(dtype_, params_.bytes(), own_.data(), own_.size());
    } else {
      for (const auto& unit : layout_.units())
        to_f32(dtype_, params_.bytes() + (unit.padded_offset + rank_ * unit.shard) * es_, own_.data() + unit.shard_offset,
               unit.shard);
    }
    return own_;
  }

  std::vector<float> gather(std::span<const float> own) override {
    if (stage_ == Stage::ddp) return unpadded(layout_, own);
    DISTOPT_CHECK(own.size() == layout_.shard_elements(), own.size(), " vs ", layout_.shard_elements());
    std::vector<float> padded(layout_.padded_elements());
    for (const auto& unit : layout_.units())
      comm_.all_gather(own.data() + unit.shard_offset, padded.data() + unit.padded_offset, unit.shard, ElemType::f32);
    return unpadded(layout_, padded);
  }

  std::unique_ptr<models::UnitAccess> access_to(std::span<const float> own) override {
    return std::make_unique<detail::ValuesAccess>(comm_, layout_, own, stage_ == Stage::ddp);
  }

 private:
  struct Gathered {
    Held buffer;
    std::unique_ptr<Request> request;
  };
  struct InFlight {
    std::size_t bucket;
    Held scratch;  // zero2/3: the bucket's full gradient until its reduction is done
    std::vector<std::unique_ptr<Request>> requests;
  };

  // Runs fn, counting its time as communication the rank waited for.
  template <class F>
  void blocked(F&& fn) {
    detail::add_seconds(exposed_s_, std::forward<F>(fn));
  }

  // Waits for every collective still using our buffers, ignoring their
  // errors: after a failure the buffers must not be freed under a
  // collective that still writes into them.
  void drain() noexcept {
    auto wait = [](std::unique_ptr<Request>& r) {
      try {
        finish(r);
      } catch (...) {
        r.reset();
      }
    };
    for (InFlight& f : in_flight_)
      for (auto& r : f.requests) wait(r);
    for (auto& r : param_requests_) wait(r);
    for (auto& [u, g] : gathered_) wait(g.request);
  }

  static std::size_t next_unit_none() { return SIZE_MAX; }
  std::size_t next_unit(std::size_t u, models::Pass pass) const {
    if (pass == models::Pass::backward) return u > 0 ? u - 1 : next_unit_none();
    return u + 1 < layout_.units().size() ? u + 1 : next_unit_none();
  }

  void start_gather(std::size_t u, Gathered& g) {
    const auto& unit = layout_.units()[u];
    g.buffer = Held(param_pool_, unit.padded * es_, 2 + static_cast<int>(u % 2));
    g.request = comm_.iall_gather(params_.bytes() + unit.shard_offset * es_, g.buffer.bytes(), unit.shard, type_);
  }

  void prefetch(std::size_t u) {
    if (u == next_unit_none()) return;
    Gathered& g = gathered_[u];
    if (g.buffer.empty()) start_gather(u, g);
  }

  // Where backward writes unit u's gradient (param dtype).
  char* grad_target(std::size_t u) {
    const auto& unit = layout_.units()[u];
    if (stage_ == Stage::ddp || stage_ == Stage::zero1) return grads_.bytes() + unit.padded_offset * es_;
    // zero2/3: the scratch of the bucket holding u, opened by its last unit.
    const std::size_t b = layout_.bucket_of(u);
    const auto& bucket = layout_.buckets()[b];
    if (in_flight_.empty() || in_flight_.back().bucket != b || !in_flight_.back().requests.empty()) {
      // At most two buckets in flight: one being written, one being reduced.
      blocked([&] {
        while (in_flight_.size() >= 2) finish_oldest();
      });
      in_flight_.push_back({b, Held(grad_pool_, bucket.padded * es_, 6 + static_cast<int>(b % 2)), {}});
      // A recycled buffer: zero the units' padding, which backward never writes.
      char* scratch = in_flight_.back().scratch.bytes();
      for (std::size_t v = bucket.first; v < bucket.last; ++v) {
        const auto& vu = layout_.units()[v];
        std::memset(scratch + (vu.padded_offset - bucket.padded_offset + vu.size()) * es_, 0,
                    (vu.padded - vu.size()) * es_);
      }
    }
    return in_flight_.back().scratch.bytes() + (unit.padded_offset - bucket.padded_offset) * es_;
  }

  void reduce_bucket(std::size_t b) {
    const auto& bucket = layout_.buckets()[b];
    if (stage_ == Stage::ddp) {
      if (comm_.size() == 1) return;
      char* g = grads_.bytes() + bucket.padded_offset * es_;
      InFlight f{b, {}, {}};
      f.requests.push_back(comm_.iall_reduce(g, g, bucket.padded, type_, ReduceOp::sum));
      in_flight_.push_back(std::move(f));
      return;
    }
    if (stage_ == Stage::zero1) {
      // Megatron's distributed optimizer: reduce-scatter each unit in place,
      // rank r's shard of the sum landing on its own region of the padded
      // gradient buffer, while backward goes on.
      InFlight f{b, {}, {}};
      for (std::size_t u = bucket.first; u < bucket.last; ++u) {
        const auto& unit = layout_.units()[u];
        char* g = grads_.bytes() + unit.padded_offset * es_;
        f.requests.push_back(comm_.ireduce_scatter(g, g + rank_ * unit.shard * es_, unit.shard, type_, ReduceOp::sum));
      }
      in_flight_.push_back(std::move(f));
      return;
    }
    InFlight& f = in_flight_.back();
    DISTOPT_CHECK(f.bucket == b, "bucket ", b, " finished out of order");
    for (std::size_t u = bucket.first; u < bucket.last; ++u) {
      const auto& unit = layout_.units()[u];
      f.requests.push_back(comm_.ireduce_scatter(f.scratch.bytes() + (unit.padded_offset - bucket.padded_offset) * es_,
                                                 grads_.bytes() + unit.shard_offset * es_, unit.shard, type_,
                                                 ReduceOp::sum));
    }
  }

  void finish_oldest() {
    InFlight& f = in_flight_.front();
    DISTOPT_CHECK(!f.requests.empty(), "bucket ", f.bucket, " was never reduced: backward skipped a unit");
    for (auto& r : f.requests) r->wait();
    in_flight_.pop_front();
  }

  void wait_reductions() {
    while (!in_flight_.empty()) finish_oldest();
  }

  // Waits for a request, if any, and forgets it.
  static void finish(std::unique_ptr<Request>& r) {
    if (!r) return;
    r->wait();
    r.reset();
  }

  Stage stage_;
  std::string name_;
  Communicator& comm_;
  ShardLayout layout_;
  DType dtype_;
  ElemType type_;
  std::size_t es_, rank_;
  Meter meter_;
  Pool param_pool_{meter_, Meter::params}, grad_pool_{meter_, Meter::grads};  // outlive every lease below
  Held params_, grads_;
  std::vector<TensorView> owned_;
  std::unique_ptr<Optimizer> optimizer_;
  std::map<std::string, std::vector<std::size_t>> piece_counts_;  // per parameter name: each rank's piece
  std::vector<std::unique_ptr<Request>> param_requests_;  // zero1/2: the gather of each unit after a step
  std::map<std::size_t, Gathered> gathered_;              // zero3: units gathered or being gathered
  std::map<std::size_t, Held> compute_;                   // bf16/f16: fp32 copies of held units
  Held grad_compute_;                                     // bf16/f16: fp32 gradient of the unit in backward
  char* grad_target_ = nullptr;
  std::deque<InFlight> in_flight_;
  std::vector<float> own_;
  double exposed_s_ = 0;
};

Stage stage_of(std::string_view name) {
  if (name == "zero1") return Stage::zero1;
  if (name == "zero2") return Stage::zero2;
  if (name == "zero3") return Stage::zero3;
  return Stage::ddp;
}

}  // namespace

namespace detail {

// Setup check: every rank must agree on what it is about to train. Each
// rank contributes one fingerprint per item; a mismatch names the first
// rank that differs from rank 0 and the item, on every rank alike.
std::vector<ParamGroupSpec> optimizer_groups(const OptimizerSpec& spec, std::vector<Param> views) {
  std::vector<ParamGroupSpec> groups(1);
  const RuleInfo& rule = rule_or_throw(spec.name);
  if (spec.fallback.empty() || rule.check_param == nullptr) {
    groups[0].params = std::move(views);
    return groups;
  }
  ParamGroupSpec other;
  other.rule = spec.fallback;
  const OptionMap options = resolve_options(rule, spec.options);
  for (Param& p : views) {
    bool accepted = true;
    try {
      rule.check_param(options, p.tensor_shape ? *p.tensor_shape : p.value.shape);
    } catch (const InvalidInput&) {
      accepted = false;
    }
    (accepted ? groups[0] : other).params.push_back(std::move(p));
  }
  if (groups[0].params.empty())
    throw InvalidInput(str("optimizer ", spec.name, " takes none of the model's parameters"));
  if (!other.params.empty()) groups.push_back(std::move(other));
  return groups;
}

void check_agreement(Communicator& comm, std::string_view strategy, const ShardLayout& layout,
                     const OptimizerSpec& spec, const StrategyOptions& options) {
  enum { kWorld, kStrategy, kModel, kOptimizer, kDtype, kBucket, kGossip, kItems };
  static constexpr const char* kWhat[kItems] = {"world size",      "strategy",    "model shapes", "optimizer or its options",
                                                 "parameter dtype", "bucket size", "gossip options"};
  std::uint64_t mine[kItems];
  mine[kWorld] = static_cast<std::uint64_t>(comm.size());
  mine[kStrategy] = fnv(kFnvBasis, strategy);
  std::uint64_t h = kFnvBasis;
  for (const ParamSlot& s : layout.params()) {
    h = fnv(h, s.name);
    for (auto d : s.shape) h = fnv_value(h, d);
  }
  for (const auto& u : layout.units()) h = fnv_value(fnv_value(h, u.begin), u.end);
  mine[kModel] = h;
  h = fnv(fnv(kFnvBasis, spec.name), spec.fallback);
  for (const auto& [k, v] : spec.options) h = fnv(fnv(h, k), v.to_string());
  mine[kOptimizer] = h;
  mine[kDtype] = static_cast<std::uint64_t>(options.param_dtype);
  mine[kBucket] = options.bucket_elements;
  const GossipOptions& g = options.gossip;
  h = fnv(fnv(kFnvBasis, g.topology), g.slowmo_base);
  for (double v : {double(g.peers_per_iteration), double(g.synch_freq), double(g.localsgd_frequency),
                   double(g.slowmo_frequency), g.slowmo_momentum, g.slowmo_lr})
    h = fnv_value(h, v);
  mine[kGossip] = h;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> all(n * kItems);
  comm.all_gather(mine, all.data(), kItems, ElemType::i64);
  for (std::size_t r = 1; r < n; ++r)
    for (int k = 0; k < kItems; ++k)
      if (all[r * kItems + k] != all[k]) {
        std::string detail;
        if (k == kWorld || k == kBucket) detail = str(" (", all[r * kItems + k], " vs ", all[k], ")");
        if (k == kDtype)
          detail = str(" (", name_of(static_cast<DType>(all[r * kItems + k])), " vs ", name_of(static_cast<DType>(all[k])), ")");
        throw InvalidInput(str("rank ", r, " disagrees with rank 0 on the ", kWhat[k], detail,
                               ": every rank must be started with the same configuration"));
      }
}

}  // namespace detail

FlatLayout flat_layout(const models::Model& model) {
  FlatLayout out{model.params(), model.buffer_elements(), {}};
  for (const models::Unit& u : model.units()) out.units.push_back({u.name, u.begin, u.end});
  return out;
}

std::vector<float> unpadded(const ShardLayout& layout, std::span<const float> padded) {
  DISTOPT_CHECK(padded.size() >= layout.padded_elements(), padded.size(), " vs ", layout.padded_elements());
  std::vector<float> out;
  out.reserve(layout.param_elements());
  for (std::size_t p = 0; p < layout.params().size(); ++p) {
    const auto begin = padded.begin() + static_cast<std::ptrdiff_t>(layout.padded_offset(p));
    out.insert(out.end(), begin, begin + static_cast<std::ptrdiff_t>(layout.params()[p].numel()));
  }
  return out;
}

std::span<const std::string_view> strategy_names() { return kStrategies; }

bool is_gossip(std::string_view name) {
  return name == "sgp" || name == "osgp" || name == "dpsgd" || name == "adpsgd" || name == "slowmo";
}

double Strategy::consensus_distance() { return std::nan(""); }

void require_strategy(std::string_view name) {
  if (std::find(std::begin(kAvailable), std::end(kAvailable), name) != std::end(kAvailable)) return;
  std::string available;
  for (auto s : kAvailable) available += (available.empty() ? "" : ", ") + std::string(s);
  if (std::find(std::begin(kStrategies), std::end(kStrategies), name) != std::end(kStrategies))
    throw InvalidInput(str("strategy '", name, "' is not available yet in this build (available: ", available, ")"));
  std::string known;
  for (auto s : kStrategies) known += (known.empty() ? "" : ", ") + std::string(s);
  throw InvalidInput(str("unknown strategy '", name, "' (known: ", known, ")"));
}

void require_exact(std::string_view strategy, const RuleInfo& rule) {
  require_strategy(strategy);
  // Gossip strategies run the whole optimizer on the rank's whole model;
  // ddp and zero1-3 reduce the statistics of tensor_stats rules and gather
  // the tensors of whole_tensor rules that say how (RuleInfo::whole).
  if (strategy == "ddp" || is_gossip(strategy) || rule.locality != Locality::whole_tensor || rule.whole != nullptr)
    return;
  throw InvalidInput(str("optimizer ", rule.name, " needs whole tensors (", name_of(rule.locality), "): strategy ",
                         strategy, " cannot run it exactly yet; use --strategy ddp"));
}

std::unique_ptr<Strategy> make_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                        std::span<const float> initial, const OptimizerSpec& optimizer,
                                        const StrategyOptions& options) {
  require_exact(name, rule_or_throw(optimizer.name));
  if (!optimizer.fallback.empty()) require_exact(name, rule_or_throw(optimizer.fallback));
  if (is_gossip(name)) return detail::make_gossip_strategy(name, comm, layout, initial, optimizer, options);
  return std::make_unique<Engine>(stage_of(name), name, comm, layout, initial, optimizer, options);
}

}  // namespace distopt::parallel
