// zero1 (ZeRO stage 1; Megatron's distributed optimizer; FairScale OSS):
// parameters and gradients replicated, optimizer state and fp32 master
// weights for the own shard only. Each bucket's units are reduce-scattered
// in place as soon as backward has finished them, the rank steps its
// shard, and the updated shards are all-gathered per unit, each waited for
// just before the next forward needs it (engine.hpp; docs/sharding.md).
// zero2 and zero3 build on this class.
#include "engine.hpp"

namespace distopt::parallel::detail {

Zero1::Zero1(const StrategyArgs& a, Holding holding) : Engine(a, holding) {
  param_requests_.resize(layout_.units().size());
}

Zero1::~Zero1() {
  for (auto& r : param_requests_) finish_quietly(r);
}

std::span<const float> Zero1::own_params() {
  // The rank's own regions are final after the update; the gathers still
  // running write only the other ranks' regions.
  own_.assign(layout_.shard_elements(), 0.0f);
  for (const auto& unit : layout_.units())
    to_f32(dtype_, params_.bytes() + (unit.padded_offset + rank_ * unit.shard) * es_, own_.data() + unit.shard_offset,
           unit.shard);
  return own_;
}

const char* Zero1::values_of(std::size_t u, models::Pass) {
  blocked([&] { finish(param_requests_[u]); });
  return params_.bytes() + layout_.units()[u].padded_offset * es_;
}

void Zero1::finish_param_reads() {
  for (auto& r : param_requests_) finish(r);
}

void Zero1::after_update() {
  // Gather the updated shards in place; the next forward waits for each
  // unit just before it needs it.
  for (std::size_t u = 0; u < layout_.units().size(); ++u) {
    const auto& unit = layout_.units()[u];
    char* p = params_.bytes() + unit.padded_offset * es_;
    param_requests_[u] = comm_.iall_gather(p + rank_ * unit.shard * es_, p, unit.shard, type_);
  }
}

char* Zero1::grad_target(std::size_t u) { return grads_.bytes() + layout_.units()[u].padded_offset * es_; }

void Zero1::reduce_bucket(std::size_t b) {
  // Megatron's distributed optimizer: reduce-scatter each unit in place,
  // rank r's shard of the sum landing on its own region of the padded
  // gradient buffer, while backward goes on.
  const auto& bucket = layout_.buckets()[b];
  InFlight f{b, {}, {}};
  const Wire w = wire();
  if (w == Wire::int8) {
    reduce_int8(f, b, grads_.bytes() + bucket.padded_offset * es_);
  } else if (w == Wire::onebit) {
    reduce_onebit(f, b, grads_.bytes() + bucket.padded_offset * es_);
  } else if (w == Wire::powersgd) {
    reduce_powersgd(f, b, grads_.bytes() + bucket.padded_offset * es_);
  } else if (w == Wire::rounded) {
    reduce_scatter_on_wire(f, b, grads_.bytes() + bucket.padded_offset * es_);
  } else {
    for (std::size_t u = bucket.first; u < bucket.last; ++u) {
      const auto& unit = layout_.units()[u];
      char* g = grads_.bytes() + unit.padded_offset * es_;
      f.requests.push_back(comm_.ireduce_scatter(g, g + rank_ * unit.shard * es_, unit.shard, type_, ReduceOp::sum));
    }
  }
  in_flight_.push_back(std::move(f));
}

constexpr const char* kHelp =
    "optimizer state (and fp32 master weights) sharded; gradients reduce-scattered, parameters all-gathered";
extern const StrategyInfo kZero1{.name = "zero1", .help = kHelp, .replicated_params = false,
                                 .whole_tensor_needs_gather = true, .make = make_engine<Zero1>, .volume_psi = 2,
                                 .memory = {.whole = 2, .divided = 3}};

}  // namespace distopt::parallel::detail
