// The code books and block quantizer of quantized optimizer state
// (include/distopt/optim/quant.hpp).
#include "distopt/optim/quant.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "distopt/core/error.hpp"

namespace distopt::quant {
namespace {

// torch.linspace(start, end, steps) in float32, bit for bit as torch 1.13
// computes it on an x86-64 CPU (its AVX2 kernel, RangeFactoriesKernel.cpp):
// element i is start + step*i in the first half, end - step*(steps-1-i) in
// the second, with step = (end - start) / (steps - 1); the loop takes 16
// elements at a time as two vectors of 8 whose lanes are base + k*step
// (base as for one element), and the rest one by one; one element's
// multiply-add is fused (the compiler contracted it), a lane's is not. This file is compiled without
// contraction (src/CMakeLists.txt) so that each operation rounds as written.
std::vector<float> linspace(float start, float end, int steps) {
  std::vector<float> out;
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int halfway = steps / 2;
  auto fused = [&](int idx) {
    return idx < halfway ? std::fma(step, static_cast<float>(idx), start)
                         : std::fma(-step, static_cast<float>(steps - idx - 1), end);
  };
  constexpr int kLanes = 8;
  int idx = 0;
  for (; idx + 2 * kLanes <= steps; idx += 2 * kLanes)
    for (int v = 0; v < 2; ++v) {
      const float base = fused(idx + v * kLanes);
      for (int k = 0; k < kLanes; ++k) out.push_back(base + static_cast<float>(k) * step);
    }
  for (; idx < steps; ++idx) out.push_back(fused(idx));
  return out;
}

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits, total_bits)
// in float32 arithmetic, sorted: for each exponent i the midpoints of
// linspace(0.1, 1, k) times 10^(i - max_exponent_bits + 1), and 0 and 1.
std::vector<float> dynamic_map(bool is_signed, int exponent_bits, int total_bits) {
  std::vector<float> data;
  const int non_sign_bits = total_bits - 1;
  for (int i = 0; i < exponent_bits; ++i) {
    const int items =
        is_signed ? (1 << (i + non_sign_bits - exponent_bits)) + 1 : (1 << (i + non_sign_bits - exponent_bits + 1)) + 1;
    const std::vector<float> b = linspace(0.1f, 1.0f, items);
    const auto scale = static_cast<float>(std::pow(10.0, -(exponent_bits - 1) + i));
    for (std::size_t k = 0; k + 1 < b.size(); ++k) {
      const float mean = (b[k] + b[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  DISTOPT_CHECK(data.size() == (std::size_t{1} << total_bits), "code book of ", data.size(), " values");
  return data;
}

struct Books {
  std::vector<float> int8_signed = dynamic_map(true, 7, 8);
  std::vector<float> int8_unsigned = dynamic_map(false, 7, 8);
  std::vector<float> int4_signed = dynamic_map(true, 3, 4);
  std::vector<float> int4_unsigned = [] {
    std::vector<float> v = linspace(0.0f, 1.0f, 17);
    v.erase(v.begin());  // k/16, k = 1..16: no zero
    return v;
  }();
};

const Books& books() {
  static const Books b;
  return b;
}

// The nearest code of q (ties to the lower), never the code 0 for a
// positive q in a book whose code 0 is zero and which holds no negatives.
std::uint8_t nearest(std::span<const float> code, float q, bool floor_positive) {
  const std::size_t n = code.size();
  if (q < code[0]) return 0;
  if (q > code[n - 1]) return static_cast<std::uint8_t>(n - 1);
  std::size_t hi = static_cast<std::size_t>(std::upper_bound(code.begin(), code.end(), q) - code.begin());
  hi = std::clamp<std::size_t>(hi, 1, n - 1);
  const std::size_t lo = hi - 1;
  std::size_t pick = (q - code[lo]) <= (code[hi] - q) ? lo : hi;
  if (floor_positive && pick == 0 && q > 0.0f) pick = 1;
  return static_cast<std::uint8_t>(pick);
}

void put(StateDType d, std::uint8_t* codes, std::size_t i, std::uint8_t c) {
  if (d == StateDType::int8) {
    codes[i] = c;
  } else {
    std::uint8_t& byte = codes[i / 2];
    byte = (i % 2 == 0) ? static_cast<std::uint8_t>((byte & 0xF0) | c)
                        : static_cast<std::uint8_t>((byte & 0x0F) | (c << 4));
  }
}

std::uint8_t get(StateDType d, const std::uint8_t* codes, std::size_t i) {
  if (d == StateDType::int8) return codes[i];
  return (i % 2 == 0) ? codes[i / 2] & 0x0F : codes[i / 2] >> 4;
}

bool floors(StateDType d, bool is_signed) {
  return !is_signed && code_book(d, is_signed)[0] == 0.0f;
}

// The code of 0 in a book (signed: the exact zero; unsigned int4: none, the
// smallest code, read back as 0 with a zero scale).
std::uint8_t zero_code(std::span<const float> code) {
  const auto it = std::find(code.begin(), code.end(), 0.0f);
  return it == code.end() ? 0 : static_cast<std::uint8_t>(it - code.begin());
}

}  // namespace

std::string_view name_of(StateDType d) {
  switch (d) {
    case StateDType::f32:
      return "f32";
    case StateDType::int8:
      return "int8";
    case StateDType::int4:
      return "int4";
  }
  return "?";
}

std::optional<StateDType> parse_state_dtype(std::string_view name) {
  for (StateDType d : {StateDType::f32, StateDType::int8, StateDType::int4})
    if (name == name_of(d)) return d;
  return std::nullopt;
}

std::string_view state_dtype_names() {
  return "f32, int8, int4";
}

std::size_t block_of(StateDType d) {
  return d == StateDType::int4 ? 128 : d == StateDType::int8 ? 256 : 1;
}

std::size_t code_bytes(StateDType d, std::size_t n) {
  return d == StateDType::int4 ? (n + 1) / 2 : n;
}

std::size_t num_blocks(StateDType d, std::size_t n) {
  return (n + block_of(d) - 1) / block_of(d);
}

std::span<const float> code_book(StateDType d, bool is_signed) {
  const Books& b = books();
  DISTOPT_CHECK(d != StateDType::f32, "f32 state has no code book");
  if (d == StateDType::int8) return is_signed ? b.int8_signed : b.int8_unsigned;
  return is_signed ? b.int4_signed : b.int4_unsigned;
}

void fill_zero(StateDType d, bool is_signed, std::uint8_t* codes, float* absmax, std::size_t n) {
  const std::uint8_t z = zero_code(code_book(d, is_signed));
  for (std::size_t i = 0; i < n; ++i) put(d, codes, i, z);
  std::fill_n(absmax, num_blocks(d, n), 0.0f);
}

void quantize_block(StateDType d, bool is_signed, const float* x, std::size_t n, std::uint8_t* codes, float* absmax) {
  const std::span<const float> code = code_book(d, is_signed);
  float a = 0.0f;
  bool nan = false;
  for (std::size_t i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    nan |= ax != ax;
    a = std::max(a, ax);
  }
  if (nan) a = std::numeric_limits<float>::quiet_NaN();
  if (!std::isfinite(a) || a == 0.0f) {
    const std::uint8_t z = zero_code(code);
    for (std::size_t i = 0; i < n; ++i) put(d, codes, i, z);
    *absmax = a == 0.0f ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *absmax = a;
  const bool floor_positive = floors(d, is_signed);
  for (std::size_t i = 0; i < n; ++i) put(d, codes, i, nearest(code, x[i] / a, floor_positive));
}

void dequantize_block(StateDType d, bool is_signed, const std::uint8_t* codes, float absmax, std::size_t n,
                      float* out) {
  const std::span<const float> code = code_book(d, is_signed);
  for (std::size_t i = 0; i < n; ++i) out[i] = code[get(d, codes, i)] * absmax;
}

bool requantize_block(StateDType d, bool is_signed, const float* x, std::size_t n, float absmax, std::uint8_t* codes) {
  const std::span<const float> code = code_book(d, is_signed);
  const bool floor_positive = floors(d, is_signed);
  auto same = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  for (std::size_t i = 0; i < n; ++i) {
    std::uint8_t c = zero_code(code);
    if (absmax != 0.0f && std::isfinite(absmax)) c = nearest(code, x[i] / absmax, floor_positive);
    if (!same(code[c] * absmax, x[i])) {  // a scale so small that x / absmax misses: any exact code
      const auto it = std::find_if(code.begin(), code.end(), [&](float v) { return same(v * absmax, x[i]); });
      if (it == code.end()) return false;
      c = static_cast<std::uint8_t>(it - code.begin());
    }
    put(d, codes, i, c);
  }
  return true;
}

void quantize(StateDType d, bool is_signed, const float* x, std::size_t n, std::uint8_t* codes, float* absmax) {
  const std::size_t block = block_of(d);
  for (std::size_t b = 0; b < n; b += block)
    quantize_block(d, is_signed, x + b, std::min(block, n - b), codes + code_bytes(d, b), absmax + b / block);
}

void dequantize(StateDType d, bool is_signed, const std::uint8_t* codes, const float* absmax, std::size_t n,
                float* out) {
  const std::size_t block = block_of(d);
  for (std::size_t b = 0; b < n; b += block)
    dequantize_block(d, is_signed, codes + code_bytes(d, b), absmax[b / block], std::min(block, n - b), out + b);
}

long requantize(StateDType d, bool is_signed, const float* x, std::size_t n, const float* absmax,
                std::uint8_t* codes) {
  const std::size_t block = block_of(d);
  for (std::size_t b = 0; b < n; b += block)
    if (!requantize_block(d, is_signed, x + b, std::min(block, n - b), absmax[b / block], codes + code_bytes(d, b)))
      return static_cast<long>(b / block);
  return -1;
}

}  // namespace distopt::quant
