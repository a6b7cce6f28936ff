// PowerSGD's plan and products: see powersgd.hpp.
#include "powersgd.hpp"

#include <algorithm>
#include <cmath>

#include "distopt/core/random.hpp"

namespace distopt::parallel::detail {

namespace {
constexpr std::uint64_t kSeed = 0x5057534744ull;  // Q's first draw, the same on every rank
}  // namespace

PowerSgd::PowerSgd(const ShardLayout& layout, int rank) {
  const auto r_max = static_cast<std::size_t>(rank);
  const auto& params = layout.params();
  buckets_.resize(layout.buckets().size());
  std::size_t q_elements = 0;
  for (std::size_t p = 0; p < params.size(); ++p) {
    Bucket& b = buckets_[layout.bucket_of(layout.unit_of(p))];
    const std::size_t n = params[p].numel();
    Matrix m{p, n, 1, 0, 0};
    if (params[p].shape.size() >= 2 && n > 0) {
      m.rows = static_cast<std::size_t>(params[p].shape[0]);
      m.cols = n / m.rows;
      const std::size_t r = std::min({m.rows, m.cols, r_max});
      if (m.rows * m.cols > 2 * (m.rows + m.cols) * r) m.rank = r;
    }
    if (m.rank > 0) {
      m.q_at = q_elements;
      q_elements += m.cols * m.rank;
      b.p_elements += m.rows * m.rank;
      b.q_elements += m.cols * m.rank;
    } else {
      b.whole_elements += n;
    }
    b.matrices.push_back(m);
  }
  qs_.resize(q_elements);
  Rng rng(kSeed);
  for (float& q : qs_) q = static_cast<float>(rng.normal());
}

void orthogonalize(float* a, std::size_t rows, std::size_t r) {
  for (std::size_t i = 0; i < r; ++i) {
    double norm = 0;
    for (std::size_t k = 0; k < rows; ++k) norm += double(a[k * r + i]) * double(a[k * r + i]);
    norm = std::sqrt(norm);
    if (norm > 0)
      for (std::size_t k = 0; k < rows; ++k) a[k * r + i] = static_cast<float>(double(a[k * r + i]) / norm);
    for (std::size_t j = i + 1; j < r; ++j) {
      double dot = 0;
      for (std::size_t k = 0; k < rows; ++k) dot += double(a[k * r + i]) * double(a[k * r + j]);
      const auto d = static_cast<float>(dot);
      for (std::size_t k = 0; k < rows; ++k) a[k * r + j] -= d * a[k * r + i];
    }
  }
}

void times(const float* m, const float* q, float* out, std::size_t rows, std::size_t cols, std::size_t r) {
  // Row i of the product: row i of m against Q's columns, in eight fixed
  // lanes then their sum in a fixed order (the same on every rank).
  constexpr std::size_t kLanes = 8;
  std::vector<float> qt(r * cols);  // Q's columns, each contiguous
  for (std::size_t j = 0; j < cols; ++j)
    for (std::size_t k = 0; k < r; ++k) qt[k * cols + j] = q[j * r + k];
  for (std::size_t i = 0; i < rows; ++i) {
    const float* row = m + i * cols;
    for (std::size_t k = 0; k < r; ++k) {
      const float* col = qt.data() + k * cols;
      float lane[kLanes] = {};
      std::size_t j = 0;
      for (; j + kLanes <= cols; j += kLanes)
        for (std::size_t l = 0; l < kLanes; ++l) lane[l] += row[j + l] * col[j + l];
      for (std::size_t l = 0; j < cols; ++j, ++l) lane[l] += row[j] * col[j];
      out[i * r + k] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
  }
}

void transposed_times(const float* m, const float* p, float* out, std::size_t rows, std::size_t cols, std::size_t r) {
  std::vector<float> column(cols);  // out's column k, accumulated over the rows in order
  for (std::size_t k = 0; k < r; ++k) {
    std::fill(column.begin(), column.end(), 0.0f);
    for (std::size_t i = 0; i < rows; ++i) {
      const float pk = p[i * r + k];
      const float* row = m + i * cols;
      for (std::size_t j = 0; j < cols; ++j) column[j] += row[j] * pk;
    }
    for (std::size_t j = 0; j < cols; ++j) out[j * r + k] = column[j];
  }
}

void outer(const float* p, const float* q, float* out, std::size_t rows, std::size_t cols, std::size_t r) {
  std::vector<float> qt(r * cols);  // Q's columns, each contiguous
  for (std::size_t j = 0; j < cols; ++j)
    for (std::size_t k = 0; k < r; ++k) qt[k * cols + j] = q[j * r + k];
  for (std::size_t i = 0; i < rows; ++i) {
    float* row = out + i * cols;
    std::fill(row, row + cols, 0.0f);
    for (std::size_t k = 0; k < r; ++k) {
      const float pk = p[i * r + k];
      const float* col = qt.data() + k * cols;
      for (std::size_t j = 0; j < cols; ++j) row[j] += pk * col[j];
    }
  }
}

}  // namespace distopt::parallel::detail
