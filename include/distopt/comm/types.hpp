// Element types, reduction operators and errors of the communication layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"

namespace distopt {

enum class ElemType : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8 };
enum class ReduceOp : std::uint8_t { sum, avg, max, min };

constexpr std::size_t size_of(ElemType t) {
  switch (t) {
    case ElemType::f64:
    case ElemType::i64: return 8;
    case ElemType::f32:
    case ElemType::i32: return 4;
    case ElemType::bf16:
    case ElemType::f16: return 2;
    case ElemType::u8: return 1;
  }
  return 0;
}
std::string_view name_of(ElemType t);
std::string_view name_of(ReduceOp op);
bool parse_elem_type(std::string_view s, ElemType* out);
constexpr ElemType elem_type_of(DType t) {
  return t == DType::f32 ? ElemType::f32 : (t == DType::bf16 ? ElemType::bf16 : ElemType::f16);
}
constexpr bool is_floating(ElemType t) {
  return t == ElemType::f32 || t == ElemType::f64 || t == ElemType::bf16 || t == ElemType::f16;
}

// A communication failure: a peer's error, a broken transport, a backend
// error. The communicator cannot be used afterwards.
class CommError : public Error {
 public:
  using Error::Error;
};
// A blocking wait passed the communicator's timeout. The message names the
// operation and the peer(s) that did not answer.
class CommTimeout : public CommError {
 public:
  using CommError::CommError;
};
// spawn(): a rank did not return after the world aborted and was left
// running (detached). Memory it may still use must not be freed: a program
// should report and end the process without unwinding (std::_Exit).
class RanksAbandoned : public CommError {
 public:
  using CommError::CommError;
};
// Another rank failed; this rank was woken from a wait.
class CommAborted : public CommError {
 public:
  using CommError::CommError;
};
// A world that goes on without its lost ranks (spawn's Elastic::on): a
// rank of this group failed or fell silent past the time-out. The group is
// broken; the survivors re-form one with Communicator::shrink().
class RankLost : public CommError {
 public:
  using CommError::CommError;
};

// The piece of `count` elements that rank r of n owns in collectives that
// split a buffer (all_reduce's reduce-scatter phase): n contiguous pieces,
// the first count % n of them one element longer.
struct Piece {
  std::size_t offset, count;
};
constexpr Piece piece_of(std::size_t count, int n, int r) {
  const std::size_t base = count / n, extra = count % n, ur = static_cast<std::size_t>(r);
  return {ur * base + (ur < extra ? ur : extra), base + (ur < extra ? 1 : 0)};
}

// Start of each rank's piece when rank r holds counts[r] elements, plus the
// total at the end (size n + 1).
std::vector<std::size_t> offsets_of(std::span<const std::size_t> counts);

// out[i] = op(inputs[0][i], inputs[1][i], ..., inputs[n-1][i]) for i < count,
// combining in rank order: ((x0 + x1) + x2) + ... . bf16/f16 accumulate in
// fp32 and round once at the end; avg divides the sum by n (floating types
// only). `out` may alias any input. Both backends call this one function,
// which is what makes their results bitwise identical.
void reduce_ordered(const void* const* inputs, int n, void* out, std::size_t count, ElemType type, ReduceOp op);

}  // namespace distopt
