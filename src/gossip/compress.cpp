// Compressed vectors on the wire (compress.hpp). Layout of n values in
// nb = ceil(n / kWireBlock) blocks:
//   f32   n little-endian floats
//   bf16  n bf16 values (2 bytes each)
//   fp8   nb f32 scales, then n e4m3 codes
//   int4  nb f32 scales, then ceil(n / 2) bytes of codes, value 2i in the
//         low nibble of byte i and value 2i + 1 in its high nibble
#include "distopt/gossip/compress.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "distopt/core/dtype.hpp"

namespace distopt::gossip {

namespace {

constexpr float kFp8Max = 448.0f, kInt4Max = 7.0f;

std::size_t blocks(std::size_t n) { return (n + kWireBlock - 1) / kWireBlock; }

// The block's scale: its largest magnitude over `top`, or NaN where it
// holds a non-finite value.
float block_scale(std::span<const float> block, float top) {
  float amax = 0;
  for (float v : block) {
    if (!std::isfinite(v)) return std::numeric_limits<float>::quiet_NaN();
    amax = std::max(amax, std::fabs(v));
  }
  return amax / top;
}

// Scaled codes: `code(v / scale)` per value; code 0 where the scale is 0 or
// NaN (a NaN scale decodes to NaN regardless).
template <class Code>
void encode_scaled(std::span<const float> in, float top, std::uint8_t* out, Code code) {
  const std::size_t nb = blocks(in.size());
  std::uint8_t* codes = out + nb * sizeof(float);
  for (std::size_t b = 0; b < nb; ++b) {
    const std::size_t begin = b * kWireBlock, end = std::min(in.size(), begin + kWireBlock);
    const float scale = block_scale(in.subspan(begin, end - begin), top);
    std::memcpy(out + b * sizeof(float), &scale, sizeof scale);
    const bool zero = !(scale > 0);
    for (std::size_t i = begin; i < end; ++i) code(codes, i, zero ? 0.0f : in[i] / scale);
  }
}

template <class Value>
void decode_scaled(const std::uint8_t* in, std::span<float> out, Value value) {
  const std::size_t nb = blocks(out.size());
  const std::uint8_t* codes = in + nb * sizeof(float);
  for (std::size_t b = 0; b < nb; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof scale);
    const std::size_t begin = b * kWireBlock, end = std::min(out.size(), begin + kWireBlock);
    for (std::size_t i = begin; i < end; ++i) out[i] = value(codes, i) * scale;
  }
}

}  // namespace

bool parse_wire_dtype(std::string_view name, WireDType* out) {
  if (name == "f32") *out = WireDType::f32;
  else if (name == "bf16") *out = WireDType::bf16;
  else if (name == "fp8") *out = WireDType::fp8;
  else if (name == "int4") *out = WireDType::int4;
  else return false;
  return true;
}

std::string_view name_of(WireDType t) {
  switch (t) {
    case WireDType::bf16: return "bf16";
    case WireDType::fp8: return "fp8";
    case WireDType::int4: return "int4";
    case WireDType::f32: break;
  }
  return "f32";
}

std::size_t wire_bytes(WireDType t, std::size_t n) {
  switch (t) {
    case WireDType::bf16: return 2 * n;
    case WireDType::fp8: return blocks(n) * sizeof(float) + n;
    case WireDType::int4: return blocks(n) * sizeof(float) + (n + 1) / 2;
    case WireDType::f32: break;
  }
  return n * sizeof(float);
}

std::uint8_t float_to_e4m3(float v) {
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::fabs(v);
  if (std::isnan(v) || std::isinf(v)) return sign | 0x7f;
  if (a >= 464.0f) return sign | 0x7e;  // past the midpoint of 448 and 480: saturate
  if (a < 0x1p-6f) {
    // Subnormals: steps of 2^-9 (exact scaling; the smallest normal, code 8, follows on).
    return sign | static_cast<std::uint8_t>(std::nearbyint(a * 0x1p9f));
  }
  int e = std::ilogb(a);                                          // -6 .. 8
  float q = std::nearbyint(std::ldexp(a, 3 - e));                 // 8 .. 16, exact scaling
  if (q == 16.0f) {
    ++e;
    q = 8.0f;
  }
  const int code = ((e + 7) << 3) | (static_cast<int>(q) - 8);
  return sign | static_cast<std::uint8_t>(std::min(code, 0x7e));
}

float e4m3_to_float(std::uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 0x7;
  float a;
  if (e == 0xf && m == 0x7) a = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0) a = std::ldexp(static_cast<float>(m), -9);
  else a = std::ldexp(static_cast<float>(8 + m), e - 10);
  return (code & 0x80) ? -a : a;
}

void encode(WireDType t, std::span<const float> in, std::uint8_t* out) {
  switch (t) {
    case WireDType::f32:
      if (!in.empty()) std::memcpy(out, in.data(), in.size_bytes());
      return;
    case WireDType::bf16:
      for (std::size_t i = 0; i < in.size(); ++i) {
        const std::uint16_t b = float_to_bf16_bits(in[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case WireDType::fp8:
      encode_scaled(in, kFp8Max, out, [](std::uint8_t* codes, std::size_t i, float x) { codes[i] = float_to_e4m3(x); });
      return;
    case WireDType::int4:
      std::memset(out + blocks(in.size()) * sizeof(float), 0, (in.size() + 1) / 2);
      encode_scaled(in, kInt4Max, out, [](std::uint8_t* codes, std::size_t i, float x) {
        const int q = static_cast<int>(std::clamp(std::nearbyint(x), -kInt4Max, kInt4Max));
        codes[i / 2] |= static_cast<std::uint8_t>((q & 0xf) << (4 * (i % 2)));
      });
      return;
  }
}

void decode(WireDType t, const std::uint8_t* in, std::span<float> out) {
  switch (t) {
    case WireDType::f32:
      if (!out.empty()) std::memcpy(out.data(), in, out.size_bytes());
      return;
    case WireDType::bf16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint16_t b;
        std::memcpy(&b, in + 2 * i, 2);
        out[i] = bf16_bits_to_float(b);
      }
      return;
    case WireDType::fp8:
      decode_scaled(in, out, [](const std::uint8_t* codes, std::size_t i) { return e4m3_to_float(codes[i]); });
      return;
    case WireDType::int4:
      decode_scaled(in, out, [](const std::uint8_t* codes, std::size_t i) {
        const int nibble = (codes[i / 2] >> (4 * (i % 2))) & 0xf;
        return static_cast<float>(nibble >= 8 ? nibble - 16 : nibble);
      });
      return;
  }
}

}  // namespace distopt::gossip
