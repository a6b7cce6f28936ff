// zero3 (ZeRO stage 3; FairScale and torch FSDP): parameters sharded too.
// A unit is all-gathered before its forward and again before its backward
// (the next unit prefetched) and freed after use; gradients as zero2
// (engine.hpp; docs/sharding.md). The last unit is kept from forward into
// backward, as FSDP does, which saves its second gather.
#include <cstdint>

#include "engine.hpp"

namespace distopt::parallel::detail {

namespace {

class Zero3 final : public Zero2 {
 public:
  explicit Zero3(const StrategyArgs& a) : Zero2(a, {true, true, true}) {}
  ~Zero3() override {
    for (auto& [u, g] : gathered_) finish_quietly(g.request);
  }

  std::span<const float> own_params() override {
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
    Gathered& g = gathered_[u];
    if (g.buffer.empty()) start_gather(u, g);
    blocked([&] { finish(g.request); });
    const char* values = g.buffer.bytes();
    prefetch(next_unit(u, pass));
    return values;
  }
  void finish_param_reads() override {
    for (auto& [u, g] : gathered_) finish(g.request);
  }
  void after_update() override {
    // Gathered units hold the old values now (a model that did not use the
    // kept last unit in backward leaves it here); none is in flight.
    gathered_.clear();
    // The next forward starts with unit 0: gather it now.
    prefetch(0);
  }

  std::size_t next_unit(std::size_t u, models::Pass pass) const {
    if (pass == models::Pass::backward) return u > 0 ? u - 1 : kNone;
    return u + 1 < layout_.units().size() ? u + 1 : kNone;
  }
  void start_gather(std::size_t u, Gathered& g) {
    const auto& unit = layout_.units()[u];
    g.buffer = Held(param_pool_, unit.padded * es_, 2 + static_cast<int>(u % 2));
    g.request = comm_.iall_gather(params_.bytes() + unit.shard_offset * es_, g.buffer.bytes(), unit.shard, type_);
  }
  void prefetch(std::size_t u) {
    if (u == kNone) return;
    Gathered& g = gathered_[u];
    if (g.buffer.empty()) start_gather(u, g);
  }

  std::map<std::size_t, Gathered> gathered_;  // units gathered or being gathered
};

}  // namespace

constexpr const char* kHelp =
    "as zero2, and parameters sharded: each unit all-gathered before use (the next prefetched) and freed after";
extern const StrategyInfo kZero3{.name = "zero3", .help = kHelp, .replicated_params = false,
                                 .whole_tensor_needs_gather = true, .sharded_grads = true, .make = make_engine<Zero3>, .volume_psi = 3};

}  // namespace distopt::parallel::detail
