// The engine core under ddp, zero1, zero2 and zero3 (not installed; the
// strategies are ddp.cpp, zero1.cpp, zero2.cpp and zero3.cpp beside it):
// the flat parameter and gradient buffers, the memory meter and the pool
// of transient buffers, the optimizer over whole tensors or over the
// rank's pieces of them, the gradient buckets in flight, and the step.
//
// What each strategy holds and communicates (docs/algorithms.md,
// "Training step"; docs/sharding.md):
//
//   strategy  params            grads                       reduction              after the update
//   ddp       padded, all       padded, all                 all_reduce per bucket  --
//   zero1     padded, all       padded, all                 reduce_scatter per     all_gather per unit
//                                                           bucket during backward
//   zero2     padded, all       own shard + buckets in      reduce_scatter per     all_gather per unit
//                               flight                      bucket during backward
//   zero3     own shard + units own shard + buckets in      as zero2               -- (units are gathered
//             in flight         flight                                            when the model needs them)
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
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "distopt/parallel/strategy.hpp"
#include "internal.hpp"
#include "powersgd.hpp"

namespace distopt::parallel::detail {

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
  ~Pool();
  Buffer take(std::size_t bytes, int slot);
  void give(Buffer&& b) {
    if (!b.empty()) idle_.push_back(std::move(b));
  }
  // The size of the buffer take(bytes) would hand out.
  std::size_t fit(std::size_t bytes) const;
  // Lean: take() frees the idle buffers it does not hand out, so what the
  // pool holds is what is in use (a live limit counts it exactly), at the
  // cost of allocating more often.
  void set_lean(bool lean) { lean_ = lean; }

 private:
  std::vector<Buffer>::const_iterator best_fit(std::size_t bytes) const;
  void free_idle();
  Meter& meter_;
  Meter::Kind kind_;
  std::vector<Buffer> idle_;
  bool lean_ = false;
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
  Held(Held&& o) noexcept;
  Held& operator=(Held&& o) noexcept;
  ~Held() { release(); }
  char* bytes() { return buf_.as<char>(); }
  const char* bytes() const { return buf_.as<char>(); }
  bool empty() const { return buf_.empty(); }
  std::size_t size_bytes() const { return buf_.size_bytes(); }

 private:
  void release();
  Meter* meter_ = nullptr;
  Pool* pool_ = nullptr;
  Meter::Kind kind_ = Meter::params;
  Buffer buf_;
};

void to_f32(DType t, const void* src, float* dst, std::size_t n);
void from_f32(DType t, const float* src, void* dst, std::size_t n);

// Waits for a request, if any, and forgets it.
void finish(std::unique_ptr<Request>& r);
// The same, ignoring its error: for draining before buffers are freed
// after a failure (a collective may still write into them).
void finish_quietly(std::unique_ptr<Request>& r) noexcept;

// What a strategy keeps sharded; the rest is replicated on every rank.
struct Holding {
  bool state = false;   // optimizer state and master weights (zero1-3)
  bool grads = false;   // gradients: the own shard, buckets in flight (zero2, zero3)
  bool params = false;  // parameters: the own shard, units in flight (zero3)
};

class Engine : public StrategyCore {
 public:
  Engine(const StrategyArgs& a, Holding holding);
  ~Engine() override;

  MemoryUse memory() const override;
  std::unique_ptr<models::UnitAccess> access_to(std::span<const float> own) override;
  void for_each_param(std::span<const float> own, const ParamVisitor& each) override;
  void for_each_current_param(const ParamVisitor& each) override;

  // UnitAccess: the model's calls. A strategy supplies the unit's values
  // (values_of) and may act on release and after the update.
  std::span<const float> acquire(std::size_t u, models::Pass pass) override;
  void release(std::size_t u, models::Pass pass) override;
  // A tiled unit's range: bf16/f16 parameters converted for the range alone.
  std::span<const float> acquire_range(std::size_t u, std::size_t begin, std::size_t end, models::Pass pass) override;
  std::span<float> grads(std::size_t u) override;
  void grads_done(std::size_t u) override;

  void step(const UpdateFn& update) override;
  Feedback feedback() override;
  // The steps taken so far (PowerSGD's warm-up counts them).
  void resume(std::uint64_t steps, const LocalState*) override {
    steps_ = steps;
    moment_known_ = false;
  }

 protected:
  struct InFlight {
    std::size_t bucket;
    Held scratch;  // zero2/3: the bucket's full gradient until its reduction is done; compressed: the wire's
    std::vector<std::unique_ptr<Request>> requests;
    std::function<void()> then = {};  // once they are done (compressed: back to the gradient's dtype)
    Held received = {};               // int8: the packets that came in
  };

  // The unit's parameters in the param dtype, ready for the model.
  virtual const char* values_of(std::size_t u, models::Pass pass) = 0;
  // Waits for every collective that still reads the parameters.
  virtual void finish_param_reads() {}
  // After the optimizer has updated the rank's parameters.
  virtual void after_update() {}
  // Where backward writes unit u's gradient (param dtype).
  virtual char* grad_target(std::size_t u) = 0;
  // Starts the reduction of bucket b, which backward has just finished.
  virtual void reduce_bucket(std::size_t b) = 0;

  void finish_oldest();
  // Gradient compression (StrategyOptions::grad_compression): whether the
  // gradients travel compressed, and n of them at g rounded into a buffer
  // of the wire's dtype (bf16, fp16), leased from the pool.
  bool compressing() const { return compression_ != GradCompression::none; }
  // What this step's gradients travel as: plain (uncompressed, PowerSGD's
  // warm-up included), rounded (bf16, fp16), int8 packets or PowerSGD.
  enum class Wire { plain, rounded, int8, powersgd, onebit };
  Wire wire() const;
  Held to_wire(const char* g, std::size_t n);
  // zero1-3's compressed reduction of bucket b, whose gradients are at g:
  // rounded into f's wire buffer (f.scratch), each unit reduce-scattered in
  // place there, and once done the rank's shard of each unit widened back
  // into the gradients (the padded buffer's own region, or the shard buffer
  // where the strategy keeps only its shard).
  void reduce_scatter_on_wire(InFlight& f, std::size_t b, const char* g);
  // The same in int8 packets with error feedback (int8_wire.hpp): each
  // unit's shards packed into f.scratch, sent to their owners (all-to-all)
  // and, once in, unpacked and summed in rank order into the rank's shard
  // of the gradient. ddp (replicated parameters) then packs its sums with
  // the owners' error feedback and all-gathers them back into every rank's
  // whole gradient.
  void reduce_int8(InFlight& f, std::size_t b, const char* g);
  void land_int8(std::size_t b, const char* received);
  // PowerSGD (powersgd.hpp) on bucket b, whose gradients are at g: M = g +
  // the residual kept in place of it, P = M Q and the whole tensors
  // all-reduced from f.scratch; once in, Q = M^T P all-reduced, the
  // approximation delivered and the residual left.
  void reduce_powersgd(InFlight& f, std::size_t b, const char* g);
  void land_powersgd(std::size_t b, float* reduced);
  // 1-bit Adam (onebit_wire.hpp) on bucket b, whose gradients are at g:
  // each rank's moment share (the rule's moment advanced with the rank's
  // own gradient, over the world), plus its residual, packed per shard
  // and sent to the owners (all-to-all); once in, the owners sum the
  // shares in rank order, pack the sum with their own residual and
  // all-gather it; every rank multiplies it by the denominators into its
  // whole moment, which the optimizer then takes as the gradient
  // (Optimizer::set_frozen_since).
  void reduce_onebit(InFlight& f, std::size_t b, const char* g);
  void land_onebit(std::size_t b, const char* received);
  // The optimizer's first moments and the frozen step's denominators,
  // whole on every rank (gathered from the pieces where the state is
  // sharded): at the first compressed step and after a load or resume.
  void gather_moment();
  // Zeroes the positions of unit u's range [lo, hi) (unit-local) that hold
  // no parameter (padding and the gaps between parameters), `at` being lo.
  void zero_gaps(std::size_t u, std::size_t lo, std::size_t hi, float* at) const;
  // Bucket b's reduced fp32 gradient (padded bucket layout) into the
  // rank's gradients: all of it, or its shard of each unit (zero2, zero3).
  void deliver(std::size_t b, const float* reduced);
  // Where the rank's shard of unit u's gradient lives in grads_: the shard
  // buffer (zero2, zero3) or its region of the padded buffer.
  std::size_t own_grad_offset(const ShardLayout::Unit& unit) const {
    return info_.sharded_grads ? unit.shard_offset : unit.padded_offset + rank_ * unit.shard;
  }

  DType dtype_;
  ElemType type_;
  std::size_t es_, rank_;
  GradCompression compression_;
  DType wire_dtype_;
  ElemType wire_type_;
  std::size_t wire_es_;
  Meter meter_;
  Pool param_pool_{meter_, Meter::params}, grad_pool_{meter_, Meter::grads};  // outlive every lease below
  Held params_, grads_;
  // Error feedback (fp32): what each rank's compression lost (int8,
  // PowerSGD), in the padded layout (`residual_`), and int8 ddp's owners'
  // of their sums, in the shard layout (`sum_residual_`).
  Held residual_, sum_residual_;
  // 1-bit Adam: every rank's copy of the averaged first moment (padded)
  // and of the frozen step's denominators,
  // whether it is current, the warm-up, and each unit's parameter-free
  // ranges (unit-local [begin, end): padding, alignment gaps).
  Held moment_, denominator_;  // the frozen step's divisor, whole (1 where no parameter is)
  bool moment_known_ = false;
  std::uint64_t moment_loads_ = 0;  // the optimizer's state_loads() it was read at
  std::size_t onebit_warmup_ = 0;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> gaps_;
  std::vector<std::size_t> param_group_;  // each parameter's optimizer group
  std::unique_ptr<PowerSgd> powersgd_;
  std::size_t powersgd_warmup_ = 0;
  std::uint64_t steps_ = 0;
  std::vector<TensorView> owned_;
  std::map<std::string, std::vector<std::size_t>> piece_counts_;  // per parameter name: each rank's piece
  std::map<std::size_t, Held> compute_;                           // bf16/f16: fp32 copies of held units
  Held grad_compute_;                                             // bf16/f16: fp32 gradient of the unit in backward
  char* grad_target_ = nullptr;
  std::deque<InFlight> in_flight_;
  std::vector<float> own_;
};

// zero1: the state sharded; each unit's gradient reduce-scattered in place
// into the padded buffer, the updated shards all-gathered after the step.
// zero2 and zero3 build on it.
class Zero1 : public Engine {
 public:
  explicit Zero1(const StrategyArgs& a) : Zero1(a, {true, false, false}) {}
  ~Zero1() override;
  std::span<const float> own_params() override;

 protected:
  Zero1(const StrategyArgs& a, Holding holding);
  const char* values_of(std::size_t u, models::Pass pass) override;
  void finish_param_reads() override;
  void after_update() override;
  char* grad_target(std::size_t u) override;
  void reduce_bucket(std::size_t b) override;

  std::vector<std::unique_ptr<Request>> param_requests_;  // the gather of each unit after a step
};

// zero2: as zero1, with only the own gradient shard kept: backward writes a
// bucket into a scratch buffer freed once it is reduce-scattered.
class Zero2 : public Zero1 {
 public:
  explicit Zero2(const StrategyArgs& a) : Zero2(a, {true, true, false}) {}

 protected:
  Zero2(const StrategyArgs& a, Holding holding)
      : Zero1(a, holding), max_buckets_(static_cast<std::size_t>(a.options.max_buckets_in_flight)) {}
  char* grad_target(std::size_t u) override;
  void reduce_bucket(std::size_t b) override;

  std::size_t max_buckets_;
};

// A registry entry's make for an engine strategy.
template <class S>
std::unique_ptr<Strategy> make_engine(const StrategyArgs& args) {
  return std::make_unique<S>(args);
}

}  // namespace distopt::parallel::detail
