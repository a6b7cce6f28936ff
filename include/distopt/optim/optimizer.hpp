// Optimizer: torch.optim.Optimizer's bookkeeping around an update rule.
//
// Parameters are views into caller-owned memory (usually the flat buffers of
// a model). Each has a gradient view of the same dtype and size and a
// `has_grad` flag: a parameter without a gradient at a step is skipped
// exactly as torch skips `p.grad is None` -- no state is created, no step is
// counted, no decay applied. Groups carry torch-named options that users and
// schedulers may change between steps (set_option validates). State is
// created lazily on a parameter's first step (Adagrad: at construction).
// bf16/f16 parameters get fp32 master weights; all state is fp32.
//
// step() runs one fused pass per parameter over the rule's kernel, spread
// over the thread pool in chunks; after the first step it allocates nothing.
//
// Parameters on a CUDA device (TensorView::device; docs/gpu.md): all of an
// optimizer's parameters and gradients are on one device, its state is
// made there, and step() runs the rule's CUDA kernel over every tensor of a
// group in one multi-tensor launch, with the CPU's bits. The pointwise
// rules have kernels; the others are refused in one line when the group is
// added. state_tensor() and state_dict() copy device state to the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "distopt/core/tensor.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/optim/options.hpp"
#include "distopt/optim/quant.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt {

struct Param {
  static constexpr std::size_t kAll = static_cast<std::size_t>(-1);
  std::string name;
  TensorView value;  // the parameter
  TensorView grad;   // its gradient: same dtype and number of elements
  bool has_grad = false;
  // For tensor_stats rules under a parallel engine: the elements
  // [stat_begin, stat_begin + stat_count) of this view are the ones this
  // rank accounts for in the statistics of the tensor (ddp: its shard's
  // piece of a replicated tensor), the rest being other ranks'. Default:
  // all of them.
  std::size_t stat_begin = 0, stat_count = kAll;
  // When this view is a piece of a larger tensor (a shard's): the whole
  // tensor's shape and the index in it of the view's first element.
  // tensor_stats rules that look at rows and columns (Adafactor) need them.
  std::optional<Shape> tensor_shape = std::nullopt;
  std::size_t tensor_offset = 0;
};

// Sums per-tensor statistics over the ranks in place (in rank order, so
// that every rank gets the same bits); the identity in one process.
using StatsReduce = std::function<void(std::span<double> values)>;
// Gathers a whole tensor from the pieces the ranks hold (`piece` is this
// rank's, of parameter `p`) into `whole`, in element order (collective), and
// returns true; returns false, on every rank alike and without
// communicating, when one rank holds the whole tensor (the others then hold
// empty pieces of it).
using TensorGather = std::function<bool(const Param& p, std::span<const float> piece, std::span<float> whole)>;

struct ParamGroup {
  std::string rule;                 // the group's update rule (the optimizer's, or its own)
  std::vector<std::size_t> params;  // indices into Optimizer::params()
  OptionMap options;                // complete: defaults filled in
  // Other numbers kept in the group, as torch keeps "initial_lr", "max_lr",
  // "swa_lr", ... in a param_group dict for schedulers; the rule ignores them.
  std::map<std::string, double, std::less<>> extras;
};

// What a group looks like when it is handed to the optimizer.
struct ParamGroupSpec {
  std::vector<Param> params;
  OptionMap options;  // overrides of the optimizer's defaults
  // Another update rule for this group (empty: the optimizer's), e.g.
  // adamw for the 1-D parameters beside muon's matrices, as torch users
  // run two optimizers; its options start from that rule's defaults.
  std::string rule = {};
};

// torch-like state_dict: state keyed by parameter index (only parameters
// that have state), and the groups with their options and index lists.
struct StateTensor {
  Shape shape;
  std::vector<float> data;
};
using StateValue = std::variant<double, StateTensor>;
struct StateDict {
  std::map<std::size_t, std::map<std::string, StateValue>> state;
  std::vector<ParamGroup> param_groups;
};

struct OptimizerConfig {
  ThreadPool* pool = nullptr;              // nullptr: run on the calling thread
  std::size_t chunk_elements = 1u << 16;  // work item size for the pool
};

// Whether an Optimizer of rule `rule` can step parameters on `device`
// (every rule on the CPU; the pointwise ones, which have kernels, on CUDA).
bool rule_runs_on(std::string_view rule, Device device);
// Why rule `rule` cannot step parameters on `device` (one line naming the
// rules that can), or "" when it can: the one wording of that refusal.
std::string why_rule_cannot_run(std::string_view rule, Device device);

class Optimizer {
 public:
  // `defaults` overrides the rule's defaults for every group; each group's
  // own options override those. Throws InvalidInput for unknown rules,
  // unknown options and invalid values (torch's checks).
  Optimizer(std::string_view rule, std::vector<ParamGroupSpec> groups, OptionMap defaults = {},
            OptimizerConfig config = {});
  // One group holding `params`.
  Optimizer(std::string_view rule, std::vector<Param> params, OptionMap defaults = {},
            OptimizerConfig config = {});
  ~Optimizer();
  Optimizer(Optimizer&&) noexcept;
  Optimizer& operator=(Optimizer&&) noexcept;

  // The optimizer's rule (a group may have its own: group(g).rule).
  const RuleInfo& rule() const { return *rule_; }
  const RuleInfo& rule_of_group(std::size_t g) const { return *group_rules_.at(g); }
  const OptionMap& defaults() const { return defaults_; }

  void add_param_group(ParamGroupSpec group);
  std::size_t num_groups() const { return groups_.size(); }
  const ParamGroup& group(std::size_t g) const;
  // Changes one option of one group (e.g. "lr"), validated like the
  // constructor's. The next step uses it.
  void set_option(std::size_t g, std::string_view option, OptionValue value);
  double lr(std::size_t g) const { return group(g).options.at("lr").number(); }
  // Group extras (see ParamGroup::extras); extra() is nullopt when unset.
  void set_extra(std::size_t g, std::string_view key, double value);
  std::optional<double> extra(std::size_t g, std::string_view key) const;
  // Writes a group's lr as torch's `group["lr"] = x` does: schedulers may
  // take it anywhere (OneCycleLR past its last phase even below 0); only a
  // non-finite value is refused.
  void set_lr(std::size_t g, double lr);

  std::size_t num_params() const { return params_.size(); }
  Param& param(std::size_t i);
  const Param& param(std::size_t i) const;

  // One optimizer step over every parameter that has a gradient.
  // tensor_stats rules reduce their statistics with the stats reduce (every
  // rank must then step the same parameters).
  void step();
  // Where a device step runs (parameters on Device::cuda). By default, on
  // the calling thread's own stream, and the step is complete when step()
  // returns, as on the CPU. Given a caller's stream (a cudaStream_t as an
  // integer, 0 the legacy default stream: torch's current stream), the step
  // is enqueued on it and step() returns without waiting, ordered with the
  // caller's other work there; only a step that creates state first waits
  // for that stream (the state's first values are read from the parameters).
  void set_cuda_stream(std::optional<std::uintptr_t> stream) { cuda_stream_ = stream; }
  // 1-bit Adam (RuleInfo::moment): while set, step() takes each gradient as
  // the rule's averaged first moment and keeps the variance as it was after
  // step `frozen_at` (a parallel engine sets it once the warm-up is over).
  // A rule without a 1-bit form is refused (PreconditionError) at the step.
  void set_frozen_since(std::optional<std::uint64_t> frozen_at) { frozen_at_ = frozen_at; }
  std::optional<std::uint64_t> frozen_since() const { return frozen_at_; }
  std::optional<std::uintptr_t> cuda_stream() const { return cuda_stream_; }
  // GradScaler's protocol on the device: the next step's kernels read
  // `*device_flag` (a float in device memory: torch's found_inf) and, when it
  // is not 0, leave every parameter and state tensor as it was. The host
  // side of that step (step counts, the rules' scalars) is undone once the
  // flag is known, from a copy made without waiting: at the next step or
  // state access, or settle_skipped_step(). Device parameters only.
  void skip_next_step_if(const float* device_flag);
  // Waits for the last step's skip flag, if any, and undoes that step's
  // host side if it was skipped (as torch's fused optimizers leave "step").
  // step, add_param_group, init_state, reset_state and load_state_dict do
  // it first; the readers (state_scalar, state_views, state_dict) read what
  // is there.
  void settle_skipped_step();
  // Set by a parallel engine whose parameters are pieces of tensors spread
  // over ranks (or replicated, with stat ranges): see Param::stat_begin.
  void set_stats_reduce(StatsReduce reduce) { stats_reduce_ = std::move(reduce); }
  // Set by a parallel engine whose parameters are pieces: whole_tensor
  // rules (Muon, Shampoo, full-matrix Adagrad) gather each tensor's update,
  // every rank holding a piece computes the whole-tensor step on it and
  // keeps its own piece. A rank with an empty piece takes part in the
  // gather and computes nothing (its small state of the tensor stays as it
  // was).
  void set_tensor_gather(TensorGather gather) { tensor_gather_ = std::move(gather); }
  // set_to_none: mark every gradient absent; otherwise zero them.
  void zero_grad(bool set_to_none = true);

  // State of parameter i, by torch key; empty before its first step.
  bool has_state(std::size_t i) const;
  std::span<const float> state_tensor(std::size_t i, std::string_view key) const;
  double state_scalar(std::size_t i, std::string_view key) const;

  // The state of parameter i in place (memory the optimizer owns), by
  // torch key: tensors with their shapes, scalars (such as "step") as
  // 0-dim views. The Python front end hands them to torch zero-copy. Valid
  // until load_state_dict or a layout change re-creates them; empty before
  // the parameter's first step (see init_state). Scalars and the tensor_stats
  // rules' aux state are always host memory; the state tensors and master
  // weights of device parameters are on the device.
  struct StateView {
    std::string key;
    float* data;
    Shape shape;  // {} for a scalar
    Device device = Device::cpu;
  };
  std::vector<StateView> state_views(std::size_t i);
  // The state tensors of parameter i kept quantized (state_dtype bf16, int8
  // or int4: include/distopt/optim/quant.hpp), in place: `elements` values
  // as codes (quant.hpp's packing) and one fp32 scale per block (bf16:
  // none, absmax null). state_views
  // gives the rest of the parameter's state and leaves these out; a
  // checkpoint writes them as state_dict() does (the values, and the scales
  // under KEY.absmax) and a load sets codes and scales through these views.
  // Empty before the parameter's first step; valid as state_views' are.
  // On a CUDA device's optimizer the codes and scales are device memory
  // (`device`): HostQuantized reads and writes them from the host.
  struct QuantizedView {
    std::string key;
    quant::StateDType dtype = quant::StateDType::int8;
    bool is_signed = false;
    std::uint8_t* codes = nullptr;
    float* absmax = nullptr;
    std::size_t elements = 0;
    Device device = Device::cpu;
  };
  std::vector<QuantizedView> quantized_views(std::size_t i);
  // A quantized view's codes and scales where the host can reach them: the
  // view itself for host memory; for device memory, host copies, read from
  // the device (unless `read` is false: to be overwritten) and written back
  // by commit().
  class HostQuantized {
   public:
    HostQuantized(const QuantizedView& q, bool read);
    HostQuantized(const HostQuantized&) = delete;
    HostQuantized& operator=(const HostQuantized&) = delete;
    const QuantizedView& view() const { return host_; }
    void commit() const;

   private:
    QuantizedView of_, host_;
    std::vector<std::uint8_t> codes_;
    std::vector<float> absmax_;
  };
  // Creates parameter i's state now, as its first step would (what torch's
  // load_state_dict needs before it copies saved values in).
  void init_state(std::size_t i);
  // Returns parameter i to "no state yet", as torch's load_state_dict does
  // for a parameter the loaded dict has no entry for: its next step starts
  // it afresh (step 0, the rule's initial values). The memory is kept and
  // re-filled then, so views handed out earlier stay valid memory.
  void reset_state(std::size_t i);
  // After values were written into the state through state_views (a load):
  // recomputes what the optimizer keeps beside the state from it -- the
  // step count of group-counted rules (LAMB) -- as load_state_dict does.
  void state_written();
  // How many times state was loaded or reset (load_state_dict,
  // reset_state, state_written): a parallel engine that keeps a copy of
  // some state (1-bit Adam's whole moment) knows when to read it again.
  std::uint64_t state_loads() const { return state_loads_; }

  StateDict state_dict() const;
  // Validates the dict against this optimizer (group count and sizes, state
  // keys and shapes) before changing anything; throws InvalidInput.
  void load_state_dict(const StateDict& dict);

  // Bytes of optimizer state (and fp32 master weights, and the scratch of
  // tensor_stats rules that keep one) currently held;
  // master_bytes() is the master weights' part of it.
  std::size_t state_bytes() const;
  std::size_t master_bytes() const;

 private:
  struct ParamState;
  struct GroupLayout {
    StateLayout layout;
    std::uint64_t version = 0;
  };
  struct WorkItem {
    std::size_t param;
    std::size_t begin, end;
  };
  void add_group(ParamGroupSpec&& spec);
  std::size_t group_of(std::size_t param) const;
  // Creates or completes the state of parameter i for its group's layout;
  // returns true when any state tensor was created.
  bool ensure_state(std::size_t i, std::size_t g);
  // Whether parameter i's state exists in its group's current layout (else
  // ensure_state makes or completes it).
  bool state_is_current(std::size_t i) const;
  // Parameter i back to "no state yet", its buffers kept for ensure_state
  // to re-fill (reset_state; a skipped step that made the state).
  void forget_state(std::size_t i);
  void check_grad(std::size_t i) const;
  Slice slice_of(std::size_t i, std::size_t begin, std::size_t end) const;
  // The rule on elements [begin, end) of parameter i whose state is kept
  // quantized: a block at a time, dequantized, updated, quantized again.
  void apply_quantized(std::size_t i, std::size_t begin, std::size_t end);
  // The tensor_stats passes of a step over active_ (work_ holds their chunks).
  void run_stat_passes(bool threaded);
  void run_stat_passes(const RuleInfo& rule, bool threaded);
  // Of one pass over pass_active_: sizes stats_ (stat_offsets_, zeros) before
  // the partial sums; afterwards reduces them (globally, over the ranks) and
  // hands them to the rule's finish_pass.
  void size_stats(const RuleInfo& rule, int pass);
  void finish_stat_pass(const RuleInfo& rule, int pass);
  // The device's step (optimizer_device.cpp): the pointwise groups, then
  // the tensor_stats rules' passes and updates.
  void step_on_device(const float* skip);
  void stat_passes_on_device(const RuleInfo& rule);
  const Shape& tensor_shape_of(std::size_t i) const;

  const RuleInfo* rule_;
  Device device_ = Device::cpu;  // of every parameter (add_param_group checks)
  std::optional<std::uint64_t> frozen_at_;
  std::uint64_t state_loads_ = 0;
  std::optional<std::uintptr_t> cuda_stream_;  // set_cuda_stream
  int cuda_device_ = 0;                        // the device ordinal of device parameters
  const float* skip_flag_ = nullptr;           // skip_next_step_if, for the next step
  struct SkipState;                            // the last skip flag's copy and its step's undo
  std::unique_ptr<SkipState> skip_;
  // Before state is read or written outside a step: the steps enqueued on
  // callers' streams are done (every stream of the device).
  void wait_for_caller() const;
  OptionMap defaults_;
  OptimizerConfig config_;
  std::vector<Param> params_;
  std::vector<ParamGroup> groups_;
  std::vector<GroupLayout> layouts_;  // one per group
  std::vector<std::size_t> group_of_;  // group index of each param
  std::uint64_t next_version_ = 1;
  std::vector<std::unique_ptr<ParamState>> state_;  // one per param
  // Reused every step (capacity kept), so step() does not allocate.
  std::vector<RuleBlob> parsed_;
  std::vector<RuleBlob> coeffs_;
  std::vector<WorkItem> work_;
  std::vector<std::size_t> active_;  // parameters stepped this step
  std::vector<std::uint64_t> group_steps_;  // step() calls per group (RuleInfo::group_step)
  std::vector<const RuleInfo*> group_rules_;  // one per group
  std::vector<std::size_t> pass_active_;     // run_stat_passes: one rule's parameters
  std::vector<WorkItem> pass_work_;
  std::vector<double> stats_;
  std::vector<std::size_t> stat_offsets_;
  StatsReduce stats_reduce_;
  TensorGather tensor_gather_;
  std::vector<float> whole_;  // a gathered tensor (whole_tensor rules on pieces)
};

}  // namespace distopt
