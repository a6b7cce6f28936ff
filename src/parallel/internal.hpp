// Shared by the strategy engines of src/parallel (not installed).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

#include "distopt/core/buffer.hpp"
#include "distopt/core/error.hpp"
#include "distopt/parallel/strategy.hpp"

namespace distopt::parallel::detail {

// Runs fn, adding its wall time to `total` (also when it throws).
template <class F>
void add_seconds(double& total, F&& fn) {
  struct Add {
    double& total;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Add() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
  } add{total};
  std::forward<F>(fn)();
}

// Read-only access to parameters held as fp32 values in some layout:
// the padded buffer itself (replicated) or a shard buffer (gathered per unit).
class ValuesAccess final : public models::UnitAccess {
 public:
  ValuesAccess(Communicator& comm, const ShardLayout& layout, std::span<const float> own, bool replicated)
      : comm_(comm), layout_(layout), own_(own), replicated_(replicated) {}
  std::span<const float> acquire(std::size_t u, models::Pass) override {
    const auto& unit = layout_.units().at(u);
    if (replicated_) return own_.subspan(unit.padded_offset, unit.size());
    Buffer& b = held_[u];
    b = Buffer(unit.padded * sizeof(float), 0);
    comm_.all_gather(own_.data() + unit.shard_offset, b.data(), unit.shard, ElemType::f32);
    return {b.as<float>(), unit.size()};
  }
  void release(std::size_t u, models::Pass) override { held_.erase(u); }
  // A tiled unit's range, gathered from the ranks that hold it.
  std::span<const float> acquire_range(std::size_t u, std::size_t begin, std::size_t end, models::Pass pass) override {
    const auto& unit = layout_.units().at(u);
    if (replicated_ || unit.tile == 0) return UnitAccess::acquire_range(u, begin, end, pass);
    Buffer& b = held_[u];
    b = Buffer((end - begin) * sizeof(float), 0);
    const ShardLayout::Range r = layout_.range(u, comm_.rank(), begin, end);
    comm_.all_gather_v(own_.data() + r.shard_at, b.data(), r.counts, ElemType::f32);
    return {b.as<float>(), end - begin};
  }
  void release_range(std::size_t u, std::size_t, models::Pass) override { held_.erase(u); }
  std::span<float> grads(std::size_t) override {
    throw PreconditionError("backward through an evaluation-only unit access");
  }
  void grads_done(std::size_t) override {}

 private:
  Communicator& comm_;
  const ShardLayout& layout_;
  std::span<const float> own_;
  bool replicated_;
  std::map<std::size_t, Buffer> held_;
};

// The layout's shard alignment for a strategy: where the optimizer keeps
// quantized state (include/distopt/optim/quant.hpp), its largest block, and a
// strategy that shards the state then requires every parameter of
// quant::kMinElements or more to start on a block of its unit (InvalidInput
// naming it otherwise; the models place them so: core/flat.hpp); else
// ShardLayout::kAlign.
std::size_t layout_align(const StrategyArgs& a);

// What every strategy holds and answers alike: its registry entry, its
// communicator, the layout, the optimizer and the time it spent waiting on
// communication. The engine core (engine.hpp) and the gossip core
// (gossip/core.hpp) derive from it.
class StrategyCore : public Strategy, public models::UnitAccess {
 public:
  const StrategyInfo& info() const override { return info_; }
  const ShardLayout& layout() const override { return layout_; }
  models::UnitAccess& access() override { return *this; }
  Optimizer& optimizer() override { return *optimizer_; }
  std::uint64_t bytes_sent() const override { return comm_.bytes_sent(); }
  double exposed_seconds() const override { return exposed_s_; }

 protected:
  explicit StrategyCore(const StrategyArgs& a)
      : info_(a.info),
        comm_(a.comm),
        layout_(a.layout.params, a.layout.elements, a.layout.units, a.comm.size(), a.options.bucket_elements,
                layout_align(a)) {}
  // Runs fn, counting its time as communication the rank waited for.
  template <class F>
  void blocked(F&& fn) {
    add_seconds(exposed_s_, std::forward<F>(fn));
  }

  const StrategyInfo& info_;
  Communicator& comm_;
  ShardLayout layout_;
  std::unique_ptr<Optimizer> optimizer_;  // views into the derived class's buffers; frees only its own state
  double exposed_s_ = 0;
};

// The optimizer's groups for a strategy's parameter views: one group, or
// with spec.fallback the parameters the rule refuses in a second group of
// the fallback rule. Where the rule takes none of them: InvalidInput, or
// with `fallback_only` an empty first group before the fallback's.
std::vector<ParamGroupSpec> optimizer_groups(const OptimizerSpec& spec, std::vector<Param> views,
                                             bool fallback_only = false);

// Setup check: every rank must agree on what it is about to train; a
// mismatch names the first rank that differs from rank 0 and the item.
void check_agreement(Communicator& comm, std::string_view strategy, const ShardLayout& layout,
                     const OptimizerSpec& spec, const StrategyOptions& options);

}  // namespace distopt::parallel::detail
