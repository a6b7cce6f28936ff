// zero2 (ZeRO stage 2; FairScale ShardedDDP): as zero1, but only the own
// gradient shard is kept: backward writes a bucket into a scratch buffer
// from the pool, reduce-scattered into the shard buffer as soon as the
// bucket is done and then given back (engine.hpp; docs/sharding.md).
// zero3 gathers parameters on top of this.
#include <cstring>

#include "distopt/core/error.hpp"
#include "engine.hpp"

namespace distopt::parallel::detail {

char* Zero2::grad_target(std::size_t u) {
  // The scratch of the bucket holding u, opened by its last unit.
  const auto& unit = layout_.units()[u];
  const std::size_t b = layout_.bucket_of(u);
  const auto& bucket = layout_.buckets()[b];
  if (in_flight_.empty() || in_flight_.back().bucket != b || !in_flight_.back().requests.empty()) {
    // At most max_buckets_in_flight buckets (default 2: one being written,
    // one being reduced).
    blocked([&] {
      while (in_flight_.size() >= max_buckets_) finish_oldest();
    });
    in_flight_.push_back({b, Held(grad_pool_, bucket.padded * es_, 6 + static_cast<int>(b % 2)), {}});
    // A recycled buffer: zero the units' padding, which backward never writes.
    char* scratch = in_flight_.back().scratch.bytes();
    for (std::size_t v = bucket.first; v < bucket.last; ++v) {
      const auto& vu = layout_.units()[v];
      std::memset(scratch + (vu.padded_offset - bucket.padded_offset + vu.size()) * es_, 0,
                  (vu.padded - vu.size()) * es_);
    }
  }
  return in_flight_.back().scratch.bytes() + (unit.padded_offset - bucket.padded_offset) * es_;
}

void Zero2::reduce_bucket(std::size_t b) {
  const auto& bucket = layout_.buckets()[b];
  InFlight& f = in_flight_.back();
  DISTOPT_CHECK(f.bucket == b, "bucket ", b, " finished out of order");
  const Wire w = wire();
  if (w == Wire::int8) return reduce_int8(f, b, f.scratch.bytes());
  if (w == Wire::onebit) return reduce_onebit(f, b, f.scratch.bytes());
  if (w == Wire::powersgd) return reduce_powersgd(f, b, f.scratch.bytes());
  if (w == Wire::rounded) return reduce_scatter_on_wire(f, b, f.scratch.bytes());
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    f.requests.push_back(comm_.ireduce_scatter(f.scratch.bytes() + (unit.padded_offset - bucket.padded_offset) * es_,
                                               grads_.bytes() + unit.shard_offset * es_, unit.shard, type_,
                                               ReduceOp::sum));
  }
}

constexpr const char* kHelp =
    "as zero1, and only the own gradient shard kept (buckets reduce-scattered while backward runs)";
extern const StrategyInfo kZero2{.name = "zero2", .help = kHelp, .replicated_params = false,
                                 .whole_tensor_needs_gather = true, .sharded_grads = true, .make = make_engine<Zero2>,
                                 .volume_psi = 2, .memory = {.whole = 1, .divided = 4, .units_in_flight = 2}};

}  // namespace distopt::parallel::detail
