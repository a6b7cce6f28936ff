// Sign packets with error feedback: see onebit_wire.hpp.
//
// The packer is on every frozen step's path twice (a rank's share, an
// owner's sum), so it avoids what made it slow (docs/performance.md, "1-bit
// Adam"): the median is a radix selection on the magnitudes' bit patterns
// (non-negative finite floats order as their bits do) instead of
// std::nth_element's branchy partitions, and with AVX2 the signs and
// residuals take eight values at a time. Every path gives the same bits:
// the same elements, the same roundings (one subtraction each, no
// contraction: src/CMakeLists.txt), the same index-order sum.
#include "onebit_wire.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace distopt::parallel::detail {

namespace {
constexpr std::size_t blocks_of(std::size_t n) {
  return (n + kOnebitBlock - 1) / kOnebitBlock;
}

// The k-th smallest (0-based, k < n) of n values, each the bit pattern of a
// non-negative finite float, given how many of them have each exponent
// (count[bits >> 23], 256 entries, overwritten); a is overwritten too. A
// byte at a time from the top, the exponent first (bits 30-23, then 22-15,
// 14-7): keep the values whose byte holds the k-th and count the next byte
// of those; the few left are selected by comparison.
std::uint32_t kth_smallest(std::uint32_t* a, std::size_t n, std::size_t k, std::uint32_t* count) {
  for (int shift = 23; shift >= 0 && n > 32; shift -= 8) {
    if (shift != 23) {
      std::fill_n(count, 256, 0u);
      for (std::size_t i = 0; i < n; ++i) ++count[(a[i] >> shift) & 0xFFu];
    }
    std::uint32_t digit = 0;
    while (k >= count[digit]) k -= count[digit++];
    std::size_t kept = 0;
    for (std::size_t i = 0; i < n; ++i) {
      a[kept] = a[i];
      kept += ((a[i] >> shift) & 0xFFu) == digit ? 1 : 0;
    }
    n = kept;
  }
  std::nth_element(a, a + k, a + n);
  return a[k];
}

constexpr std::uint32_t kAbs = 0x7FFFFFFFu, kExponent = 0x7F800000u;

// Signs and residuals of m values v from `at` (a multiple of 32) at
// +-scale, one value at a time.
void signs(const float* v, std::size_t m, std::size_t at, float scale, std::uint32_t* bits, float* e) {
  for (std::size_t i = 0; i < m; ++i) {
    const bool up = !(v[i] < 0.0f);
    if (up) bits[(at + i) / 32] |= std::uint32_t{1} << ((at + i) % 32);
    if (e != nullptr) {
      const bool finite = (std::bit_cast<std::uint32_t>(v[i]) & kExponent) != kExponent;
      e[at + i] = finite ? v[i] - (up ? scale : -scale) : 0.0f;
    }
  }
}

#ifdef __AVX2__
// The same, 32 values (one word of bits) at a time; returns how many it took.
std::size_t signs32(const float* v, std::size_t m, std::size_t at, float scale, std::uint32_t* bits, float* e) {
  const __m256 zero = _mm256_setzero_ps(), up_value = _mm256_set1_ps(scale), down_value = _mm256_set1_ps(-scale);
  const __m256i exponent = _mm256_set1_epi32(static_cast<int>(kExponent));
  std::size_t i = 0;
  for (; i + 32 <= m; i += 32) {
    std::uint32_t word = 0;
    for (std::size_t j = 0; j < 32; j += 8) {
      const __m256 x = _mm256_loadu_ps(v + i + j);
      const __m256 up = _mm256_cmp_ps(x, zero, _CMP_NLT_UQ);  // !(x < 0): NaN goes up
      word |= static_cast<std::uint32_t>(_mm256_movemask_ps(up)) << j;
      if (e != nullptr) {
        const __m256 r = _mm256_sub_ps(x, _mm256_blendv_ps(down_value, up_value, up));
        const __m256i finite = _mm256_xor_si256(
            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), exponent), exponent), _mm256_set1_epi32(-1));
        _mm256_storeu_ps(e + at + i + j, _mm256_and_ps(r, _mm256_castsi256_ps(finite)));
      }
    }
    bits[(at + i) / 32] = word;
  }
  return i;
}
#endif
}  // namespace

void onebit_pack(const float* x, float* e, std::size_t n, char* out) {
  const std::size_t blocks = blocks_of(n);
  auto* bits = reinterpret_cast<std::uint32_t*>(out + blocks * sizeof(float));
  std::memset(bits, 0, (n + 31) / 32 * 4);
  float v[kOnebitBlock], mags[kOnebitBlock];
  std::uint32_t keys[kOnebitBlock];
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t at = b * kOnebitBlock, m = std::min(kOnebitBlock, n - at);
    if (e != nullptr) {
      for (std::size_t i = 0; i < m; ++i) v[i] = x[at + i] + e[at + i];
    } else {
      std::copy_n(x + at, m, v);
    }
    // The root mean square of the finite nonzero magnitudes, each clipped
    // at kOnebitClip times their median, summed in double in index order
    // (the same on every rank and backend).
    std::size_t nonzero = 0;
    std::uint32_t exponents[256] = {};
    for (std::size_t i = 0; i < m; ++i) {
      const std::uint32_t magnitude = std::bit_cast<std::uint32_t>(v[i]) & kAbs;
      const bool counted = magnitude != 0 && magnitude < kExponent;
      keys[nonzero] = magnitude;
      nonzero += counted ? 1 : 0;
      exponents[magnitude >> 23] += counted ? 1 : 0;
    }
    float scale = 0.0f;
    if (nonzero > 0) {
      for (std::size_t i = 0; i < nonzero; ++i) mags[i] = std::bit_cast<float>(keys[i]);
      const float clip = kOnebitClip * std::bit_cast<float>(kth_smallest(keys, nonzero, nonzero / 2, exponents));
      double squares = 0;
      for (std::size_t i = 0; i < nonzero; ++i) {
        const double a = std::min(mags[i], clip);
        squares += a * a;
      }
      scale = static_cast<float>(std::sqrt(squares / double(nonzero)));
    }
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    std::size_t done = 0;
#ifdef __AVX2__
    done = signs32(v, m, at, scale, bits, e);
#endif
    signs(v + done, m - done, at + done, scale, bits, e);
  }
}

void onebit_unpack(const char* in, std::size_t n, float* acc, bool add) {
  const std::size_t blocks = blocks_of(n);
  const auto* bits = reinterpret_cast<const std::uint32_t*>(in + blocks * sizeof(float));
  for (std::size_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    const std::size_t at = b * kOnebitBlock, m = std::min(kOnebitBlock, n - at);
    for (std::size_t i = at; i < at + m; ++i) {
      const float value = (bits[i / 32] >> (i % 32)) & 1u ? scale : -scale;
      acc[i] = add ? acc[i] + value : value;
    }
  }
}

}  // namespace distopt::parallel::detail
