// Element types: f32, bf16 and f16, with round-to-nearest-even conversions.
//
// bf16 keeps float's exponent and the top 7 mantissa bits; f16 is IEEE
// binary16. Conversions to the narrow types round to nearest, ties to even,
// overflow to infinity, keep the sign of zero and turn any NaN into a quiet
// NaN of the same sign. Widening is exact. Everything here is branch-light,
// header-only and constexpr-free so that kernels can inline it, on the CPU
// and (DISTOPT_HD) in CUDA kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "distopt/core/hd.hpp"

namespace distopt {

enum class DType : std::uint8_t { f32, bf16, f16 };

struct bf16 {
  std::uint16_t bits;
};
struct f16 {
  std::uint16_t bits;
};

constexpr std::size_t size_of(DType t) { return t == DType::f32 ? 4 : 2; }

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}

// Parses "f32" / "float32", "bf16" / "bfloat16", "f16" / "float16" / "half".
bool parse_dtype(std::string_view s, DType* out);

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
  else {
    static_assert(std::is_same_v<T, f16>, "unsupported element type");
    return DType::f16;
  }
}

DISTOPT_HD std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t x = hd::bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

DISTOPT_HD float bf16_bits_to_float(std::uint16_t b) {
  return hd::float_of(static_cast<std::uint32_t>(b) << 16);
}

DISTOPT_HD std::uint16_t float_to_f16_bits(float f) {
  const std::uint32_t x = hd::bits_of(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf or NaN (NaN stays quiet, keeps the top payload bits)
    return static_cast<std::uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u | ((ax >> 13) & 0x3ffu) : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax < 0x38800000u) {  // below 2^-14: f16 subnormal or zero
    // Adding 0.5 puts the value in a binade whose ulp is 2^-24 (the f16
    // subnormal step), so the FPU's own round-to-nearest-even does the work.
    const float v = hd::float_of(ax) + 0.5f;
    return static_cast<std::uint16_t>(sign | (hd::bits_of(v) - 0x3f000000u));
  }
  const std::uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd;  // re-bias the exponent (-112 << 23) and round to nearest even
  return static_cast<std::uint16_t>(sign | (ax >> 13));
}

DISTOPT_HD float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return hd::float_of(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return hd::float_of(sign | ((em << 13) + 0x38000000u));
  const float v = static_cast<float>(em) * 0x1p-24f;  // subnormal: exact
  return hd::float_of(sign | hd::bits_of(v));
}

DISTOPT_HD float to_float(float v) { return v; }
DISTOPT_HD float to_float(bf16 v) { return bf16_bits_to_float(v.bits); }
DISTOPT_HD float to_float(f16 v) { return f16_bits_to_float(v.bits); }

template <class T>
DISTOPT_HD T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, bf16>) return bf16{float_to_bf16_bits(v)};
  else return f16{float_to_f16_bits(v)};
}

// Calls fn.template operator()<T>() with T the element type of `t`.
template <class Fn>
decltype(auto) dispatch_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::bf16: return fn.template operator()<bf16>();
    case DType::f16: return fn.template operator()<f16>();
    case DType::f32: break;
  }
  return fn.template operator()<float>();
}

}  // namespace distopt
