// Signs on the wire, with error feedback (not installed; --grad-compression
// onebit, docs/sharding.md "1-bit Adam"): the compressed all-reduce of 1-bit
// Adam (Tang et al. 2021; DeepSpeed's compressed_allreduce), each rank's
// first moment sent as signs and one scale per block.
//
// A piece of n values travels as a packet: one fp32 scale per block of
// kOnebitBlock values, then one bit per value (set: +scale, clear: -scale;
// a value of 0 or -0 is sent as +scale, as DeepSpeed's sign().add_(1)
// does), padded to a multiple of four bytes so that packets laid end to end
// keep their scales aligned. A block's scale is the root mean square of its
// finite nonzero magnitudes, each clipped at kOnebitClip times their median
// (the nonzero/2-th smallest, 0-based), or 0 where there are none: padding
// and the gaps between a unit's parameters, which are exactly 0, do not
// shrink it, and a few outliers do not blow it up for the whole block (a
// plain root mean square, DeepSpeed's, let one stale element of a frozen
// variance make every step of its block huge: docs/sharding.md). A
// non-finite value cannot travel as itself in one bit: -inf is sent as
// -scale, inf and NaN as +scale; it leaves no residual and does not touch
// its block's other values.
//
// Error feedback: v = x + e, where e is what the last step's signs lost,
// and the new e = v - (+-scale). Unlike int8's, the value sent is not
// within rounding of v, so what travels and what stays add up to v only to
// within a rounding of the subtraction (half an ulp of e).
#pragma once

#include <cstddef>

namespace distopt::parallel::detail {

inline constexpr std::size_t kOnebitBlock = 1024;
inline constexpr float kOnebitClip = 3.0f;

// The bytes of a packet of n values.
constexpr std::size_t onebit_packet_bytes(std::size_t n) {
  return (n + kOnebitBlock - 1) / kOnebitBlock * sizeof(float) + (n + 31) / 32 * 4;
}

// n values x + e into the packet at `out` (onebit_packet_bytes(n) bytes); e
// becomes the residual. e may be null: no feedback.
void onebit_pack(const float* x, float* e, std::size_t n, char* out);

// The n values of the packet at `in`: written to `acc` (add == false) or
// added to it in place (add == true).
void onebit_unpack(const char* in, std::size_t n, float* acc, bool add);

}  // namespace distopt::parallel::detail
