#include "distopt/parallel/layout.hpp"

#include <algorithm>

#include "distopt/core/error.hpp"

namespace distopt::parallel {

ShardLayout::ShardLayout(const std::vector<ParamSlot>& params, std::size_t elements, std::vector<UnitRange> units,
                         int world, std::size_t bucket_elements, std::size_t align)
    : params_(params), model_elements_(elements), world_(world) {
  DISTOPT_CHECK(world >= 1, "world ", world);
  DISTOPT_CHECK(align >= kAlign && align % kAlign == 0, "alignment ", align);
  if (bucket_elements == 0) throw InvalidInput("the bucket size must be at least 1 element");
  if (units.empty()) units.push_back({"all", 0, elements});
  const std::size_t w = static_cast<std::size_t>(world);
  const std::size_t quantum = w * align;
  std::size_t expect = 0, padded = 0, shard = 0;
  for (const UnitRange& u : units) {
    DISTOPT_CHECK(u.begin == expect && u.end >= u.begin, "unit '", u.name, "' [", u.begin, ", ", u.end,
                  ") does not follow the previous one (ending at ", expect, ")");
    expect = u.end;
    Unit out{u.name, u.begin, u.end, padded, 0, 0, shard, u.tile};
    out.padded = std::max<std::size_t>(quantum, (u.end - u.begin + quantum - 1) / quantum * quantum);
    out.shard = out.padded / w;
    padded += out.padded;
    shard += out.shard;
    units_.push_back(std::move(out));
  }
  DISTOPT_CHECK(expect == elements, "units end at ", expect, ", the buffer has ", elements, " elements");
  padded_elements_ = padded;
  for (std::size_t p = 0; p < params_.size(); ++p) {
    const ParamSlot& s = params_[p];
    auto it = std::find_if(units_.begin(), units_.end(),
                           [&](const Unit& u) { return s.offset >= u.begin && s.offset + s.numel() <= u.end; });
    DISTOPT_CHECK(it != units_.end(), "parameter '", s.name, "' does not lie inside one unit");
    unit_of_.push_back(static_cast<std::size_t>(it - units_.begin()));
    padded_offset_.push_back(it->padded_offset + (s.offset - it->begin));
    param_elements_ += s.numel();
  }
  // Buckets in backward order: from the last unit down.
  bucket_of_first_.assign(units_.size(), -1);
  std::size_t last = units_.size();
  while (last > 0) {
    std::size_t first = last - 1, size = units_[first].padded;
    if (units_[first].tile == 0)
      while (first > 0 && size < bucket_elements && units_[first - 1].tile == 0) size += units_[--first].padded;
    bucket_of_first_[first] = static_cast<long>(buckets_.size());
    bucket_of_.resize(units_.size());
    for (std::size_t u = first; u < last; ++u) bucket_of_[u] = buckets_.size();
    buckets_.push_back({first, last, units_[first].padded_offset, size});
    last = first;
  }
}

std::vector<ShardLayout::Piece> ShardLayout::pieces(int rank) const {
  DISTOPT_CHECK(rank >= 0 && rank < world_, "rank ", rank, " of ", world_);
  std::vector<Piece> out;
  for (std::size_t p = 0; p < params_.size(); ++p) {
    const Unit& u = units_[unit_of_[p]];
    // The rank's shard of the unit, in unit-local elements.
    const std::size_t lo = u.shard * static_cast<std::size_t>(rank), hi = lo + u.shard;
    const std::size_t begin = params_[p].offset - u.begin, end = begin + params_[p].numel();
    const std::size_t a = std::clamp(begin, lo, hi), b = std::clamp(end, lo, hi);
    if (a == b) {  // the parameter lies outside the rank's shard: an empty piece
      out.push_back({p, 0, 0, u.shard_offset, u.padded_offset + lo});
      continue;
    }
    out.push_back({p, a - begin, b - a, u.shard_offset + (a - lo), u.padded_offset + a});
  }
  return out;
}

ShardLayout::Range ShardLayout::range(std::size_t u, int rank, std::size_t begin, std::size_t end) const {
  const Unit& unit = units_.at(u);
  DISTOPT_CHECK(begin <= end && end <= unit.padded, "range [", begin, ", ", end, ") of unit ", unit.name);
  DISTOPT_CHECK(rank >= 0 && rank < world_, "rank ", rank, " of ", world_);
  Range out;
  for (std::size_t r = 0; r < static_cast<std::size_t>(world_); ++r) {
    const std::size_t lo = r * unit.shard, hi = lo + unit.shard;
    out.counts.push_back(std::clamp(end, lo, hi) - std::clamp(begin, lo, hi));
    if (r == static_cast<std::size_t>(rank)) out.shard_at = unit.shard_offset + (std::clamp(begin, lo, hi) - lo);
  }
  return out;
}

long ShardLayout::bucket_ending_at(std::size_t u) const { return bucket_of_first_.at(u); }

}  // namespace distopt::parallel
