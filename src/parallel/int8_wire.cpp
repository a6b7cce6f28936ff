// int8 gradient packets with error feedback: see int8_wire.hpp.
#include "int8_wire.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace distopt::parallel::detail {

namespace {
constexpr std::size_t blocks_of(std::size_t n) {
  return (n + kInt8Block - 1) / kInt8Block;
}

constexpr std::int8_t kNonFinite = -128;  // a code no finite value gets

// x rounded to the nearest integer, ties to even, for |x| < 2^22: adding
// 1.5 * 2^23 leaves no fraction bits, so the sum is rounded in the current
// (round-to-nearest-even) mode, and the subtraction is exact; x's sign
// goes back on (a zero comes out +0). The same value as std::nearbyint,
// sign of zero included, in a form the compiler vectorizes (this file is
// built without floating-point contraction, so the pair stays two
// operations).
inline float round_even(float x) {
  constexpr float magic = 12582912.0f;
  return std::copysign((x + magic) - magic, x);
}
}  // namespace

void int8_pack(const float* g, float* e, std::size_t n, char* out) {
  constexpr float kMax = std::numeric_limits<float>::max();
  const std::size_t blocks = blocks_of(n);
  auto* codes = reinterpret_cast<std::int8_t*>(out + blocks * sizeof(float));
  float v[kInt8Block], q[kInt8Block];
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t at = b * kInt8Block, m = std::min(kInt8Block, n - at);
    if (e != nullptr) {
      for (std::size_t i = 0; i < m; ++i) v[i] = g[at + i] + e[at + i];
    } else {
      std::copy_n(g + at, m, v);
    }
    // max |v| over the finite values, in eight lanes (max is exact, so the
    // lanes' order does not matter), and whether any value is not finite.
    float lane[8] = {}, bad[8] = {};
    auto see = [&](float x, std::size_t j) {
      const float a = std::fabs(x);
      const bool ok = a <= kMax;  // false for inf and NaN
      lane[j] = std::max(lane[j], ok ? a : 0.0f);
      bad[j] = ok ? bad[j] : 1.0f;
    };
    std::size_t i = 0;
    for (; i + 8 <= m; i += 8)
      for (std::size_t j = 0; j < 8; ++j) see(v[i + j], j);
    for (; i < m; ++i) see(v[i], 0);  // the tail, in lane 0
    const bool finite = std::max({bad[0], bad[1], bad[2], bad[3], bad[4], bad[5], bad[6], bad[7]}) == 0.0f;
    const float amax = std::max({lane[0], lane[1], lane[2], lane[3], lane[4], lane[5], lane[6], lane[7]});
    const float scale = amax / 127.0f;
    std::memcpy(out + b * sizeof(float), &scale, sizeof scale);
    std::int8_t* c = codes + at;
    if (scale > 0.0f) {
      // min then max, in this order, also takes a NaN quotient to a code
      // (127: its value is replaced by the mark below).
      for (std::size_t i = 0; i < m; ++i) q[i] = std::max(-127.0f, std::min(127.0f, round_even(v[i] / scale)));
      for (std::size_t i = 0; i < m; ++i) c[i] = static_cast<std::int8_t>(q[i]);
      if (e != nullptr)
        for (std::size_t i = 0; i < m; ++i) e[at + i] = v[i] - q[i] * scale;
    } else {  // all zero or too small to scale: nothing travels, everything stays
      std::fill_n(c, m, std::int8_t{0});
      if (e != nullptr) std::copy_n(v, m, e + at);
    }
    if (!finite)  // each non-finite value travels as a mark and leaves no residual
      for (std::size_t i = 0; i < m; ++i)
        if (!(std::fabs(v[i]) <= kMax)) {
          c[i] = kNonFinite;
          if (e != nullptr) e[at + i] = 0.0f;
        }
  }
  std::fill(codes + n, codes + (n + 3) / 4 * 4, std::int8_t{0});
}

void int8_unpack(const char* in, std::size_t n, float* acc, bool add) {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  const std::size_t blocks = blocks_of(n);
  const auto* codes = reinterpret_cast<const std::int8_t*>(in + blocks * sizeof(float));
  for (std::size_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof scale);
    const std::size_t at = b * kInt8Block, m = std::min(kInt8Block, n - at);
    float* to = acc + at;
    const std::int8_t* c = codes + at;
    if (add) {
      for (std::size_t i = 0; i < m; ++i) to[i] = to[i] + static_cast<float>(c[i]) * scale;
    } else {
      for (std::size_t i = 0; i < m; ++i) to[i] = static_cast<float>(c[i]) * scale;
    }
    unsigned marked = 0;  // non-finite values (rare): NaN in their places
    for (std::size_t i = 0; i < m; ++i) marked |= static_cast<unsigned>(c[i] == kNonFinite);
    if (marked != 0)
      for (std::size_t i = 0; i < m; ++i)
        if (c[i] == kNonFinite) to[i] = nan;
  }
}

}  // namespace distopt::parallel::detail
