// Test data for collectives whose exact results are known in closed form:
// element i on rank r is (r+1)*(i%7+1), small integers that every element
// type holds exactly (even u8: the sum over 8 ranks is at most 252).
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "distopt/comm/types.hpp"

namespace distopt::testing {

inline double get(ElemType t, const void* p, std::size_t i) {
  switch (t) {
    case ElemType::f32: return static_cast<const float*>(p)[i];
    case ElemType::f64: return static_cast<const double*>(p)[i];
    case ElemType::bf16: return to_float(static_cast<const bf16*>(p)[i]);
    case ElemType::f16: return to_float(static_cast<const f16*>(p)[i]);
    case ElemType::i32: return static_cast<const std::int32_t*>(p)[i];
    case ElemType::i64: return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case ElemType::u8: return static_cast<const std::uint8_t*>(p)[i];
  }
  return 0;
}

inline void set(ElemType t, void* p, std::size_t i, double v) {
  switch (t) {
    case ElemType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case ElemType::f64: static_cast<double*>(p)[i] = v; break;
    case ElemType::bf16: static_cast<bf16*>(p)[i] = from_float<bf16>(static_cast<float>(v)); break;
    case ElemType::f16: static_cast<f16*>(p)[i] = from_float<f16>(static_cast<float>(v)); break;
    case ElemType::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case ElemType::i64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
    case ElemType::u8: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); break;
  }
}

inline double value(int rank, std::size_t i) { return (rank + 1) * static_cast<double>(i % 7 + 1); }

// The closed-form result of reducing value(r, i) over ranks 0..n-1.
inline double expected(ReduceOp op, int n, std::size_t i) {
  const double k = static_cast<double>(i % 7 + 1);
  switch (op) {
    case ReduceOp::sum: return k * n * (n + 1) / 2;
    case ReduceOp::avg: return k * (n + 1) / 2.0;
    case ReduceOp::max: return k * n;
    case ReduceOp::min: return k;
  }
  return 0;
}

inline std::vector<unsigned char> filled(ElemType t, std::size_t count, int rank, std::size_t first = 0) {
  std::vector<unsigned char> b(count * size_of(t) + 1);
  for (std::size_t i = 0; i < count; ++i) set(t, b.data(), i, value(rank, first + i));
  return b;
}

// Floats whose sums round: the order of additions shows in the bits.
inline std::vector<float> noisy(std::size_t count, int rank) {
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = d(rng) * (1 + rank * 1000.0f);
  return v;
}

inline const std::vector<ElemType>& all_types() {
  static const std::vector<ElemType> t = {ElemType::f32, ElemType::f64, ElemType::bf16, ElemType::f16,
                                          ElemType::i32, ElemType::i64, ElemType::u8};
  return t;
}

}  // namespace distopt::testing
