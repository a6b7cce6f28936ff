// Distributed batch sampling. Every epoch is a permutation of the training
// set determined by (seed, epoch) alone; global batch k is the k-th run of
// `batch` indices of it, and rank r of an n-rank world takes the r-th
// contiguous piece of that batch (the first batch % n ranks get one more).
// So the global batches, and the samples each step sees, do not depend on
// the world size; the ranks' pieces are disjoint and cover the batch.
//
// The last, partial batch (size % batch samples) is kept by default, as in
// torch's DataLoader (drop_last=False); with drop_last it is skipped. A
// partial batch is split over the ranks like any other; a rank whose piece is
// empty contributes nothing to that step's gradient.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace distopt::data {

class BatchSampler {
 public:
  BatchSampler(std::size_t dataset_size, std::size_t batch, std::uint64_t seed, bool drop_last = false,
               bool shuffle = true);

  std::size_t batches_per_epoch() const;
  // Prepares the permutation of `epoch` (0-based).
  void set_epoch(std::uint64_t epoch);
  std::span<const std::uint32_t> global_batch(std::size_t k) const;
  std::span<const std::uint32_t> local_batch(std::size_t k, int rank, int world) const;

 private:
  std::size_t size_, batch_;
  std::uint64_t seed_;
  bool drop_last_, shuffle_;
  std::vector<std::uint32_t> order_;
};

}  // namespace distopt::data
