// Compressed vectors on the wire: diloco's pseudo-gradients
// (--outer-dtype; docs/gossip.md, "Compressed pseudo-gradients").
//
// A vector of n floats is cut into blocks of kWireBlock values. bf16 keeps
// each value's exponent and rounds its mantissa to nearest even; fp8 (e4m3,
// the "fn" variant: no infinities, largest 448) and int4 (a two's-complement
// nibble in [-7, 7]) scale each block by its largest magnitude over the
// format's largest (448, 7), round to nearest even and store the scales
// (f32) before the codes. Under fp8 and int4 a block holding a non-finite
// value decodes to NaN throughout, as an f32 sum with it would be
// non-finite too; bf16 keeps each value's infinity or NaN. Encoding is a
// pure function of the values: every rank decodes every rank's bytes to the
// same floats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace distopt::gossip {

enum class WireDType : std::uint8_t { f32, bf16, fp8, int4 };

constexpr std::size_t kWireBlock = 64;

// "f32", "bf16", "fp8" or "int4"; false for anything else.
bool parse_wire_dtype(std::string_view name, WireDType* out);
std::string_view name_of(WireDType t);

// Bytes encode() writes for n values.
std::size_t wire_bytes(WireDType t, std::size_t n);
// Writes wire_bytes(t, in.size()) bytes at `out`.
void encode(WireDType t, std::span<const float> in, std::uint8_t* out);
// out[i] = value i of what encode() wrote for out.size() values.
void decode(WireDType t, const std::uint8_t* in, std::span<float> out);

// e4m3fn: finite values round to nearest even and saturate at +-448; NaN
// (and infinity, which the format lacks) become NaN (0x7f with the sign).
std::uint8_t float_to_e4m3(float v);
float e4m3_to_float(std::uint8_t code);

}  // namespace distopt::gossip
