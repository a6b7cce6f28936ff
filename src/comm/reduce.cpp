// The one reduction kernel of the communication layer (see types.hpp).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "distopt/comm/types.hpp"
#include "distopt/core/copy.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace distopt {

std::string_view name_of(ElemType t) {
  switch (t) {
    case ElemType::f32: return "f32";
    case ElemType::f64: return "f64";
    case ElemType::bf16: return "bf16";
    case ElemType::f16: return "f16";
    case ElemType::i32: return "i32";
    case ElemType::i64: return "i64";
    case ElemType::u8: return "u8";
  }
  return "?";
}

std::string_view name_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

std::vector<std::size_t> offsets_of(std::span<const std::size_t> counts) {
  std::vector<std::size_t> offsets(counts.size() + 1, 0);
  for (std::size_t r = 0; r < counts.size(); ++r) offsets[r + 1] = offsets[r] + counts[r];
  return offsets;
}

bool parse_elem_type(std::string_view s, ElemType* out) {
  for (ElemType t : {ElemType::f32, ElemType::f64, ElemType::bf16, ElemType::f16, ElemType::i32, ElemType::i64,
                     ElemType::u8})
    if (name_of(t) == s) {
      *out = t;
      return true;
    }
  return false;
}

namespace {

constexpr std::size_t kBlock = 2048;

// Storage type T, accumulation type A.
template <class T>
struct Acc {
  using type = T;
  static type load(T v) { return v; }
  static T store(type v) { return v; }
};
template <>
struct Acc<bf16> {
  using type = float;
  static float load(bf16 v) { return to_float(v); }
  static bf16 store(float v) { return from_float<bf16>(v); }
};
template <>
struct Acc<f16> {
  using type = float;
  static float load(f16 v) { return to_float(v); }
  static f16 store(float v) { return from_float<f16>(v); }
};

template <ReduceOp kOp, class A>
inline A combine(A acc, A v) {
  if constexpr (kOp == ReduceOp::sum || kOp == ReduceOp::avg) return static_cast<A>(acc + v);
  else if constexpr (kOp == ReduceOp::max) return v > acc ? v : acc;
  else return v < acc ? v : acc;
}

// One block of m elements: staged[i] = op over the N inputs, in rank order.
// N is a compile-time constant for small worlds, so the rank loop unrolls and
// the element loop vectorizes; kN = 0 is the general loop.
template <class T, ReduceOp kOp, int kN>
void reduce_block(const T* const* x, int n, T* __restrict staged, std::size_t m) {
  using A = typename Acc<T>::type;
  if constexpr (kN > 0) {
    const T* xs[kN];
    for (int r = 0; r < kN; ++r) xs[r] = x[r];
    for (std::size_t i = 0; i < m; ++i) {
      A acc = Acc<T>::load(xs[0][i]);
      for (int r = 1; r < kN; ++r) acc = combine<kOp>(acc, Acc<T>::load(xs[r][i]));
      if constexpr (kOp == ReduceOp::avg) acc = acc / static_cast<A>(kN);
      staged[i] = Acc<T>::store(acc);
    }
  } else {
    A acc[kBlock];
    for (std::size_t i = 0; i < m; ++i) acc[i] = Acc<T>::load(x[0][i]);
    for (int r = 1; r < n; ++r)
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<kOp>(acc[i], Acc<T>::load(x[r][i]));
    for (std::size_t i = 0; i < m; ++i) {
      if constexpr (kOp == ReduceOp::avg) acc[i] = acc[i] / static_cast<A>(n);
      staged[i] = Acc<T>::store(acc[i]);
    }
  }
}

#if defined(__AVX__)
// f32 sum/avg of a large output, the gradient all-reduce's case: the same
// additions in the same order as reduce_block (vaddps rounds each lane as
// a scalar add does), written straight from the vector loop. A fresh output
// leaves through non-temporal stores; an output that is one of the inputs
// (in-place reduce_scatter) was just read into the cache, where plain
// stores cost no extra read and a non-temporal store would first evict the
// line (measured, 2 ranks, 128-256 MiB in place: 0.53 -> 0.65 of the copy
// bandwidth; docs/performance.md).
template <ReduceOp kOp, int kN, bool kStream>
void reduce_f32_wide(const float* const* xs, float* out, std::size_t count) {
  auto scalar = [&](std::size_t j) {
    float acc = xs[0][j];
    for (int r = 1; r < kN; ++r) acc = acc + xs[r][j];
    if constexpr (kOp == ReduceOp::avg) acc = acc / static_cast<float>(kN);
    out[j] = acc;
  };
  std::size_t i = 0;
  for (; i < count && reinterpret_cast<std::uintptr_t>(out + i) % 32 != 0; ++i) scalar(i);
  const __m256 div = _mm256_set1_ps(static_cast<float>(kN));
  for (; i + 8 <= count; i += 8) {
    __m256 acc = _mm256_loadu_ps(xs[0] + i);
    for (int r = 1; r < kN; ++r) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xs[r] + i));
    if constexpr (kOp == ReduceOp::avg) acc = _mm256_div_ps(acc, div);
    if constexpr (kStream) _mm256_stream_ps(out + i, acc);
    else _mm256_store_ps(out + i, acc);
  }
  for (; i < count; ++i) scalar(i);
  if constexpr (kStream) stream_fence();
}

template <ReduceOp kOp, int kN>
void reduce_f32_stream(const float* const* x, float* out, std::size_t count, bool in_place) {
  const float* xs[kN];
  for (int r = 0; r < kN; ++r) xs[r] = x[r];
  if (in_place) reduce_f32_wide<kOp, kN, false>(xs, out, count);
  else reduce_f32_wide<kOp, kN, true>(xs, out, count);
}
#endif

template <class T, ReduceOp kOp, int kN>
void reduce_typed(const void* const* inputs, int n, void* out_raw, std::size_t count) {
  T* out = static_cast<T*>(out_raw);
  bool in_place = false;
  for (int r = 0; r < n; ++r) in_place |= inputs[r] == out_raw;
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float> && kN > 0 && (kOp == ReduceOp::sum || kOp == ReduceOp::avg)) {
    if (count * sizeof(T) >= kStreamBytes)
      return reduce_f32_stream<kOp, kN>(reinterpret_cast<const float* const*>(inputs), out, count, in_place);
  }
#endif
  // Results are staged in a small block (out may alias an input) and leave
  // through non-temporal stores when the output is large and not an input
  // (core/copy.hpp; an input's lines are in the cache already).
  const bool stream = count * sizeof(T) >= kStreamBytes && !in_place;
  alignas(64) T staged[kBlock];
  std::vector<const T*> x(n);
  for (std::size_t b = 0; b < count; b += kBlock) {
    const std::size_t m = std::min(kBlock, count - b);
    for (int r = 0; r < n; ++r) x[r] = static_cast<const T*>(inputs[r]) + b;
    reduce_block<T, kOp, kN>(x.data(), n, staged, m);
    if (stream) stream_bytes(out + b, staged, m * sizeof(T), /*fence=*/false);
    else std::memcpy(out + b, staged, m * sizeof(T));
  }
  if (stream) stream_fence();
}

template <class T, ReduceOp kOp>
void reduce_n(const void* const* inputs, int n, void* out, std::size_t count) {
  switch (n) {
    case 1: return reduce_typed<T, kOp, 1>(inputs, n, out, count);
    case 2: return reduce_typed<T, kOp, 2>(inputs, n, out, count);
    case 3: return reduce_typed<T, kOp, 3>(inputs, n, out, count);
    case 4: return reduce_typed<T, kOp, 4>(inputs, n, out, count);
    case 5: return reduce_typed<T, kOp, 5>(inputs, n, out, count);
    case 6: return reduce_typed<T, kOp, 6>(inputs, n, out, count);
    case 7: return reduce_typed<T, kOp, 7>(inputs, n, out, count);
    case 8: return reduce_typed<T, kOp, 8>(inputs, n, out, count);
    default: return reduce_typed<T, kOp, 0>(inputs, n, out, count);
  }
}

template <class T>
void reduce_op(const void* const* inputs, int n, void* out, std::size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return reduce_n<T, ReduceOp::sum>(inputs, n, out, count);
    case ReduceOp::avg: return reduce_n<T, ReduceOp::avg>(inputs, n, out, count);
    case ReduceOp::max: return reduce_n<T, ReduceOp::max>(inputs, n, out, count);
    case ReduceOp::min: return reduce_n<T, ReduceOp::min>(inputs, n, out, count);
  }
}

}  // namespace

void reduce_ordered(const void* const* inputs, int n, void* out, std::size_t count, ElemType type, ReduceOp op) {
  DISTOPT_CHECK(n >= 1, "n=", n);
  if (op == ReduceOp::avg && !is_floating(type))
    throw InvalidInput(str("reduce op avg needs a floating-point type, got ", name_of(type)));
  if (count == 0) return;
  switch (type) {
    case ElemType::f32: return reduce_op<float>(inputs, n, out, count, op);
    case ElemType::f64: return reduce_op<double>(inputs, n, out, count, op);
    case ElemType::bf16: return reduce_op<bf16>(inputs, n, out, count, op);
    case ElemType::f16: return reduce_op<f16>(inputs, n, out, count, op);
    case ElemType::i32: return reduce_op<std::int32_t>(inputs, n, out, count, op);
    case ElemType::i64: return reduce_op<std::int64_t>(inputs, n, out, count, op);
    case ElemType::u8: return reduce_op<std::uint8_t>(inputs, n, out, count, op);
  }
}

}  // namespace distopt
