// ddp (torch's DistributedDataParallel): every rank holds all parameters,
// gradients and optimizer state; each bucket of gradients is all-reduced as
// soon as backward has finished it, overlapping the rest of backward, and
// every rank runs the whole step (engine.hpp; docs/algorithms.md,
// "Training step"). The all-reduce is reduce-scatter then all-gather in
// the communicator's one summation order, so ddp gives zero1-3's bits.
#include "engine.hpp"

namespace distopt::parallel::detail {

namespace {

class Ddp final : public Engine {
 public:
  explicit Ddp(const StrategyArgs& a) : Engine(a, {false, false, false}) {}

  std::span<const float> own_params() override {
    if (dtype_ == DType::f32) return {reinterpret_cast<const float*>(params_.bytes()), layout_.padded_elements()};
    own_.assign(layout_.padded_elements(), 0.0f);
    to_f32(dtype_, params_.bytes(), own_.data(), own_.size());
    return own_;
  }

 private:
  const char* values_of(std::size_t u, models::Pass) override {
    return params_.bytes() + layout_.units()[u].padded_offset * es_;
  }
  char* grad_target(std::size_t u) override { return grads_.bytes() + layout_.units()[u].padded_offset * es_; }
  void reduce_bucket(std::size_t b) override {
    const Wire w = wire();
    // Compressed gradients are compressed at world 1 too, as zero1-3's are.
    if (comm_.size() == 1 && w == Wire::plain) return;
    const auto& bucket = layout_.buckets()[b];
    char* g = grads_.bytes() + bucket.padded_offset * es_;
    InFlight f{b, {}, {}};
    if (w == Wire::int8) {
      reduce_int8(f, b, g);
    } else if (w == Wire::onebit) {
      reduce_onebit(f, b, g);
    } else if (w == Wire::powersgd) {
      reduce_powersgd(f, b, g);
    } else if (w == Wire::rounded) {  // reduced on the wire's dtype, then back
      f.scratch = to_wire(g, bucket.padded);
      char* w16 = f.scratch.bytes();
      f.requests.push_back(comm_.iall_reduce(w16, w16, bucket.padded, wire_type_, ReduceOp::sum));
      f.then = [this, g, w16, n = bucket.padded] { to_f32(wire_dtype_, w16, reinterpret_cast<float*>(g), n); };
    } else {
      f.requests.push_back(comm_.iall_reduce(g, g, bucket.padded, type_, ReduceOp::sum));
    }
    in_flight_.push_back(std::move(f));
  }
};

}  // namespace

constexpr const char* kHelp =
    "every rank holds all parameters, gradients and optimizer state; gradients all-reduced per bucket";
extern const StrategyInfo kDdp{.name = "ddp", .help = kHelp, .make = make_engine<Ddp>, .volume_psi = 2};

}  // namespace distopt::parallel::detail
