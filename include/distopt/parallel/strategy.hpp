// A parallel strategy owns a rank's parameters, gradients and optimizer,
// and decides what to communicate in a step (docs/architecture.md, "One
// step per strategy"; docs/algorithms.md, "Training step"). The training
// loop runs the model through access() and calls step(); it never knows
// which strategy it drives. Each strategy declares what it is in its
// StrategyInfo, listed once in the registry (src/parallel/registry.cpp):
// callers read those properties and never compare strategy names.
//
//   ddp    every rank holds all parameters, gradients and optimizer state;
//          each bucket of gradients is all-reduced as soon as backward has
//          finished it, overlapping the rest of backward.
//   zero1  parameters and gradients replicated, optimizer state (and fp32
//          master weights) for the own shard only: reduce-scatter each
//          bucket of gradients as soon as backward has finished it (in
//          place, as Megatron's distributed optimizer does), step the
//          shard, all-gather the parameters (each unit waited for just
//          before the next forward needs it).
//   zero2  as zero1, but only the own gradient shard is kept: backward
//          writes a bucket into a scratch buffer that is freed once the
//          bucket is reduce-scattered.
//   zero3  parameters sharded too: a unit is all-gathered before its
//          forward and again before its backward (the next unit prefetched)
//          and freed after use; gradients as zero2.
//
// All four use one ShardLayout per world size and the communicator's one
// summation order, so for pointwise optimizers they produce bitwise-equal
// parameters (clipping and loss scaling included).
//
// The gossip strategies (docs/gossip.md) keep a whole model per rank, step
// it with the rank's own gradient (the local mean, not a global one) and
// the rank's own optimizer state, and mix it with peers instead of
// all-reducing gradients:
//   sgp     push-sum on the topology after every step; gradients at the
//           de-biased parameters x / w (Assran et al. 2019)
//   osgp    sgp overlapped: a round is sent after every step and added
//           synch_freq + 1 steps later (1-OSGP with synch_freq 0)
//   dpsgd   x <- W x - lr g(x): the exchange of x runs during forward and
//           backward (Lian et al. 2017), doubly stochastic W
//   adpsgd  asynchronous pairwise averaging x <- (x + x_partner) / 2 on a
//           communication thread, the partner from a bipartite matching per
//           round (Lian et al. 2018); gradients at the copy of x taken after
//           the last step; a step waits only for the round synch_freq + 1
//           steps old. The only strategy whose bits depend on timing.
//   slowmo  local SGD (parameters averaged every localsgd_frequency steps)
//           or sgp, with SlowMo's outer momentum every slowmo_frequency
//           steps (Wang et al. 2020)
//   diloco  each rank trains its replica sync_every steps with its own
//           inner optimizer; then the pseudo-gradient (model at the last
//           sync - own model) is averaged and an outer optimizer steps the
//           synced model with it, from which every rank goes on
//           (Douillard et al. 2023)
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "distopt/comm/communicator.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/flat.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/parallel/layout.hpp"

namespace distopt::parallel {

// Bytes one rank holds at the peak of a step, by what they hold.
struct MemoryUse {
  std::size_t params = 0;           // parameters (and gathered or fp32 compute copies of units in flight)
  std::size_t grads = 0;            // gradients (and buckets in flight)
  std::size_t master_params = 0;    // fp32 master weights of bf16/f16 parameters
  std::size_t optimizer_state = 0;  // the rule's state tensors
  // The model's, filled in by the trainer (Model::activation_bytes,
  // workspace_bytes): activations kept for backward, and scratch.
  std::size_t activations = 0;
  std::size_t workspaces = 0;
};

struct OptimizerSpec {
  std::string name;    // a registered update rule, e.g. "adamw"
  OptionMap options;   // torch-named; omitted ones take the defaults
  // The rule for the parameters `name` cannot take (muon's 1-D ones), in a
  // second group with that rule's defaults; empty: such a parameter is an
  // error.
  std::string fallback = {};
};

// The model's flat buffer: every parameter's slot, the buffer's length
// (padding included) and its units (empty: one unit, the whole buffer).
struct FlatLayout {
  std::vector<ParamSlot> params;
  std::size_t elements = 0;
  std::vector<UnitRange> units;
};
// A model's flat layout: its parameters, buffer length and units.
FlatLayout flat_layout(const models::Model& model);

// Options of the gossip strategies (ignored by the others).
struct GossipOptions {
  std::string topology;         // empty: exponential (dpsgd: bipartite-exponential)
  int peers_per_iteration = 1;  // exponential-k
  int synch_freq = 0;           // osgp: a round is added synch_freq + 1 steps after it was sent;
                                // adpsgd: a step waits for the round synch_freq + 1 steps old
  std::string slowmo_base = "localsgd";  // slowmo: localsgd or sgp
  int localsgd_frequency = 3;
  int slowmo_frequency = 48;    // tau
  double slowmo_momentum = 0.5;  // beta
  double slowmo_lr = 1.0;        // alpha
  // diloco (Douillard et al. 2023): inner steps between outer steps (H),
  // and the outer optimizer: a rule of the library with lr outer_lr; sgd
  // takes outer_momentum, with Nesterov's form when it is positive (the
  // paper's SGD, lr 0.7, Nesterov momentum 0.9).
  int sync_every = 100;
  std::string outer_optimizer = "sgd";
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  // Streaming DiLoCo (Douillard et al. 2025): the units cut into
  // `fragments` strided sets (unit u in fragment u mod P) that sync at
  // staggered steps, fragment p first after ((p + 1) * H) / P steps; a
  // fragment's average starts `sync_delay` inner steps before it is applied
  // (0: at once); once applied, its parameters become
  // (1 - fragment_alpha) * global + fragment_alpha * local. With
  // fragment_carry, global there is the new global plus the rank's own
  // change since the sync step (local - local at the sync step): the inner
  // steps taken while the average was in flight are kept, and the next
  // pseudo-gradient counts them.
  int fragments = 1;
  int sync_delay = 0;
  double fragment_alpha = 0;
  bool fragment_carry = false;
  // The pseudo-gradient on the wire: f32 (an all-reduce), or bf16, fp8
  // (e4m3) or int4 with a scale per block of 64 (all-gathered, summed in
  // f32 in rank order); with outer_error_feedback each rank carries what
  // quantisation lost into its next sync.
  std::string outer_dtype = "f32";
  bool outer_error_feedback = false;
  friend bool operator==(const GossipOptions&, const GossipOptions&) = default;
};

// Gradients compressed on the wire (docs/sharding.md, "Gradient
// compression"):
//  - bf16, fp16: rounded before they are reduced and summed in fp32 in the
//    communicator's one rank order (torch's bf16_compress_hook and
//    fp16_compress_hook, without their division by the world before the
//    sum), half the bytes. ddp, zero1, zero2 and zero3 reduce the same
//    rounded values in the same order, so they still give each other's
//    bits.
//  - int8: blocks of 256 with an fp32 scale, each rank carrying what
//    quantization lost into its next step (error feedback); each rank's
//    shard of every unit sent to its owner (all-to-all) and summed there in
//    rank order (ZeRO++'s qgZ). ddp sends the sums back as int8 too, with
//    the owners' own error feedback (1-bit Adam's two-phase all-reduce), so
//    ddp differs from zero1-3, which give each other's bits. About a
//    quarter of the bytes.
//  - powersgd: each matrix parameter's gradient (plus the rank's residual)
//    approximated at rank powersgd_rank by two all-reduces of its factors,
//    warm-started, with error feedback; vectors and small matrices sent
//    whole; uncompressed for the first powersgd_warmup steps (torch's
//    powerSGD_hook). Every strategy computes the same approximation, so
//    all four give each other's bits.
//  - onebit: 1-bit Adam (Tang et al. 2021) with Adam or AdamW: the first
//    onebit_warmup steps plain (the rule's own Adam), then the variance
//    frozen and each rank's first moment, advanced with its own gradient
//    and divided by the frozen step's denominator, averaged in a two-phase
//    compressed all-reduce of signs (one scale per 1024 values) with error
//    feedback on the ranks and on the owners of the shards
//    (RuleInfo::moment; docs/sharding.md, "1-bit Adam"). Every rank keeps the whole averaged
//    moment; ddp, zero1 and zero2 give each other's bits. About a 32nd of
//    the gradient's bytes (zero1/2 still gather the parameters).
// None is ddp's uncompressed bits. Not for the gossip strategies, nor
// with --param-dtype bf16/f16 (already on the wire).
enum class GradCompression : std::uint8_t { none, bf16, fp16, int8, powersgd, onebit };
inline constexpr GradCompression kGradCompressions[] = {GradCompression::none,     GradCompression::bf16,
                                                        GradCompression::fp16,     GradCompression::int8,
                                                        GradCompression::powersgd, GradCompression::onebit};
std::string_view name_of(GradCompression c);
std::optional<GradCompression> parse_grad_compression(std::string_view name);
// "none, bf16, fp16, int8, powersgd, onebit"
std::string_view grad_compression_names();

struct StrategyOptions {
  // Gradient bucket size in elements (buckets hold whole units and close
  // once they reach it); must be at least 1.
  std::size_t bucket_elements = std::size_t{1} << 15;
  // What is live at once (StrategyInfo::sharded_params, zero3; docs/sharding.md,
  // "Live limits"):
  // the units gathered ahead of the one the model uses (0: a unit is
  // gathered when the model asks for it, so one is live at a time), and
  // the most parameter elements gathered at once (0: no limit; otherwise
  // at least the largest unit), counting the buffers that hold them; a
  // prefetch that would pass the limit waits until the model asks for it.
  int prefetch_units = 1;
  std::size_t max_live_params = 0;
  // zero2 and zero3 (StrategyInfo::sharded_grads): gradient buckets in
  // flight, the one backward writes included (at least 1).
  int max_buckets_in_flight = 2;
  // Parameters and gradients are held and communicated in this dtype; with
  // bf16/f16 the optimizer keeps fp32 master weights (of its shard).
  DType param_dtype = DType::f32;
  GradCompression grad_compression = GradCompression::none;
  // PowerSGD: the approximation's rank (at least 1) and the steps reduced
  // uncompressed first (torch's matrix_approximation_rank and
  // start_powerSGD_iter, with their defaults).
  int powersgd_rank = 1;
  std::size_t powersgd_warmup = 10;
  // 1-bit Adam: the steps of plain Adam before the variance is frozen (at
  // least 1; DeepSpeed's freeze_step).
  std::size_t onebit_warmup = 100;
  // zero3: the parameters' all-gathers as int8 packets (ZeRO++'s qwZ;
  // docs/sharding.md, "int8 parameter gathers"; --gather-compression int8):
  // each rank packs its fp32 shard of a unit (blocks of 256, an fp32 scale
  // each) and every rank computes with the unpacked values, its own shard's
  // too. The shard the optimizer steps stays fp32 and exact; evaluation,
  // checkpoints and exports read it.
  bool int8_gather = false;
  GossipOptions gossip;
};

// The gradient as an update sees it: `owned` are the gradient elements this
// rank accounts for in a statistic -- its shard, padding excluded, the same
// elements in the same order under every strategy -- and `reduce` combines
// a statistic over the ranks (sum in rank order, or max). Clipping and the
// loss scaler's inf check go through these, so their numbers do not depend
// on the strategy.
struct GradShard {
  std::span<const TensorView> owned;
  StatReduce reduce;
};

// What a gossip rank holds besides its parameters and optimizer state, for
// a checkpoint (docs/formats.md, "Gossip runs"): its step count, numbers
// (the push-sum weight, the rounds in flight) and vectors (the numerator x,
// shares received but not yet added, SlowMo's outer state), in the engine's
// own order and padded layout.
struct LocalState {
  std::uint64_t steps = 0;
  std::vector<double> scalars;
  std::vector<std::pair<std::string, std::vector<float>>> tensors;
  // A survivor's state (Strategy::survivor_state): nothing in flight,
  // model-sized tensors in the model's flat layout (the padded one depends
  // on the world size), and what the ranks share agreed again when it is
  // resumed.
  bool survivor = false;
};

// What a step runs on the combined gradient in place of opt.step(): it may
// unscale or clip the gradient first, and skip the update (loss scaling).
using UpdateFn = std::function<void(Optimizer& opt, const GradShard& grads)>;

class Strategy;

// What a strategy is, declared once beside its code (one entry per
// strategy in the registry, src/parallel/registry.cpp). Nothing outside a
// strategy's own file compares strategy names: callers read these.
struct StrategyInfo {
  std::string_view name;
  std::string_view help;  // one line: what it holds and communicates
  // Every rank holds every parameter whole, in the padded layout (ddp and
  // the gossip strategies); otherwise each rank keeps its shard of each
  // unit (zero1-3) and own_params()/optimizer state are shard-shaped.
  bool replicated_params = true;
  // Ranks hold different models (the gossip strategies): the gradient is
  // the rank's own, evaluation runs on the ranks' average, checkpoints keep
  // every rank's own state (Strategy::local_state), and GossipOptions apply.
  bool per_rank_models = false;
  // The gossip graph without --topology (gossip::Topology's name); empty:
  // none (adpsgd pairs ranks itself, diloco averages exactly).
  std::string_view topology = {};
  // Why its ranks cannot go on without a lost rank (--on-rank-failure
  // continue), in a few words; empty: they can (Strategy::survivor_state
  // for the gossip strategies).
  std::string_view cannot_go_on = {};
  // Runs whole_tensor rules exactly only through RuleInfo::whole (gathering
  // each tensor's pieces); false: every rule's tensors are whole on the rank.
  bool whole_tensor_needs_gather = false;
  // Keeps only its shard of the gradient (zero2, zero3): backward writes
  // each bucket into a transient buffer, so access().grads(u) moves from
  // step to step. Otherwise (ddp, zero1) it is the same span of one
  // persistent buffer in every step, which a front end may hand to the
  // model as the gradient's own storage (python/src/sharded.cpp).
  bool sharded_grads = false;
  // Keeps only its shard of the parameters (zero3): units are gathered
  // when the model needs them (StrategyOptions::prefetch_units and
  // max_live_params apply).
  bool sharded_params = false;
  // The GossipOptions this strategy reads, by their flag names without the
  // dashes ("topology", "synch-freq", ...), given the options it is
  // configured with (slowmo's depend on its base): why `flag` does not
  // apply to `self` (this entry), or "" when it does. Null: it reads none.
  std::string (*option_misfit)(const StrategyInfo& self, std::string_view flag, const GossipOptions& options) = nullptr;
  // Builds the strategy (every rank alike; see make_strategy).
  std::unique_ptr<Strategy> (*make)(const struct StrategyArgs& args) = nullptr;
  // The bytes a rank sends per step by the ZeRO paper's model, in units of
  // the parameters' bytes times (n - 1) / n: 2 where gradients are reduced
  // and parameters gathered once (ddp, zero1, zero2), 3 where parameters
  // are gathered twice (zero3); 0 where the model does not apply (gossip).
  // `distopt bench strategies` compares its measurement with it.
  double volume_psi = 0;
  // Memory a rank keeps, in floats per parameter (parameters, gradients
  // and up to three optimizer state tensors): `whole` on every rank and
  // `divided` among the ranks; and how many of the largest unit it holds
  // in flight besides (gathered units, gradient buckets). The CLI's
  // preflight reads it (memory_per_rank).
  struct Memory {
    double whole = 5, divided = 0, units_in_flight = 0;
  } memory = {};
};

// What StrategyInfo::memory comes to at `world` ranks.
struct MemoryPerRank {
  double floats_per_param, largest_units;
};
MemoryPerRank memory_per_rank(const StrategyInfo& info, int world);

// The initial fp32 parameters, unsharded in the model's layout (no
// padding), read a range at a time: a strategy that keeps a shard reads
// only its pieces, so no rank need hold the whole model to start (with
// Model::init_range). Implicit from a span holding all of them.
class InitialParams {
 public:
  using Fill = std::function<void(std::size_t begin, std::span<float> out)>;
  InitialParams(std::span<const float> whole)  // NOLINT(google-explicit-constructor)
      : size_(whole.size()), fill_([whole](std::size_t begin, std::span<float> out) {
          std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(begin), out.size(), out.begin());
        }) {}
  InitialParams(const std::vector<float>& whole)  // NOLINT(google-explicit-constructor)
      : InitialParams(std::span<const float>(whole)) {}
  // `fill(begin, out)` writes elements [begin, begin + out.size()).
  InitialParams(std::size_t size, Fill fill) : size_(size), fill_(std::move(fill)) {}
  std::size_t size() const { return size_; }
  void read(std::size_t begin, std::span<float> out) const {
    DISTOPT_CHECK(begin <= size_ && out.size() <= size_ - begin, begin, " + ", out.size(), " vs ", size_);
    if (!out.empty()) fill_(begin, out);
  }

 private:
  std::size_t size_;
  Fill fill_;
};

// What make_strategy hands a registry entry's make (and so a strategy's
// constructor).
struct StrategyArgs {
  const StrategyInfo& info;
  Communicator& comm;
  const FlatLayout& layout;
  const InitialParams& initial;  // the unsharded parameters, the model's layout
  const OptimizerSpec& optimizer;
  const StrategyOptions& options;
};

// The registry: every strategy this build runs, in the command-line
// contract's order, then any registered at run time.
std::span<const StrategyInfo* const> all_strategies();
// Adds a strategy (an extension's, or a test's) to the registry; `info`
// must outlive every use. Call before any rank starts (not thread-safe);
// a name already there is refused (InvalidInput).
void register_strategy(const StrategyInfo& info);
// The entry of `name`, or null.
const StrategyInfo* find_strategy(std::string_view name);
// The entry of `name`; InvalidInput listing the known ones otherwise.
const StrategyInfo& strategy_or_throw(std::string_view name);

class Strategy {
 public:
  virtual ~Strategy() = default;
  // The registry entry this strategy was made from.
  virtual const StrategyInfo& info() const = 0;
  std::string_view name() const { return info().name; }
  virtual const ShardLayout& layout() const = 0;
  // Forward, backward and evaluation of the current parameters run through
  // this. Backward writes each rank's contribution to the gradient, already
  // scaled so that the sum over ranks is the gradient of the global batch's
  // mean loss.
  virtual models::UnitAccess& access() = 0;
  // What evaluation runs through: the parameters themselves, or for gossip
  // strategies the average of all ranks' models (collective).
  virtual models::UnitAccess& eval_access() { return access(); }
  // Gossip strategies: (1/n) sum_i |z_i - z_mean|^2 over the ranks' de-biased
  // models (collective). Others: NaN, without communicating.
  virtual double consensus_distance();
  // Combines the ranks' contributions and updates the parameters: with
  // opt.step(), or with `update` when one is given.
  virtual void step(const UpdateFn& update = {}) = 0;
  virtual Optimizer& optimizer() = 0;
  virtual MemoryUse memory() const = 0;
  // Bytes this rank has sent through its communicator so far.
  virtual std::uint64_t bytes_sent() const = 0;
  // Seconds this rank's thread has spent blocked on communication inside
  // access() and step() so far: the part of the communication that compute
  // did not hide (the communicator's busy_seconds() is all of it).
  virtual double exposed_seconds() const = 0;

  // The fp32 values of the parameters this rank keeps: the whole padded
  // buffer where parameters are replicated (ddp), the rank's shard buffer
  // otherwise. Weight averaging works on these. Valid until the next step()
  // or own_params() call (a live view or a copy, depending on the strategy).
  virtual std::span<const float> own_params() = 0;
  // own_params().size(), without the copy own_params() may make.
  std::size_t own_elements() const {
    return info().replicated_params ? layout().padded_elements() : layout().shard_elements();
  }
  // The full, unsharded fp32 values of each parameter in slot order
  // (p = 0, 1, ...), from values shaped like own_params(), handed to `each`
  // one parameter at a time -- a parameter of a tiled unit in consecutive
  // pieces of at most a tile -- and valid only during the call (collective:
  // every rank sees every parameter; at most one unit, or one tile, is
  // gathered at once).
  using ParamVisitor = std::function<void(std::size_t p, std::span<const float> values)>;
  virtual void for_each_param(std::span<const float> own, const ParamVisitor& each) = 0;
  // The current parameters, as for_each_param(own_params(), each), read in
  // place where the rank holds them whole (ddp, zero1, zero2, gossip).
  virtual void for_each_current_param(const ParamVisitor& each) { for_each_param(own_params(), each); }
  // The same, gathered into one vector in slot order without padding.
  std::vector<float> gather(std::span<const float> own);
  std::vector<float> gather_params() { return gather(own_params()); }
  // Read-only unit access (evaluation) to parameters given as values shaped
  // like own_params(); `own` must outlive it (collective per unit). Gossip
  // strategies evaluate the average of the ranks' `own`.
  virtual std::unique_ptr<models::UnitAccess> access_to(std::span<const float> own) = 0;

  // Values shaped like own_params(): where ranks hold different ones
  // (gossip), their mean in rank order, the same bits on every rank
  // (collective); elsewhere the values themselves.
  virtual std::vector<float> mean_over_ranks(std::span<const float> values) {
    return {values.begin(), values.end()};
  }
  // Compressed gradients' error feedback (int8, powersgd; docs/formats.md,
  // "Error feedback"): what this rank's compression still owes, in the padded
  // layout, and where the strategy packs its sums a second time (ddp),
  // what its owners' packing owes, in the shard layout; empty where there
  // is none. Checkpoints keep both; a resume at another world or strategy
  // keeps what they owe in total.
  struct Feedback {
    std::span<float> residual, sums;
    // PowerSGD's warm start: each compressed parameter's Q (its columns x
    // the rank, row-major), the same on every rank.
    struct Factor {
      std::size_t param, rank;
      std::span<float> q;
    };
    std::vector<Factor> factors;
  };
  virtual Feedback feedback() { return {}; }
  // Gossip strategies: this rank's LocalState, between two steps
  // (collective: rounds in flight are received first, without being added,
  // and adpsgd's allowed rounds completed; the run goes on unchanged).
  // Others: none.
  virtual std::optional<LocalState> local_state() { return std::nullopt; }
  // Gossip strategies that can go on without a lost rank (all but
  // adpsgd), after a collective failed: this rank's LocalState without
  // communication (docs/reliability.md, "Survivors"). Rounds in flight are
  // dropped; x is the de-biased model with weight 1, so the survivors'
  // average is their models' average; SlowMo's and DiLoCo's shared state
  // carries how many outer steps it has taken, so that resume() can give
  // every survivor the state of the one that took the most (a collective
  // that failed may have completed on some ranks only). Others: none.
  virtual std::optional<LocalState> survivor_state() { return std::nullopt; }
  // Gossip strategies, before new ranks join (collective: every rank is
  // there, after the same step): the rounds in flight complete into the
  // ranks' models, and diloco's averages in flight land and are kept by
  // survivor_state() (applied at their step), so nothing is dropped.
  virtual void complete_in_flight() {}
  // Whether new ranks may join after the step just taken (they take rank
  // 0's state): diloco admits them only at the end of an outer cycle (every
  // H steps), where every replica restarts from the synced model; the
  // others at any step.
  virtual bool admits_new_ranks() { return true; }
  // Whether the strategy can run at `world` ranks (gossip: its graph
  // exists there); checked before new ranks are counted.
  virtual bool can_run_at(int /*world*/) { return true; }
  // Gossip strategies, right after construction: go on as a run after
  // `steps` steps, from `saved` (this rank's local_state() in a run of the
  // same strategy, world size and gossip options, the strategy made with
  // that run's optimizer state for this rank) or, when null, from the
  // parameters and optimizer state it was made with, every rank alike
  // (weight 1, nothing in flight, SlowMo's momentum zero, DiLoCo's synced
  // model the current one and its outer state fresh). Others: nothing
  // to do. InvalidInput when `saved` does not fit. With a survivor's
  // state, collective: the survivors agree on their shared state.
  virtual void resume(std::uint64_t /*steps*/, const LocalState* /*saved*/) {}
};

// Every rank passes the same initial parameters (fp32, the model's layout).
// Throws InvalidInput for an unknown strategy (listing the known ones) or
// one that cannot run the optimizer exactly.
std::unique_ptr<Strategy> make_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                        const InitialParams& initial, const OptimizerSpec& optimizer,
                                        const StrategyOptions& options = {});

// Throws InvalidInput unless `name` is a strategy this build runs.
void require_strategy(std::string_view name);
// Throws InvalidInput unless `strategy` gives the exact result with `rule`:
// every strategy runs pointwise and tensor_stats rules exactly (the
// sharded ones reduce the statistics of each tensor's pieces); one that
// shards the optimizer state runs a whole_tensor rule only through the
// rule's RuleInfo::whole (gathering each tensor).
void require_exact(std::string_view strategy, const RuleInfo& rule);

// Each parameter of a padded buffer, in slot order, handed to `each`.
void for_each_padded_param(const ShardLayout& layout, std::span<const float> padded,
                           const Strategy::ParamVisitor& each);

}  // namespace distopt::parallel
