// Quantized optimizer state (docs/optimizers.md, "Quantized state"): a
// state tensor kept as one code per element and one fp32 scale (the
// absolute maximum) per block of consecutive elements, as bitsandbytes'
// 8-bit and torchao's 4-bit optimizers keep it.
//
//   int8: 256 codes, blocks of 256; int4: 16 codes, two per byte (element
//   2j in the low nibble of byte j), blocks of 128.
//   signed state (Adam's exp_avg, SGD's momentum, Lion's exp_avg): the
//   dynamic map (bitsandbytes' create_dynamic_map: 7 exponent bits for int8,
//   3 for int4), 0 and +1 exact, -1 not.
//   unsigned state (Adam's exp_avg_sq): int8 the unsigned dynamic map, where
//   a positive value never takes the code 0 (its smallest positive code
//   instead); int4 k/16 for k = 1..16 (torchao's), which has no zero. So a
//   second moment never reads back as 0 where it was positive: sqrt(v)
//   cannot vanish under a first moment with mass.
//
//   bf16: each element rounded to bfloat16 (to nearest, ties to even, as
//   c10's round_to_nearest_even; a NaN becomes 0x7FC0), two
//   bytes an element, no scales and no blocks: every tensor of a rule's
//   quantizable state, whatever its size, and any piece of it.
//
// A block's scale is max |x| over its elements; element x takes the code
// nearest to x / scale (fp32 division), ties to the lower code. A block
// whose scale is not finite reads back as NaN. Blocks are counted from the
// first element of the whole tensor, so a piece of a tensor that starts on a
// block boundary quantizes exactly as the whole tensor does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "distopt/core/flat.hpp"

namespace distopt::quant {

enum class StateDType : std::uint8_t { f32, bf16, int8, int4 };
std::string_view name_of(StateDType d);
std::optional<StateDType> parse_state_dtype(std::string_view name);
// "f32, bf16, int8, int4"
std::string_view state_dtype_names();

// Tensors with fewer elements (of the whole tensor, whatever piece a rank
// holds) keep fp32 state under int8 and int4, as bitsandbytes'
// min_8bit_size.
inline constexpr std::size_t kMinElements = kLargeParamElements;
// The smallest tensor (whole) whose state d keeps: kMinElements for the
// block-scaled storages, 1 for bf16.
std::size_t min_elements(StateDType d);
// Whether d keeps block scales (int8, int4; not f32 or bf16).
bool has_scales(StateDType d);
// The largest block: sharded layouts place pieces on multiples of it, and
// models place their tensors of kMinElements or more on it
// (include/distopt/core/flat.hpp).
inline constexpr std::size_t kMaxBlock = kLargeParamAlign;

// A quantized state tensor's block scales sit beside its values under its
// key with this suffix, in state_dict() and in checkpoints ("exp_avg.absmax").
inline constexpr std::string_view kAbsmaxSuffix = ".absmax";

// Elements per scale (1 for bf16, which has none: pieces may start anywhere).
std::size_t block_of(StateDType d);
// Bytes of codes and number of scales for n elements (no scales for bf16).
std::size_t code_bytes(StateDType d, std::size_t n);
std::size_t num_blocks(StateDType d, std::size_t n);

// The sorted code values of a book (256 or 16 of them; int8, int4).
std::span<const float> code_book(StateDType d, bool is_signed);

// bfloat16's bits of x as torch rounds them, and back.
std::uint16_t to_bf16(float x);
float from_bf16(std::uint16_t b);

// n elements of value 0: the zero code and scales of 0.
void fill_zero(StateDType d, bool is_signed, std::uint8_t* codes, float* absmax, std::size_t n);
// The codes of one block of n <= block_of(d) elements, written from element
// 0 of `codes` (which must be a block boundary), and its scale.
void quantize_block(StateDType d, bool is_signed, const float* x, std::size_t n, std::uint8_t* codes, float* absmax);
// The block's values back: code * absmax, in fp32.
void dequantize_block(StateDType d, bool is_signed, const std::uint8_t* codes, float absmax, std::size_t n, float* out);
// The codes of values saved as code * absmax (a load of state_dict's
// values and scales): false when a value is not exactly code * absmax for
// any code of the book.
bool requantize_block(StateDType d, bool is_signed, const float* x, std::size_t n, float absmax, std::uint8_t* codes);

// The code of q (x / scale, not NaN) in a book: the reference search
// (binary search, the nearest code, ties to the lower, never code 0 for a
// positive q in a book whose code 0 is zero) and the table search the
// quantizer uses, which must give the same code for every q (tests).
std::uint8_t reference_nearest(StateDType d, bool is_signed, float q);
std::uint8_t fast_nearest(StateDType d, bool is_signed, float q);

// Whole tensors of n elements, a block at a time from element 0 (whose
// codes start at `codes`, whose scales at `absmax`). requantize returns the
// first block whose values are not exactly codes times its scale, or -1
// (codes of the blocks before it are written).
void quantize(StateDType d, bool is_signed, const float* x, std::size_t n, std::uint8_t* codes, float* absmax);
void dequantize(StateDType d, bool is_signed, const std::uint8_t* codes, const float* absmax, std::size_t n,
                float* out);
long requantize(StateDType d, bool is_signed, const float* x, std::size_t n, const float* absmax, std::uint8_t* codes);

// What `count` saved block scales beside n saved values are: this
// storage's (the values load as the same codes), the other storage's (int8
// scales into int4 state: the values are quantized afresh; any scales into
// bf16 state, which keeps none: the values are rounded), or a count no
// storage has (a load refuses it). The one rule of every load: C++
// state_dict, checkpoints, Python.
enum class SavedScales : std::uint8_t { this_storage, other_storage, misfit };
SavedScales classify_scales(StateDType d, std::size_t n, std::size_t count);

// n saved values (state_dict's code * scale) into codes and scales. With
// `scales` (this storage's, classify_scales) each value must be exactly its
// code times its block's scale: the first block that is not is returned and
// nothing is written. Without (nullptr) the values are quantized afresh.
// -1: loaded.
long load(StateDType d, bool is_signed, const float* values, std::size_t n, const float* scales, std::uint8_t* codes,
          float* absmax);

}  // namespace distopt::quant
