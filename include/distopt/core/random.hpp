// Deterministic pseudo-random numbers for initialization, synthetic data and
// shuffling: the same seed gives the same stream on every platform and
// compiler (no std:: distributions, whose outputs are implementation-defined).
#pragma once

#include <cmath>
#include <cstdint>

namespace distopt {

// splitmix64: turns any 64-bit value (seed, seed + stream id) into a
// well-mixed one; used to seed Rng and to derive independent streams.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// xoshiro256** (Blackman and Vigna).
class Rng {
 public:
  explicit Rng(std::uint64_t seed, std::uint64_t stream = 0) {
    std::uint64_t x = splitmix64(seed) ^ splitmix64(stream + 0x632be59bd9b4e019ull);
    for (auto& s : s_) s = x = splitmix64(x);
  }
  std::uint64_t next() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Skips n values of next(): uniform() takes one, normal() two.
  void discard(std::uint64_t n) {
    for (; n > 0; --n) (void)next();
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n), n > 0, without modulo bias (Lemire).
  std::uint64_t below(std::uint64_t n) {
    __extension__ using u128 = unsigned __int128;
    u128 m = static_cast<u128>(next()) * n;
    auto low = static_cast<std::uint64_t>(m);
    if (low < n) {
      const std::uint64_t threshold = -n % n;
      while (low < threshold) {
        m = static_cast<u128>(next()) * n;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }
  // Standard normal (Box-Muller; one value per call).
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

}  // namespace distopt
