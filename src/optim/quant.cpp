// The code books and block quantizer of quantized optimizer state
// (include/distopt/optim/quant.hpp).
#include "distopt/optim/quant.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "distopt/core/error.hpp"
#include "quant_code.hpp"

#ifdef __AVX2__
#include <immintrin.h>
#endif

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

// The nearest code of q (ties to the lower), never the code 0 for a
// positive q in a book whose code 0 is zero and which holds no negatives.
// The reference search; Book::nearest gives its answer faster.
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

// A float's bits as an unsigned key in the floats' order (negatives below
// positives, -0 just below +0).
std::uint32_t order_key(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
float from_key(std::uint32_t k) {
  return std::bit_cast<float>((k & 0x80000000u) != 0 ? (k & 0x7FFFFFFFu) : ~k);
}

// A code book with a table for its search. The reference choice between
// neighbouring codes c[k] < c[k+1], (q - c[k]) <= (c[k+1] - q) in float
// arithmetic, is monotone in q: it holds up to a threshold t[k] (the
// largest such float) and not after. So the nearest code of q is the number
// of thresholds below q, and for each bucket of floats that share their
// key's top bits (sign, exponent, 7 mantissa bits) a table holds the number
// of thresholds below the bucket's smallest float; the few thresholds inside
// a bucket (steps_, at most) are counted by comparisons without branches.
// nearest() gives exactly the reference search's code
// (Lowbit.TheFastSearchIsTheReferenceSearch).
class Book {
 public:
  static constexpr int kShift = 16;
  explicit Book(std::vector<float> values) : values_(std::move(values)), first_(std::size_t{1} << (32 - kShift)) {
    floor_positive_ = values_.front() == 0.0f;  // the unsigned books that hold 0: no negatives
    const std::size_t n = values_.size();
    for (std::size_t k = 0; k + 1 < n; ++k) {  // the largest q between them that picks c[k]
      const float a = values_[k], b = values_[k + 1];
      std::uint32_t lo = order_key(a), hi = order_key(b);  // picks a at lo, not at hi
      while (hi - lo > 1) {
        const std::uint32_t mid = lo + (hi - lo) / 2;
        const float q = from_key(mid);
        ((q - a) <= (b - q) ? lo : hi) = mid;
      }
      thresholds_.push_back(from_key(lo));
    }
    thresholds_.push_back(std::numeric_limits<float>::infinity());         // never below q: the count stops at n - 1
    auto below = [&](float f) {                                            // thresholds < f
      if (std::isnan(f)) return std::signbit(f) ? std::size_t{0} : n - 1;  // keys beyond the infinities
      return static_cast<std::size_t>(std::lower_bound(thresholds_.begin(), thresholds_.end() - 1, f) -
                                      thresholds_.begin());
    };
    for (std::size_t b = 0; b < first_.size(); ++b) {
      first_[b] = static_cast<std::uint8_t>(below(from_key(static_cast<std::uint32_t>(b << kShift))));
      const std::size_t last = below(std::nextafter(from_key(static_cast<std::uint32_t>(((b + 1) << kShift) - 1)),
                                                    std::numeric_limits<float>::infinity()));
      steps_ = std::max(steps_, last - first_[b]);
    }
    first_.resize(first_.size() + 3, 0);  // nearest8 reads four bytes at an entry
    const auto z = std::find(values_.begin(), values_.end(), 0.0f);
    zero_ = z == values_.end() ? 0 : static_cast<std::uint8_t>(z - values_.begin());
  }
  std::span<const float> values() const { return values_; }
  std::span<const float> thresholds() const { return thresholds_; }
  bool floor_positive() const { return floor_positive_; }
  std::uint8_t zero() const { return zero_; }
#ifdef __AVX2__
  // nearest(x[j] / a) for j < 8 into out, 8 lanes at a time: the same
  // division, key, table and comparisons as nearest(), so the same codes.
  void nearest8(const float* x, float a, std::int32_t* out) const {
    const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x), _mm256_set1_ps(a));
    const __m256i u = _mm256_castps_si256(q);
    const __m256i key = _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(INT32_MIN)));
    // Four bytes at the bucket's entry (the table has three bytes of padding), the first of them.
    __m256i k = _mm256_and_si256(
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(first_.data()), _mm256_srli_epi32(key, kShift), 1),
        _mm256_set1_epi32(0xFF));
    for (std::size_t s = 0; s < steps_; ++s) {  // k += thresholds_[k] < q (a true compare is -1)
      const __m256 t = _mm256_i32gather_ps(thresholds_.data(), k, 4);
      k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(t, q, _CMP_LT_OQ)));
    }
    if (floor_positive_) {
      const __m256i zero = _mm256_cmpeq_epi32(k, _mm256_setzero_si256());
      const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_setzero_ps(), _CMP_GT_OQ));
      k = _mm256_sub_epi32(k, _mm256_and_si256(zero, positive));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), k);
  }
#endif
  // nearest(values(), q, floor_positive()) for a q that is not NaN.
  std::uint8_t nearest(float q) const {
    std::size_t k = first_[order_key(q) >> kShift];
    for (std::size_t s = 0; s < steps_; ++s) k += thresholds_[k] < q ? 1 : 0;
    const bool floor = floor_positive_ && k == 0 && q > 0.0f;
    return static_cast<std::uint8_t>(floor ? 1 : k);
  }

 private:
  std::vector<float> values_, thresholds_;
  std::vector<std::uint8_t> first_;
  std::size_t steps_ = 0;
  bool floor_positive_ = false;
  std::uint8_t zero_ = 0;
};

// A book as the device reads it (quant_code.hpp).
BookTable table_of(const Book& b) {
  BookTable t{};
  t.size = static_cast<std::uint32_t>(b.values().size());
  DISTOPT_CHECK(t.size <= kMaxCodes && (t.size & (t.size - 1)) == 0 && b.thresholds().size() == t.size, "a book of ",
                t.size, " codes");
  std::copy(b.values().begin(), b.values().end(), t.values);
  std::copy(b.thresholds().begin(), b.thresholds().end(), t.thresholds);  // its last is +inf
  std::fill(t.thresholds + t.size, t.thresholds + kMaxCodes, std::numeric_limits<float>::infinity());
  t.zero = b.zero();
  t.floor_positive = b.floor_positive();
  return t;
}

struct Books {
  Book int8_signed{dynamic_map(true, 7, 8)};
  Book int8_unsigned{dynamic_map(false, 7, 8)};
  Book int4_signed{dynamic_map(true, 3, 4)};
  Book int4_unsigned{[] {
    std::vector<float> v = linspace(0.0f, 1.0f, 17);
    v.erase(v.begin());  // k/16, k = 1..16: no zero
    return v;
  }()};
  BookTable tables[4] = {table_of(int8_signed), table_of(int8_unsigned), table_of(int4_signed),
                         table_of(int4_unsigned)};
};

const Books& books() {
  static const Books b;
  return b;
}

const Book& book(StateDType d, bool is_signed) {
  const Books& b = books();
  DISTOPT_CHECK(has_scales(d), name_of(d), " state has no code book");
  if (d == StateDType::int8) return is_signed ? b.int8_signed : b.int8_unsigned;
  return is_signed ? b.int4_signed : b.int4_unsigned;
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

// codes[i] = f(i) for i < n: one byte each, or two per byte (an odd last
// element keeps the other nibble of its byte).
template <class F>
void put_all(StateDType d, std::uint8_t* codes, std::size_t n, F&& f) {
  if (d == StateDType::int8) {
    for (std::size_t i = 0; i < n; ++i) codes[i] = f(i);
    return;
  }
  std::size_t i = 0;
  for (; i + 1 < n; i += 2) codes[i / 2] = static_cast<std::uint8_t>(f(i) | (f(i + 1) << 4));
  if (i < n) put(d, codes, i, f(i));
}

}  // namespace

std::string_view name_of(StateDType d) {
  switch (d) {
    case StateDType::f32:
      return "f32";
    case StateDType::bf16:
      return "bf16";
    case StateDType::int8:
      return "int8";
    case StateDType::int4:
      return "int4";
  }
  return "?";
}

std::optional<StateDType> parse_state_dtype(std::string_view name) {
  for (StateDType d : {StateDType::f32, StateDType::bf16, StateDType::int8, StateDType::int4})
    if (name == name_of(d)) return d;
  return std::nullopt;
}

std::string_view state_dtype_names() {
  return "f32, bf16, int8, int4";
}

std::size_t min_elements(StateDType d) {
  return has_scales(d) ? kMinElements : 1;
}

bool has_scales(StateDType d) {
  return d == StateDType::int8 || d == StateDType::int4;
}

std::uint16_t to_bf16(float x) {
  return bf16_of(x);
}

float from_bf16(std::uint16_t b) {
  return bf16_bits_to_float(b);
}

const BookTable& book_table(StateDType d, bool is_signed) {
  DISTOPT_CHECK(has_scales(d), name_of(d), " state has no code book");
  return books().tables[(d == StateDType::int4 ? 2 : 0) + (is_signed ? 0 : 1)];
}

std::size_t block_of(StateDType d) {
  return d == StateDType::int4 ? 128 : d == StateDType::int8 ? 256 : 1;
}

std::size_t code_bytes(StateDType d, std::size_t n) {
  return d == StateDType::int4 ? (n + 1) / 2 : d == StateDType::bf16 ? 2 * n : n;
}

std::size_t num_blocks(StateDType d, std::size_t n) {
  return has_scales(d) ? (n + block_of(d) - 1) / block_of(d) : 0;
}

std::span<const float> code_book(StateDType d, bool is_signed) {
  return book(d, is_signed).values();
}

void fill_zero(StateDType d, bool is_signed, std::uint8_t* codes, float* absmax, std::size_t n) {
  if (d == StateDType::bf16) {
    std::fill_n(codes, code_bytes(d, n), std::uint8_t{0});  // +0
    return;
  }
  const std::uint8_t z = book(d, is_signed).zero();
  put_all(d, codes, n, [z](std::size_t) { return z; });
  std::fill_n(absmax, num_blocks(d, n), 0.0f);
}

void quantize_block(StateDType d, bool is_signed, const float* x, std::size_t n, std::uint8_t* codes, float* absmax) {
  if (d == StateDType::bf16) {
    std::size_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {  // to_bf16 on 8 lanes
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256i u = _mm256_castps_si256(v);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
      h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // lanes 0-3, 4-7
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * i), _mm256_castsi256_si128(packed));
    }
#endif
    for (; i < n; ++i) {
      const std::uint16_t h = to_bf16(x[i]);
      std::memcpy(codes + 2 * i, &h, sizeof h);
    }
    return;
  }
  DISTOPT_CHECK(n <= block_of(d), "a block of ", n, " elements");
  const Book& b = book(d, is_signed);
  // max |x| on the bits: a non-negative float's bits order as it does, and
  // any NaN's lie above the infinity's (0x7F800000).
  std::uint32_t bits = 0;
  for (std::size_t i = 0; i < n; ++i) bits = std::max(bits, std::bit_cast<std::uint32_t>(x[i]) & 0x7FFFFFFFu);
  float a = bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : std::bit_cast<float>(bits);
  // a == 0.0f holds for a denormal a where the CPU flushes denormals (DAZ):
  // src/cuda/quantized.cuh tests the same in its flush build.
  if (!std::isfinite(a) || a == 0.0f) {
    const std::uint8_t z = b.zero();
    put_all(d, codes, n, [z](std::size_t) { return z; });
    *absmax = a == 0.0f ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *absmax = a;
#ifdef __AVX2__
  std::int32_t k[kMaxBlock];
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) b.nearest8(x + i, a, k + i);
  for (; i < n; ++i) k[i] = b.nearest(x[i] / a);
  put_all(d, codes, n, [&](std::size_t j) { return static_cast<std::uint8_t>(k[j]); });
#else
  put_all(d, codes, n, [&](std::size_t i) { return b.nearest(x[i] / a); });
#endif
}

void dequantize_block(StateDType d, bool is_signed, const std::uint8_t* codes, float absmax, std::size_t n,
                      float* out) {
  if (d == StateDType::bf16) {
    std::size_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * i));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
    for (; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, codes + 2 * i, sizeof h);
      out[i] = from_bf16(h);
    }
    return;
  }
  const float* code = book(d, is_signed).values().data();
  std::size_t i = 0;
#ifdef __AVX2__
  const __m256 scale = _mm256_set1_ps(absmax);
  if (d == StateDType::int8) {
    for (; i + 8 <= n; i += 8) {  // eight codes widened to indices, their values gathered, times the scale
      std::uint64_t eight;
      std::memcpy(&eight, codes + i, sizeof eight);
      const __m256i k = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(eight)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(code, k, 4), scale));
    }
  } else {
    for (; i + 8 <= n; i += 8) {  // four bytes: eight nibbles, low first
      std::uint32_t four;
      std::memcpy(&four, codes + i / 2, sizeof four);
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_set1_epi32(static_cast<int>(four)));
      const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
      const __m256i pairs = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      const __m256i k = _mm256_and_si256(_mm256_srlv_epi32(pairs, shift), _mm256_set1_epi32(0x0F));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(code, k, 4), scale));
    }
  }
#endif
  if (d == StateDType::int8) {
    for (; i < n; ++i) out[i] = code[codes[i]] * absmax;
    return;
  }
  for (; i + 1 < n; i += 2) {
    out[i] = code[codes[i / 2] & 0x0F] * absmax;
    out[i + 1] = code[codes[i / 2] >> 4] * absmax;
  }
  if (i < n) out[i] = code[get(d, codes, i)] * absmax;
}

bool requantize_block(StateDType d, bool is_signed, const float* x, std::size_t n, float absmax, std::uint8_t* codes) {
  if (d == StateDType::bf16) {  // values a bf16 state gave: each one exactly a bfloat16
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isnan(x[i]) && from_bf16(to_bf16(x[i])) != x[i]) return false;
    quantize_block(d, is_signed, x, n, codes, nullptr);
    return true;
  }
  const Book& b = book(d, is_signed);
  const std::span<const float> code = b.values();
  auto same = [](float u, float v) { return u == v || (std::isnan(u) && std::isnan(v)); };
  for (std::size_t i = 0; i < n; ++i) {
    std::uint8_t c = b.zero();
    if (absmax != 0.0f && std::isfinite(absmax) && !std::isnan(x[i])) c = b.nearest(x[i] / absmax);
    if (!same(code[c] * absmax, x[i])) {  // a scale so small that x / absmax misses: any exact code
      const auto it = std::find_if(code.begin(), code.end(), [&](float v) { return same(v * absmax, x[i]); });
      if (it == code.end()) return false;
      c = static_cast<std::uint8_t>(it - code.begin());
    }
    put(d, codes, i, c);
  }
  return true;
}

std::uint8_t reference_nearest(StateDType d, bool is_signed, float q) {
  const Book& b = book(d, is_signed);
  return nearest(b.values(), q, b.floor_positive());
}

std::uint8_t fast_nearest(StateDType d, bool is_signed, float q) {
  return book(d, is_signed).nearest(q);
}

void quantize(StateDType d, bool is_signed, const float* x, std::size_t n, std::uint8_t* codes, float* absmax) {
  if (!has_scales(d)) return quantize_block(d, is_signed, x, n, codes, absmax);
  const std::size_t block = block_of(d);
  for (std::size_t b = 0; b < n; b += block)
    quantize_block(d, is_signed, x + b, std::min(block, n - b), codes + code_bytes(d, b), absmax + b / block);
}

void dequantize(StateDType d, bool is_signed, const std::uint8_t* codes, const float* absmax, std::size_t n,
                float* out) {
  if (!has_scales(d)) return dequantize_block(d, is_signed, codes, 0.0f, n, out);
  const std::size_t block = block_of(d);
  for (std::size_t b = 0; b < n; b += block)
    dequantize_block(d, is_signed, codes + code_bytes(d, b), absmax[b / block], std::min(block, n - b), out + b);
}

long requantize(StateDType d, bool is_signed, const float* x, std::size_t n, const float* absmax, std::uint8_t* codes) {
  if (!has_scales(d)) return requantize_block(d, is_signed, x, n, 0.0f, codes) ? -1 : 0;
  const std::size_t block = block_of(d);
  for (std::size_t b = 0; b < n; b += block)
    if (!requantize_block(d, is_signed, x + b, std::min(block, n - b), absmax[b / block], codes + code_bytes(d, b)))
      return static_cast<long>(b / block);
  return -1;
}

SavedScales classify_scales(StateDType d, std::size_t n, std::size_t count) {
  if (!has_scales(d)) return SavedScales::other_storage;  // bf16 keeps none: the values are rounded, whatever came
  if (count == num_blocks(d, n)) return SavedScales::this_storage;
  for (StateDType other : {StateDType::int8, StateDType::int4})
    if (other != d && count == num_blocks(other, n)) return SavedScales::other_storage;
  return SavedScales::misfit;
}

long load(StateDType d, bool is_signed, const float* values, std::size_t n, const float* scales, std::uint8_t* codes,
          float* absmax) {
  if (scales == nullptr) {
    quantize(d, is_signed, values, n, codes, absmax);
    return -1;
  }
  std::vector<std::uint8_t> staged(code_bytes(d, n));
  if (const long b = requantize(d, is_signed, values, n, scales, staged.data()); b >= 0) return b;
  std::copy(staged.begin(), staged.end(), codes);
  if (has_scales(d)) std::copy_n(scales, num_blocks(d, n), absmax);
  return -1;
}

}  // namespace distopt::quant
