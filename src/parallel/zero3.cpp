// zero3 (ZeRO stage 3; FairScale and torch FSDP): parameters sharded too.
// A unit is all-gathered before its forward and again before its backward
// (the next StrategyOptions::prefetch_units units prefetched, while they fit
// under max_live_params) and freed after use; gradients as zero2
// (engine.hpp; docs/sharding.md). The last unit is kept from forward into
// backward, as FSDP does, which saves its second gather. With
// StrategyOptions::int8_gather the gathers move int8 packets of the fp32
// shards (int8_wire.hpp), unpacked when the model asks for the unit.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "distopt/core/error.hpp"
#include "engine.hpp"
#include "int8_wire.hpp"

namespace distopt::parallel::detail {

namespace {

class Zero3 final : public Zero2 {
 public:
  explicit Zero3(const StrategyArgs& a)
      : Zero2(a, {true, true, true}),
        prefetch_(static_cast<std::size_t>(a.options.prefetch_units)),
        max_live_bytes_(a.options.max_live_params * es_),
        int8_gather_(a.options.int8_gather) {
    const auto& units = layout_.units();
    // A tiled unit's gradient is reduced a range at a time, uncompressed.
    const auto tiled = std::find_if(units.begin(), units.end(), [](const auto& u) { return u.tile > 0; });
    if (compressing() && tiled != units.end())
      throw InvalidInput(str("--grad-compression ", name_of(compression_), " with zero3's tiled unit ", tiled->name,
                             ": a tiled unit's gradient is reduced a range at a time, uncompressed (drop --tile-rows "
                             "or the compression)"));
    if (int8_gather_ && tiled != units.end())
      throw InvalidInput(str("--gather-compression int8 with zero3's tiled unit ", tiled->name,
                             ": a tiled unit is gathered a range at a time, uncompressed (drop --tile-rows or the "
                             "compression)"));
    if (a.options.max_live_params == 0) return;
    // What is gathered at once: a unit, or one range of a tiled unit.
    auto at_once = [](const ShardLayout::Unit& u) { return u.tile > 0 ? u.tile : u.padded; };
    const auto largest = std::max_element(units.begin(), units.end(),
                                          [&](const auto& x, const auto& y) { return at_once(x) < at_once(y); });
    if (a.options.max_live_params < at_once(*largest))
      throw InvalidInput(str("max live parameters ", a.options.max_live_params, " is below ",
                             largest->tile > 0 ? "one tile of " : "the largest unit, ", largest->name, " (",
                             at_once(*largest), " elements gathered at once at world ", comm_.size(), "): at least ",
                             at_once(*largest), " would fit"));
    // The limit counts the buffers that hold gathered units: the pool
    // keeps no idle ones beside them.
    param_pool_.set_lean(true);
  }
  ~Zero3() override {
    for (auto& [u, g] : gathered_) finish_quietly(g.request);
  }

  std::span<const float> own_params() override {
    // The shard buffer itself where it holds fp32 (no copy: a shard's
    // worth of memory a rank would otherwise keep).
    if (dtype_ == DType::f32) return {reinterpret_cast<const float*>(params_.bytes()), layout_.shard_elements()};
    own_.assign(layout_.shard_elements(), 0.0f);
    to_f32(dtype_, params_.bytes(), own_.data(), own_.size());
    return own_;
  }

  // int8 gathers: evaluation gathers the exact fp32 shards (the training
  // passes compute with the unpacked ones).
  models::UnitAccess& eval_access() override {
    if (!int8_gather_) return access();
    exact_ = access_to(own_params());
    return *exact_;
  }

  void release(std::size_t u, models::Pass pass) override {
    Engine::release(u, pass);
    const bool last = u + 1 == layout_.units().size();
    if (!(pass == models::Pass::forward && last)) gathered_.erase(u);
  }

  // A tiled unit: each range gathered from the ranks whose shards hold it
  // (its elements in rank order are the range), used, freed; its gradient
  // reduce-scattered to those ranks at once. Only one range is live.
  std::span<const float> acquire_range(std::size_t u, std::size_t begin, std::size_t end, models::Pass pass) override {
    const auto& unit = layout_.units().at(u);
    if (unit.tile == 0) return Engine::acquire_range(u, begin, end, pass);
    DISTOPT_CHECK(begin < end && end <= unit.size() && end - begin <= unit.tile, unit.name, " range [", begin, ", ",
                  end, ")");
    const std::size_t n = end - begin;
    range_ = Held(param_pool_, n * es_, 2);
    const ShardLayout::Range r = layout_.range(u, comm_.rank(), begin, end);
    blocked([&] { comm_.all_gather_v(params_.bytes() + r.shard_at * es_, range_.bytes(), r.counts, type_); });
    if (dtype_ == DType::f32) return {reinterpret_cast<const float*>(range_.bytes()), n};
    range_compute_ = Held(param_pool_, n * sizeof(float), 4);
    to_f32(dtype_, range_.bytes(), reinterpret_cast<float*>(range_compute_.bytes()), n);
    return {reinterpret_cast<const float*>(range_compute_.bytes()), n};
  }
  void release_range(std::size_t u, std::size_t begin, models::Pass pass) override {
    if (layout_.units().at(u).tile == 0) return Engine::release_range(u, begin, pass);
    range_compute_ = Held();
    range_ = Held();
  }
  std::span<float> grads_range(std::size_t u, std::size_t begin, std::size_t end) override {
    const auto& unit = layout_.units().at(u);
    if (unit.tile == 0) return Engine::grads_range(u, begin, end);
    DISTOPT_CHECK(begin < end && end <= unit.size() && end - begin <= unit.tile, unit.name, " range [", begin, ", ",
                  end, ")");
    // A range's gradient counts as a bucket in flight (--max-buckets-in-flight).
    blocked([&] {
      while (!in_flight_.empty() && in_flight_.size() >= max_buckets_) finish_oldest();
    });
    range_grad_ = Held(grad_pool_, (end - begin) * sizeof(float), 5);
    return {reinterpret_cast<float*>(range_grad_.bytes()), end - begin};
  }
  void grads_range_done(std::size_t u, std::size_t begin, std::size_t end) override {
    const auto& unit = layout_.units().at(u);
    if (unit.tile == 0) return Engine::grads_range_done(u, begin, end);
    if (dtype_ != DType::f32) {  // the gradient reduced in the param dtype, as whole units are
      Held low(grad_pool_, (end - begin) * es_, 6);
      from_f32(dtype_, reinterpret_cast<const float*>(range_grad_.bytes()), low.bytes(), end - begin);
      range_grad_ = std::move(low);
    }
    const ShardLayout::Range r = layout_.range(u, comm_.rank(), begin, end);
    blocked([&] {
      comm_.reduce_scatter_v(range_grad_.bytes(), grads_.bytes() + r.shard_at * es_, r.counts, type_, ReduceOp::sum);
    });
    range_grad_ = Held();
  }
  void grads_done(std::size_t u) override {
    const auto& unit = layout_.units().at(u);
    if (unit.tile == 0) return Engine::grads_done(u);
    // Reduced a range at a time (the unit is a bucket of its own); the
    // padding past the unit's end, which no range covers, is zero.
    const std::size_t lo = rank_ * unit.shard, pad = std::max(lo, unit.size());
    if (pad < lo + unit.shard)
      std::memset(grads_.bytes() + (unit.shard_offset + (pad - lo)) * es_, 0, (lo + unit.shard - pad) * es_);
  }

 private:
  struct Gathered {
    Held buffer;
    std::unique_ptr<Request> request;
    Held packets;  // int8 gathers: the ranks' packets (and the own one to send), unpacked once in
  };
  static constexpr std::size_t kNone = SIZE_MAX;

  const char* values_of(std::size_t u, models::Pass pass) override {
    if (!gathered_.contains(u)) start_gather(u);
    Gathered& g = gathered_.at(u);
    blocked([&] { finish(g.request); });
    if (!g.packets.empty()) {  // every rank's shard from its packet, the own one's too
      const auto& unit = layout_.units()[u];
      const std::size_t packet = int8_packet_bytes(unit.shard);
      for (std::size_t s = 0; s < static_cast<std::size_t>(comm_.size()); ++s)
        int8_unpack(g.packets.bytes() + s * packet, unit.shard,
                    reinterpret_cast<float*>(g.buffer.bytes()) + s * unit.shard, false);
      g.packets = Held();
    }
    // The next units of the pass, while they fit under the limit.
    for (std::size_t k = 0, v = next_unit(u, pass); k < prefetch_ && v != kNone && prefetch(v); ++k)
      v = next_unit(v, pass);
    return g.buffer.bytes();
  }
  void finish_param_reads() override {
    for (auto& [u, g] : gathered_) finish(g.request);
  }
  void after_update() override {
    // Gathered units hold the old values now (a model that did not use the
    // kept last unit in backward leaves it here); none is in flight.
    gathered_.clear();
    // The next forward starts with unit 0: gather it now.
    if (prefetch_ > 0) prefetch(0);
  }

  std::size_t next_unit(std::size_t u, models::Pass pass) const {
    if (pass == models::Pass::backward) return u > 0 ? u - 1 : kNone;
    return u + 1 < layout_.units().size() ? u + 1 : kNone;
  }
  void start_gather(std::size_t u) {
    const auto& unit = layout_.units()[u];
    Gathered g;  // entered once the gather has started (a failure leaves no half-made entry)
    g.buffer = Held(param_pool_, unit.padded * es_, 2 + static_cast<int>(u % 2));
    if (int8_gather_) {
      const std::size_t n = static_cast<std::size_t>(comm_.size()), packet = int8_packet_bytes(unit.shard);
      g.packets = Held(param_pool_, (n + 1) * packet, 12);
      char* own = g.packets.bytes() + n * packet;
      int8_pack(reinterpret_cast<const float*>(params_.bytes()) + unit.shard_offset, nullptr, unit.shard, own);
      g.request = comm_.iall_gather(own, g.packets.bytes(), packet, ElemType::u8);
    } else {
      g.request = comm_.iall_gather(params_.bytes() + unit.shard_offset * es_, g.buffer.bytes(), unit.shard, type_);
    }
    gathered_.emplace(u, std::move(g));
  }
  // Starts gathering unit u unless it is gathered already; false when that
  // would pass the limit on live parameters. The limit bounds prefetches:
  // a model that uses one unit at a time, in the pass's order (mlp, gpt),
  // never has more live than it.
  bool prefetch(std::size_t u) {
    if (gathered_.contains(u)) return true;
    if (layout_.units()[u].tile > 0) return false;  // gathered a range at a time, when used
    if (max_live_bytes_ > 0) {
      const auto& unit = layout_.units()[u];
      std::size_t live = param_pool_.fit(unit.padded * es_) + range_.size_bytes();
      if (int8_gather_)
        live += param_pool_.fit((static_cast<std::size_t>(comm_.size()) + 1) * int8_packet_bytes(unit.shard));
      for (const auto& [v, g] : gathered_) live += g.buffer.size_bytes() + g.packets.size_bytes();
      if (live > max_live_bytes_) return false;
    }
    start_gather(u);
    return true;
  }

  std::size_t prefetch_;        // units gathered ahead of the one in use
  std::size_t max_live_bytes_;  // 0: no limit
  bool int8_gather_;            // StrategyOptions::int8_gather
  std::unique_ptr<models::UnitAccess> exact_;  // int8 gathers: evaluation's access to the fp32 shards
  std::map<std::size_t, Gathered> gathered_;  // units gathered or being gathered
  Held range_, range_compute_, range_grad_;   // a tiled unit's range in use, and its gradient
};

}  // namespace

constexpr const char* kHelp =
    "as zero2, and parameters sharded: each unit all-gathered before use (the next --prefetch-units prefetched) and "
    "freed after";
extern const StrategyInfo kZero3{.name = "zero3", .help = kHelp, .replicated_params = false,
                                 .whole_tensor_needs_gather = true, .sharded_grads = true, .sharded_params = true,
                                 .make = make_engine<Zero3>, .volume_psi = 3,
                                 .memory = {.whole = 0, .divided = 5, .units_in_flight = 4}};

}  // namespace distopt::parallel::detail
