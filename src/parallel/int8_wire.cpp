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
}  // namespace

void int8_pack(const float* g, float* e, std::size_t n, char* out) {
  const std::size_t blocks = blocks_of(n);
  auto* codes = reinterpret_cast<std::int8_t*>(out + blocks * sizeof(float));
  float v[kInt8Block];
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t at = b * kInt8Block, m = std::min(kInt8Block, n - at);
    float amax = 0.0f;
    bool finite = true;
    for (std::size_t i = 0; i < m; ++i) {
      v[i] = e != nullptr ? g[at + i] + e[at + i] : g[at + i];
      const float a = std::fabs(v[i]);
      finite = finite && a <= std::numeric_limits<float>::max();
      amax = std::max(amax, a);
    }
    const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    std::memcpy(out + b * sizeof(float), &scale, sizeof scale);
    if (!(scale > 0.0f)) {  // all zero (or too small to scale), or not finite
      std::fill_n(codes + at, m, std::int8_t{0});
      if (e != nullptr) {
        if (finite) std::copy_n(v, m, e + at);  // nothing travels: everything stays
        else std::fill_n(e + at, m, 0.0f);
      }
      continue;
    }
    for (std::size_t i = 0; i < m; ++i) {
      const float q = std::clamp(std::nearbyint(v[i] / scale), -127.0f, 127.0f);
      codes[at + i] = static_cast<std::int8_t>(q);
      if (e != nullptr) e[at + i] = v[i] - q * scale;
    }
  }
  std::fill(codes + n, codes + (n + 3) / 4 * 4, std::int8_t{0});
}

void int8_unpack(const char* in, std::size_t n, float* acc, bool add) {
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
  }
}

}  // namespace distopt::parallel::detail
