// Sharding arithmetic, in one place (docs/architecture.md, "Data layout").
//
// A model's flat buffer is a sequence of units (layers), each a contiguous
// range. For a world of W ranks every unit is padded to a multiple of
// W·kAlign elements and cut into W equal, contiguous shards: rank r owns
// shard r of every unit. A parameter may straddle shards (ZeRO style);
// padding, never an error, absorbs sizes that do not divide. The "padded
// buffer" places the padded units one after another; a rank's "shard
// buffer" places its shards of the units one after another:
//
//   unit u in the model:   [ fc1.weight | fc1.bias ]               (end - begin)
//   padded:                [ fc1.weight | fc1.bias | 0 0 0 ]       (padded, multiple of W·16)
//   shards (W = 4):        [  rank 0  |  rank 1  |  rank 2  | rank 3 ]  (padded / W each)
//
// Every strategy at a world size uses the same layout, so statistics over
// the shards (the clipping norm) add the same numbers in the same order
// whichever strategy runs. Buckets group consecutive units (in backward
// order) up to a size, for the gradient reductions that overlap backward.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "distopt/core/flat.hpp"

namespace distopt::parallel {

// A unit of the model as the layout sees it: a contiguous range of the
// model's flat buffer holding whole parameters.
struct UnitRange {
  std::string name;
  std::size_t begin = 0, end = 0;
  std::size_t tile = 0;  // > 0: used a range at a time (models::Unit::tile)
};

class ShardLayout {
 public:
  static constexpr std::size_t kAlign = 16;  // elements: shards start on 64-byte boundaries

  struct Unit {
    std::string name;
    std::size_t begin = 0, end = 0;  // in the model's flat buffer
    std::size_t padded_offset = 0;   // in the padded buffer
    std::size_t padded = 0;          // end - begin rounded up to a multiple of W·kAlign
    std::size_t shard = 0;           // padded / W
    std::size_t shard_offset = 0;    // in a rank's shard buffer
    std::size_t tile = 0;            // > 0: used a range of at most this many elements at a time
    std::size_t size() const { return end - begin; }
  };
  // Consecutive units [first, last) whose gradients are reduced together,
  // ready when backward has finished unit `first`.
  struct Bucket {
    std::size_t first = 0, last = 0;
    std::size_t padded_offset = 0, padded = 0;  // the units' range of the padded buffer
  };
  // The part of parameter `param` that a rank holds: elements
  // [param_begin, param_begin + count) of the parameter (count may be 0),
  // at `shard_offset` in the rank's shard buffer and `padded_offset` in the
  // padded buffer.
  struct Piece {
    std::size_t param = 0;
    std::size_t param_begin = 0, count = 0;
    std::size_t shard_offset = 0, padded_offset = 0;
  };

  // `units` must cover [0, elements) in order (empty: one unit holding the
  // whole buffer); every parameter must lie inside one unit. A bucket closes
  // once it holds at least bucket_elements padded elements; a tiled unit is
  // a bucket of its own (its gradient is reduced a range at a time). Shards
  // are multiples of `align` elements (kAlign; quantized optimizer state
  // asks for its largest block, so that a parameter placed on a block
  // boundary of its unit is cut only on block boundaries).
  ShardLayout(const std::vector<ParamSlot>& params, std::size_t elements, std::vector<UnitRange> units, int world,
              std::size_t bucket_elements, std::size_t align = kAlign);

  int world() const { return world_; }
  const std::vector<ParamSlot>& params() const { return params_; }
  const std::vector<Unit>& units() const { return units_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Elements of the model's flat buffer, of the padded buffer, of one
  // rank's shard buffer (padded / W).
  std::size_t model_elements() const { return model_elements_; }
  std::size_t padded_elements() const { return padded_elements_; }
  std::size_t shard_elements() const { return padded_elements_ / static_cast<std::size_t>(world_); }
  // Parameter elements (no padding).
  std::size_t param_elements() const { return param_elements_; }
  // Where parameter p starts in the padded buffer; the unit holding it.
  std::size_t padded_offset(std::size_t param) const { return padded_offset_[param]; }
  std::size_t unit_of(std::size_t param) const { return unit_of_[param]; }
  // One piece per parameter, in parameter order (= shard order).
  std::vector<Piece> pieces(int rank) const;
  // A range [begin, end) of unit u (unit-local elements) as the ranks hold
  // it: each rank's part -- its shard's intersection with the range; in
  // rank order the parts are the range, the counts of a range's
  // all_gather_v and reduce_scatter_v -- and where `rank`'s part starts in
  // its shard buffer.
  struct Range {
    std::vector<std::size_t> counts;
    std::size_t shard_at = 0;
  };
  Range range(std::size_t u, int rank, std::size_t begin, std::size_t end) const;
  // The bucket that closes with unit u, or -1; the bucket holding unit u.
  long bucket_ending_at(std::size_t u) const;
  std::size_t bucket_of(std::size_t u) const { return bucket_of_.at(u); }

 private:
  std::vector<ParamSlot> params_;
  std::vector<Unit> units_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> padded_offset_, unit_of_;
  std::vector<long> bucket_of_first_;
  std::vector<std::size_t> bucket_of_;
  std::size_t model_elements_ = 0, padded_elements_ = 0, param_elements_ = 0;
  int world_ = 1;
};

}  // namespace distopt::parallel
