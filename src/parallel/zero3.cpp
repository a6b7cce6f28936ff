// zero3 (ZeRO stage 3; FairScale and torch FSDP): parameters sharded too.
// A unit is all-gathered before its forward and again before its backward
// (the next StrategyOptions::prefetch_units units prefetched, while they fit
// under max_live_params) and freed after use; gradients as zero2
// (engine.hpp; docs/sharding.md). The last unit is kept from forward into
// backward, as FSDP does, which saves its second gather.
#include <algorithm>
#include <cstdint>

#include "distopt/core/error.hpp"

#include "engine.hpp"

namespace distopt::parallel::detail {

namespace {

class Zero3 final : public Zero2 {
 public:
  explicit Zero3(const StrategyArgs& a)
      : Zero2(a, {true, true, true}),
        prefetch_(static_cast<std::size_t>(a.options.prefetch_units)),
        max_live_bytes_(a.options.max_live_params * es_) {
    if (a.options.max_live_params == 0) return;
    const auto& units = layout_.units();
    const auto largest = std::max_element(units.begin(), units.end(),
                                          [](const auto& x, const auto& y) { return x.padded < y.padded; });
    if (a.options.max_live_params < largest->padded)
      throw InvalidInput(str("max live parameters ", a.options.max_live_params, " is below the largest unit, ",
                             largest->name, " (", largest->padded, " elements gathered at once at world ",
                             comm_.size(), "): at least ", largest->padded, " would fit"));
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

  void release(std::size_t u, models::Pass pass) override {
    Engine::release(u, pass);
    const bool last = u + 1 == layout_.units().size();
    if (!(pass == models::Pass::forward && last)) gathered_.erase(u);
  }

 private:
  struct Gathered {
    Held buffer;
    std::unique_ptr<Request> request;
  };
  static constexpr std::size_t kNone = SIZE_MAX;

  const char* values_of(std::size_t u, models::Pass pass) override {
    if (!gathered_.contains(u)) start_gather(u);
    Gathered& g = gathered_.at(u);
    blocked([&] { finish(g.request); });
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
    g.request = comm_.iall_gather(params_.bytes() + unit.shard_offset * es_, g.buffer.bytes(), unit.shard, type_);
    gathered_.emplace(u, std::move(g));
  }
  // Starts gathering unit u unless it is gathered already; false when that
  // would pass the limit on live parameters. The limit bounds prefetches:
  // a model that uses one unit at a time, in the pass's order (mlp, gpt),
  // never has more live than it.
  bool prefetch(std::size_t u) {
    if (gathered_.contains(u)) return true;
    if (max_live_bytes_ > 0) {
      std::size_t live = param_pool_.fit(layout_.units()[u].padded * es_);
      for (const auto& [v, g] : gathered_) live += g.buffer.size_bytes();
      if (live > max_live_bytes_) return false;
    }
    start_gather(u);
    return true;
  }

  std::size_t prefetch_;        // units gathered ahead of the one in use
  std::size_t max_live_bytes_;  // 0: no limit
  std::map<std::size_t, Gathered> gathered_;  // units gathered or being gathered
};

}  // namespace

constexpr const char* kHelp =
    "as zero2, and parameters sharded: each unit all-gathered before use (the next --prefetch-units prefetched) and "
    "freed after";
extern const StrategyInfo kZero3{.name = "zero3", .help = kHelp, .replicated_params = false,
                                 .whole_tensor_needs_gather = true, .sharded_grads = true, .sharded_params = true,
                                 .make = make_engine<Zero3>, .volume_psi = 3};

}  // namespace distopt::parallel::detail
