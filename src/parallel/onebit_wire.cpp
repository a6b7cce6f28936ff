// Sign packets with error feedback: see onebit_wire.hpp.
#include "onebit_wire.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace distopt::parallel::detail {

namespace {
constexpr std::size_t blocks_of(std::size_t n) {
  return (n + kOnebitBlock - 1) / kOnebitBlock;
}
}  // namespace

void onebit_pack(const float* x, float* e, std::size_t n, char* out) {
  const std::size_t blocks = blocks_of(n);
  auto* bits = reinterpret_cast<std::uint32_t*>(out + blocks * sizeof(float));
  std::memset(bits, 0, (n + 31) / 32 * 4);
  float v[kOnebitBlock], mags[kOnebitBlock], sorted[kOnebitBlock];
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
    for (std::size_t i = 0; i < m; ++i)
      if (v[i] != 0.0f && std::isfinite(v[i])) mags[nonzero++] = std::fabs(v[i]);
    float scale = 0.0f;
    if (nonzero > 0) {
      std::copy_n(mags, nonzero, sorted);
      std::nth_element(sorted, sorted + nonzero / 2, sorted + nonzero);
      const float clip = kOnebitClip * sorted[nonzero / 2];
      double squares = 0;
      for (std::size_t i = 0; i < nonzero; ++i) {
        const double a = std::min(mags[i], clip);
        squares += a * a;
      }
      scale = static_cast<float>(std::sqrt(squares / double(nonzero)));
    }
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    for (std::size_t i = 0; i < m; ++i) {
      const bool up = !(v[i] < 0.0f);
      if (up) bits[(at + i) / 32] |= std::uint32_t{1} << ((at + i) % 32);
      if (e != nullptr) e[at + i] = std::isfinite(v[i]) ? v[i] - (up ? scale : -scale) : 0.0f;
    }
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
