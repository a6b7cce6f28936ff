// Whether any 8-bit code can make the int8 AdamW step faster than fp32's on
// this CPU ([lowbit]'s speed goal; docs/performance.md, "Quantized optimizer
// state"): one fused AdamW step over n elements, fp32 state against int8
// state in a float-like code whose nearest code and value are computed with
// integer operations (no table, no gather: the cheapest quantizer there is),
// block-wise absmax scaling with blocks of 256 as the library's. Both loops
// are AVX2, in one binary, timed in the same run (median of the repeats).
//
//   g++ -O3 -march=native -std=c++20 bench/quant_codes.cpp -o /tmp/quant_codes && /tmp/quant_codes [n] [repeats]
//
// The library's own int8 step (the dynamic map through its table search)
// is measured by `distopt bench optim --rules adamw,adamw-int8 --cases 16M`
// (scripts/bench_lowbit --part speed); this program bounds what a change of
// code could give.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kBlock = 256;
constexpr float kB1 = 0.9f, kB2 = 0.999f, kLr = 1e-3f, kEps = 1e-8f, kWd = 1e-2f;

struct Coeffs {
  float decay, b1, one_b1, b2, one_b2, step_size, inv_sqrt_bc2, eps;
};

Coeffs coeffs(int step) {
  const float bc1 = 1.0f - std::pow(kB1, static_cast<float>(step));
  const float bc2 = 1.0f - std::pow(kB2, static_cast<float>(step));
  return {1.0f - kLr * kWd, kB1, 1.0f - kB1, kB2, 1.0f - kB2, kLr / bc1, 1.0f / std::sqrt(bc2), kEps};
}

// One AdamW element on 8 lanes (torch's order of operations).
inline void adam8(const Coeffs& c, __m256& p, __m256 g, __m256& m, __m256& v) {
  p = _mm256_mul_ps(p, _mm256_set1_ps(c.decay));
  m = _mm256_add_ps(_mm256_mul_ps(m, _mm256_set1_ps(c.b1)), _mm256_mul_ps(g, _mm256_set1_ps(c.one_b1)));
  v = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(c.b2)),
                    _mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(c.one_b2)));
  const __m256 denom =
      _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c.inv_sqrt_bc2)), _mm256_set1_ps(c.eps));
  p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(m, _mm256_set1_ps(c.step_size)), denom));
}

void step_f32(const Coeffs& c, float* p, const float* g, float* m, float* v, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 8) {
    __m256 pp = _mm256_loadu_ps(p + i), mm = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
    adam8(c, pp, _mm256_loadu_ps(g + i), mm, vv);
    _mm256_storeu_ps(p + i, pp);
    _mm256_storeu_ps(m + i, mm);
    _mm256_storeu_ps(v + i, vv);
  }
}

// A float-like code of `kM` mantissa bits over magnitudes [0, 2): codes
// below 2^kM are the subnormals c * 2^(kEmin - kM), the rest
// 2^(e) * (1 + f / 2^kM) from e = kEmin; |q| <= 1 after absmax scaling.
template <int kM, int kEmin>
struct FloatCode {
  static inline __m256 value(__m256i mag) {
    const __m256i normal_bits =
        _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - kM), _mm256_set1_epi32((127 + kEmin - 1) << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(std::ldexp(1.0f, kEmin - kM)));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << kM), mag);
    return _mm256_blendv_ps(_mm256_castsi256_ps(normal_bits), sub, _mm256_castsi256_ps(is_sub));
  }
  // The nearest magnitude code of |q| (ties toward zero).
  static inline __m256i nearest(__m256 aq) {
    const __m256i u = _mm256_castps_si256(aq);
    const __m256i low = _mm256_and_si256(u, _mm256_set1_epi32((1 << (23 - kM)) - 1));
    const __m256i up = _mm256_cmpgt_epi32(low, _mm256_set1_epi32(1 << (22 - kM)));  // -1 where up
    const __m256i normal =
        _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(u, 23 - kM), _mm256_set1_epi32(((127 + kEmin) << kM) - (1 << kM))),
                         up);
    const __m256 t = _mm256_mul_ps(aq, _mm256_set1_ps(std::ldexp(1.0f, kM - kEmin)));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256i sub_up = _mm256_castps_si256(_mm256_cmp_ps(_mm256_sub_ps(t, k), _mm256_set1_ps(0.5f), _CMP_GT_OQ));
    const __m256i sub = _mm256_sub_epi32(_mm256_cvttps_epi32(k), sub_up);
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 + kEmin) << 23), u);
    return _mm256_blendv_epi8(normal, sub, is_sub);
  }
};

using Signed = FloatCode<3, -14>;    // sign + e4m3: magnitudes 2^-17 .. 1
using Unsigned = FloatCode<4, -14>;  // e4m4: 2^-18 .. 1

inline __m256i load8_codes(const std::uint8_t* c) {
  std::uint64_t eight;
  std::memcpy(&eight, c, 8);
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(eight)));
}
inline void store8_codes(std::uint8_t* c, __m256i k) {
  const __m128i lo = _mm256_castsi256_si128(k), hi = _mm256_extracti128_si256(k, 1);
  const __m128i w = _mm_packus_epi32(lo, hi);
  const __m128i b = _mm_packus_epi16(w, w);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(c), b);
}

inline __m256 max_abs(__m256 acc, __m256 x) {
  return _mm256_max_ps(acc, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x));
}
inline float hmax(__m256 x) {
  alignas(32) float l[8];
  _mm256_store_ps(l, x);
  return *std::max_element(l, l + 8);
}

void step_int8(const Coeffs& c, float* p, const float* g, std::uint8_t* mc, float* ma, std::uint8_t* vc, float* va,
               std::size_t n) {
  alignas(64) float m[kBlock], v[kBlock];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (std::size_t b = 0; b < n; b += kBlock) {
    const __m256 am = _mm256_set1_ps(ma[b / kBlock]), av = _mm256_set1_ps(va[b / kBlock]);
    __m256 mx_m = _mm256_setzero_ps(), mx_v = _mm256_setzero_ps();
    for (int i = 0; i < kBlock; i += 8) {
      const __m256i cm = load8_codes(mc + b + i), cv = load8_codes(vc + b + i);
      const __m256 sm = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(cm, 7), 31));
      __m256 mm = _mm256_mul_ps(_mm256_or_ps(Signed::value(_mm256_and_si256(cm, _mm256_set1_epi32(0x7F))), sm), am);
      __m256 vv = _mm256_mul_ps(Unsigned::value(cv), av);
      __m256 pp = _mm256_loadu_ps(p + b + i);
      adam8(c, pp, _mm256_loadu_ps(g + b + i), mm, vv);
      _mm256_storeu_ps(p + b + i, pp);
      _mm256_store_ps(m + i, mm);
      _mm256_store_ps(v + i, vv);
      mx_m = max_abs(mx_m, mm);
      mx_v = _mm256_max_ps(mx_v, vv);
    }
    const float a_m = hmax(mx_m), a_v = hmax(mx_v);
    ma[b / kBlock] = a_m;
    va[b / kBlock] = a_v;
    const __m256 qm = _mm256_set1_ps(a_m > 0 ? a_m : 1.0f), qv = _mm256_set1_ps(a_v > 0 ? a_v : 1.0f);
    for (int i = 0; i < kBlock; i += 8) {
      const __m256 xm = _mm256_div_ps(_mm256_load_ps(m + i), qm);
      const __m256i s = _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(xm), 31), 7);
      store8_codes(mc + b + i, _mm256_or_si256(Signed::nearest(_mm256_andnot_ps(sign, xm)), s));
      const __m256 xv = _mm256_div_ps(_mm256_load_ps(v + i), qv);
      __m256i kv = Unsigned::nearest(xv);
      kv = _mm256_max_epi32(kv, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(xv, _mm256_setzero_ps(), _CMP_GT_OQ)),
                                                  _mm256_set1_epi32(1)));  // a positive v never reads 0
      store8_codes(vc + b + i, kv);
    }
  }
}

double seconds_of(auto&& f, int repeats) {
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f(r + 1);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : std::size_t{1} << 24;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 9;
  if (n % kBlock != 0) {
    std::fprintf(stderr, "quant_codes: n must be a multiple of %d\n", kBlock);
    return 2;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f), p2(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = p2[i] = normal(gen), g[i] = 1e-2f * normal(gen);
  std::vector<std::uint8_t> mc(n, 0), vc(n, 0);
  std::vector<float> ma(n / kBlock, 0.0f), va(n / kBlock, 0.0f);
  const double f32 = seconds_of([&](int s) { step_f32(coeffs(s), p.data(), g.data(), m.data(), v.data(), n); }, repeats);
  const double i8 = seconds_of(
      [&](int s) { step_int8(coeffs(s), p2.data(), g.data(), mc.data(), ma.data(), vc.data(), va.data(), n); }, repeats);
  // The int8 state's values against the fp32 run's after the same steps (a sanity check of the codes).
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < n; ++i) err += std::abs(p2[i] - p[i]), ref += std::abs(p[i]);
  std::printf("n %zu, median of %d steps: fp32 %.2f ms, int8 (float-like code, no tables) %.2f ms: %.2fx fp32's speed; "
              "parameters' mean relative difference %.2e\n",
              n, repeats, f32 * 1e3, i8 * 1e3, f32 / i8, err / ref);
  return 0;
}
