#include "distopt/data/sampler.hpp"

#include <numeric>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"

namespace distopt::data {

BatchSampler::BatchSampler(std::size_t dataset_size, std::size_t batch, std::uint64_t seed, bool drop_last,
                           bool shuffle)
    : size_(dataset_size), batch_(batch), seed_(seed), drop_last_(drop_last), shuffle_(shuffle) {
  if (batch == 0) throw InvalidInput("batch size must be at least 1");
  if (dataset_size > UINT32_MAX) throw InvalidInput("datasets beyond 2^32 samples are not supported");
  set_epoch(0);
}

std::size_t BatchSampler::batches_per_epoch() const {
  return drop_last_ ? size_ / batch_ : (size_ + batch_ - 1) / batch_;
}

void BatchSampler::set_epoch(std::uint64_t epoch) {
  order_.resize(size_);
  std::iota(order_.begin(), order_.end(), 0u);
  if (!shuffle_) return;
  Rng rng(seed_, 0x5eed0000ull + epoch);
  for (std::size_t i = size_; i > 1; --i) std::swap(order_[i - 1], order_[rng.below(i)]);  // Fisher-Yates
}

std::span<const std::uint32_t> BatchSampler::global_batch(std::size_t k) const {
  DISTOPT_CHECK(k < batches_per_epoch(), "batch ", k, " of ", batches_per_epoch());
  const std::size_t begin = k * batch_, end = std::min(size_, begin + batch_);
  return {order_.data() + begin, end - begin};
}

std::span<const std::uint32_t> BatchSampler::local_batch(std::size_t k, int rank, int world) const {
  DISTOPT_CHECK(world > 0 && rank >= 0 && rank < world, "rank ", rank, " of ", world);
  const auto all = global_batch(k);
  const std::size_t n = static_cast<std::size_t>(world), r = static_cast<std::size_t>(rank);
  const std::size_t base = all.size() / n, extra = all.size() % n;
  const std::size_t begin = r * base + std::min(r, extra), count = base + (r < extra ? 1 : 0);
  return all.subspan(begin, count);
}

}  // namespace distopt::data
