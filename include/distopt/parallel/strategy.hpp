// A parallel strategy owns a rank's parameters, gradients and optimizer,
// and decides what to communicate in a step (DESIGN.md, "one training step,
// per strategy"). The training loop only runs forward/backward into grads()
// and calls step(), so strategies plug in without changing model code.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/comm/communicator.hpp"
#include "distopt/core/flat.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/optim/optimizer.hpp"

namespace distopt::parallel {

// Bytes one rank holds at the peak of a step.
struct MemoryUse {
  std::size_t params = 0, grads = 0, master_params = 0, optimizer_state = 0;
};

struct OptimizerSpec {
  std::string name;    // a registered update rule, e.g. "adamw"
  OptionMap options;   // torch-named; omitted ones take the defaults
};

// The flat buffer's layout: every parameter's slot and the buffer's length
// (padding included).
struct FlatLayout {
  std::vector<ParamSlot> params;
  std::size_t elements = 0;
};

// What a step runs on the combined gradient in place of opt.step(): it may
// unscale or clip the gradient first, and skip the update (loss scaling).
// `reduce` reduces a statistic over the ranks that hold the other pieces of
// the gradient this rank updates with; it is empty when the rank holds all
// of it (ddp), so tensor statistics such as the clipping norm take the same
// code path sharded or not.
using UpdateFn = std::function<void(Optimizer& opt, const StatReduce& reduce)>;

// The parameters of a flat buffer in slot order, without padding.
std::vector<float> unpadded(const FlatLayout& layout, std::span<const float> buffer);

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string_view name() const = 0;
  // The full parameters this rank runs forward and backward with.
  virtual std::span<const float> params() const = 0;
  // Where backward writes this rank's contribution to the gradient (each
  // rank's contribution is already scaled so that the sum over ranks is the
  // gradient of the global batch's mean loss).
  virtual std::span<float> grads() = 0;
  // Combines the ranks' contributions and updates the parameters: with
  // opt.step(), or with `update` when one is given.
  virtual void step(const UpdateFn& update = {}) = 0;
  virtual Optimizer& optimizer() = 0;
  virtual MemoryUse memory() const = 0;
  // The full, unsharded fp32 parameters in slot order without padding
  // (collective for strategies that shard them).
  virtual std::vector<float> gather_params() = 0;
};

// Every rank passes the same initial parameters. Throws InvalidInput for an
// unknown strategy (listing the known ones) or one not built yet.
std::unique_ptr<Strategy> make_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                        std::span<const float> initial, const OptimizerSpec& optimizer);

// The strategy names of the command-line contract, and those available now.
std::span<const std::string_view> strategy_names();
// Throws InvalidInput unless `name` is a strategy this build can run.
void require_strategy(std::string_view name);

}  // namespace distopt::parallel
