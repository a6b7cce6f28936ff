// The one reduction kernel of the communication layer (see types.hpp).
#include <algorithm>
#include <cstring>

#include "distopt/comm/types.hpp"
#include "distopt/core/copy.hpp"

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

template <class T, ReduceOp kOp>
void reduce_typed(const void* const* inputs, int n, void* out_raw, std::size_t count) {
  using A = typename Acc<T>::type;
  T* out = static_cast<T*>(out_raw);
  // Blocks keep the running values in cache while each input streams by.
  // Large outputs leave through non-temporal stores (core/copy.hpp).
  constexpr std::size_t kBlock = 2048;
  A acc[kBlock];
  T staged[kBlock];
  const bool stream = count * sizeof(T) >= kStreamBytes;
  for (std::size_t b = 0; b < count; b += kBlock) {
    const std::size_t m = std::min(kBlock, count - b);
    const T* x0 = static_cast<const T*>(inputs[0]) + b;
    for (std::size_t i = 0; i < m; ++i) acc[i] = Acc<T>::load(x0[i]);
    for (int r = 1; r < n; ++r) {
      const T* x = static_cast<const T*>(inputs[r]) + b;
      for (std::size_t i = 0; i < m; ++i) {
        const A v = Acc<T>::load(x[i]);
        if constexpr (kOp == ReduceOp::sum || kOp == ReduceOp::avg) acc[i] = static_cast<A>(acc[i] + v);
        else if constexpr (kOp == ReduceOp::max) acc[i] = v > acc[i] ? v : acc[i];
        else acc[i] = v < acc[i] ? v : acc[i];
      }
    }
    if constexpr (kOp == ReduceOp::avg) {
      const A div = static_cast<A>(n);
      for (std::size_t i = 0; i < m; ++i) acc[i] = acc[i] / div;
    }
    if (stream) {
      for (std::size_t i = 0; i < m; ++i) staged[i] = Acc<T>::store(acc[i]);
      stream_bytes(out + b, staged, m * sizeof(T), /*fence=*/false);
    } else {
      for (std::size_t i = 0; i < m; ++i) out[b + i] = Acc<T>::store(acc[i]);
    }
  }
  if (stream) stream_fence();
}

template <class T>
void reduce_op(const void* const* inputs, int n, void* out, std::size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return reduce_typed<T, ReduceOp::sum>(inputs, n, out, count);
    case ReduceOp::avg: return reduce_typed<T, ReduceOp::avg>(inputs, n, out, count);
    case ReduceOp::max: return reduce_typed<T, ReduceOp::max>(inputs, n, out, count);
    case ReduceOp::min: return reduce_typed<T, ReduceOp::min>(inputs, n, out, count);
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
