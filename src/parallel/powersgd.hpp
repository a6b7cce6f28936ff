// PowerSGD (Vogels, Karimireddy and Jaggi, 2019; torch's powerSGD_hook) for
// the engine's gradient buckets (not installed; --grad-compression
// powersgd, docs/sharding.md "PowerSGD").
//
// Each parameter of two or more dimensions is a matrix M (rows = its first
// dimension, cols = the rest) of each rank's gradient plus its residual.
// It is compressed when rank r = min(rows, cols, R) makes it worth it, as
// torch decides: rows * cols > 2 (rows + cols) r. Per bucket:
//   1. Q (cols x r, kept from the last step: warm start) is orthogonalized
//      and P = M Q; the bucket's P's and its uncompressed gradients are
//      summed over the ranks in one all-reduce;
//   2. P is orthogonalized (the same on every rank: the sum is), Q = M^T P,
//      and the Q's are summed in a second all-reduce;
//   3. the gradient is P Q^T (an approximation of the ranks' sum) and each
//      rank keeps M - P Q^T / n for its next step (error feedback), so the
//      ranks' residuals add up to what the approximation missed.
// Every product runs in a fixed order on every rank, so every strategy and
// backend gives the same bits. Q starts from a normal draw of a fixed seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "distopt/parallel/layout.hpp"

namespace distopt::parallel::detail {

class PowerSgd {
 public:
  // A parameter of a bucket: compressed (rank > 0) or sent whole.
  struct Matrix {
    std::size_t param, rows, cols, rank;
    std::size_t q_at;  // where its Q is in qs() (compressed)
  };
  struct Bucket {
    std::vector<Matrix> matrices;
    std::size_t p_elements = 0, q_elements = 0, whole_elements = 0;
  };

  PowerSgd(const ShardLayout& layout, int rank);
  const Bucket& bucket(std::size_t b) const { return buckets_[b]; }
  // Every compressed parameter's Q, in bucket order.
  std::span<float> qs() { return qs_; }

 private:
  std::vector<Bucket> buckets_;
  std::vector<float> qs_;
};

// Gram-Schmidt on the r columns of a rows x r row-major matrix, in place; a
// column of norm 0 stays 0.
void orthogonalize(float* a, std::size_t rows, std::size_t r);
// out (rows x r) = m (rows x cols) q (cols x r).
void times(const float* m, const float* q, float* out, std::size_t rows, std::size_t cols, std::size_t r);
// out (cols x r) = m^T (cols x rows) p (rows x r).
void transposed_times(const float* m, const float* p, float* out, std::size_t rows, std::size_t cols, std::size_t r);
// out (rows x cols) = p (rows x r) q^T (r x cols).
void outer(const float* p, const float* q, float* out, std::size_t rows, std::size_t cols, std::size_t r);

}  // namespace distopt::parallel::detail
