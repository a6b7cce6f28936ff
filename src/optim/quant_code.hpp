// The per-element code of quantized state (include/distopt/optim/quant.hpp)
// as the CUDA kernels pick it (src/cuda/quantized.cuh) and the host checks
// it (tests/lowbit_test.cpp): a book's sorted values and the thresholds
// between them, searched by a binary search of fixed length, with no table.
// It gives the code quant.cpp's table search gives for every q
// (Lowbit.TheDevicesSearchIsTheReferenceSearch). An internal interface of
// optim for src/cuda/ (docs/architecture.md, "Layers").
#pragma once

#include <cstdint>

#include "distopt/core/dtype.hpp"
#include "distopt/core/hd.hpp"
#include "distopt/optim/quant.hpp"

namespace distopt::quant {

// One code book, padded to kMaxCodes entries: values[k] the code k's value;
// thresholds[k] the largest q that picks code k rather than k + 1 (ties to
// the lower: (q - values[k]) <= (values[k + 1] - q) in float arithmetic),
// +infinity from size - 1 on; floor_positive: a positive q never takes
// code 0 (a book whose code 0 is zero and which holds no negatives).
inline constexpr int kMaxCodes = 256;
struct BookTable {
  float values[kMaxCodes];
  float thresholds[kMaxCodes];
  std::uint32_t size;  // 256 (int8) or 16 (int4): a power of two
  std::uint8_t zero;   // the code of 0 (fill_zero's, and a block whose scale is 0 or not finite)
  bool floor_positive;
};

// The book of state dtype d (int8 or int4) and sign.
const BookTable& book_table(StateDType d, bool is_signed);

// The code of q (x / scale, finite): the number of thresholds below q, by
// halving steps over the power-of-two table (its last threshold is +inf).
DISTOPT_HD std::uint32_t code_of(const float* thresholds, std::uint32_t size, bool floor_positive, float q) {
  std::uint32_t k = 0;
  for (std::uint32_t step = size / 2; step > 0; step /= 2)
    if (thresholds[k + step - 1] < q) k += step;
  return floor_positive && k == 0 && q > 0.0f ? 1u : k;
}

// bfloat16's bits of x, rounded to nearest-even as c10 rounds (a NaN
// becomes 0x7FC0, where a bf16 parameter's keeps its payload: dtype.hpp):
// quant.hpp's to_bf16.
DISTOPT_HD std::uint16_t bf16_of(float x) {
  return x != x ? std::uint16_t{0x7FC0} : float_to_bf16_bits(x);
}

}  // namespace distopt::quant
