// Matrix helpers of the whole_tensor rules that precondition with symmetric
// matrices (shampoo.cpp, adagrad_full.cpp): statistics kept in float, the
// algebra done in double.
#pragma once

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include <cstddef>

#include "../rule_impl.hpp"

namespace distopt::rules {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapF = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

// stored <- stored + add (+ diagonal on the diagonal), added in double and
// rounded once to the float storage (n x n, row-major).
inline void accumulate(float* stored, const MatD& add, double diagonal) {
  const Eigen::Index n = add.rows();
  MapF h(stored, n, n);
  MatD sum = h.cast<double>() + add;
  if (diagonal != 0.0) sum.diagonal().array() += diagonal;
  h = sum.cast<float>();
}

// Q f(L) Q^T for the symmetric matrix stored (n x n, float) = Q L Q^T, by
// symmetric eigendecomposition in double; the result rounded to out. f(v,
// resolution) sees each eigenvalue and the matrix's resolution: n * 2^-24
// times its largest eigenvalue, the size of the error its float storage
// may put into any eigenvalue (so one below it is zero as far as the
// stored matrix can tell).
template <class F>
void spectral_function(const float* stored, Eigen::Index n, F f, float* out) {
  const MatD h = MapF(const_cast<float*>(stored), n, n).cast<double>();
  const Eigen::SelfAdjointEigenSolver<MatD> eig(h);
  const double resolution = static_cast<double>(n) * 0x1p-24 * eig.eigenvalues().cwiseAbs().maxCoeff();
  const Eigen::VectorXd values = eig.eigenvalues().unaryExpr([&](double v) { return f(v, resolution); });
  const MatD& q = eig.eigenvectors();
  MapF(out, n, n) = (q * values.asDiagonal() * q.transpose()).cast<float>();
}

// The gradient plus weight_decay * p (L2, in float), into the scratch: the
// pointwise part of shampoo and adagrad_full.
template <class T>
void l2_gradient(float weight_decay, const Typed<T>& s, float* __restrict out) {
  for (std::size_t i = 0; i < s.n; ++i) out[i] = to_float(s.g[i]) + weight_decay * s.p[i];
}

}  // namespace distopt::rules
