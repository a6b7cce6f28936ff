// Gradients as int8 blocks on the wire, with error feedback (not
// installed; --grad-compression int8, docs/sharding.md "Gradient
// compression"): ZeRO++'s quantized gradient reduction (qgZ) with the
// residual carried into the next step, as 1-bit Adam carries its sign's.
//
// A piece of n gradient elements travels as a packet: one fp32 scale per
// block of kInt8Block elements, then the codes, one int8 each, padded to a
// multiple of four bytes so that packets laid end to end keep their scales
// aligned. A block's scale is max |v| / 127 over its finite values v; a
// value's code is v / scale rounded to the nearest integer (ties to even),
// its value on arrival code * scale. A non-finite value travels as the
// code -128 and arrives as NaN, so the sum it reaches is NaN (the loss
// scaler's overflow check sees it) while its block's other values arrive
// as they would have (padding stays zero); it leaves no residual.
//
// Error feedback: v = g + e, where e is what quantizing the last step's v
// lost, and the new e = v - code * scale. The subtraction is exact (the
// arrival value is within half a scale of v, so Sterbenz's lemma holds for
// every nonzero code, and a zero code leaves v itself), so what travels
// and what stays add up to v bit for bit.
#pragma once

#include <cstddef>

namespace distopt::parallel::detail {

inline constexpr std::size_t kInt8Block = 256;

// The bytes of a packet of n elements.
constexpr std::size_t int8_packet_bytes(std::size_t n) {
  return (n + kInt8Block - 1) / kInt8Block * sizeof(float) + (n + 3) / 4 * 4;
}

// n values g + e into the packet at `out` (int8_packet_bytes(n) bytes); e
// becomes the residual. e may be null: no feedback (the residual is dropped).
void int8_pack(const float* g, float* e, std::size_t n, char* out);

// The n values of the packet at `in`: written to `acc` (add == false) or
// added to it in place (add == true).
void int8_unpack(const char* in, std::size_t n, float* acc, bool add);

}  // namespace distopt::parallel::detail
