// Pieces of named tensors, as each rank of a sharded run holds them, and
// the whole tensors they make up: the data movement of resharding (a
// checkpoint saved at one world size and strategy, loaded at another).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/core/tensor.hpp"

namespace distopt::checkpoint {

// Elements [begin, begin + values.size()) of the row-major tensor `name`
// of shape `shape`.
struct Piece {
  std::string name;
  Shape shape;
  std::uint64_t begin = 0;
  std::vector<float> values;
};

struct Whole {
  Shape shape;
  std::vector<float> values;
};

// The whole tensors the pieces make up (any order, from any number of
// files). Each tensor's pieces must agree on its shape and cover every
// element; an element held by several pieces (a replicated tensor) must
// have the same bits in each. InvalidInput names the tensor and the gap,
// the disagreement or the shapes; sizes are checked before allocating.
std::map<std::string, Whole> assemble(std::span<const Piece> pieces);

// Pieces to be written, viewed where they live (a rank's parameters and
// optimizer state), with the values that had to be computed for them
// (gossip means, scalars) kept in the set. What the views point at must
// outlive the set's use.
struct PieceView {
  std::string name;
  Shape shape;
  std::uint64_t begin = 0;
  std::span<const float> values;
};
class PieceSet {
 public:
  PieceSet() = default;
  // Moved, never copied: a copy's views would point into the original.
  PieceSet(PieceSet&&) = default;
  PieceSet& operator=(PieceSet&&) = default;
  PieceSet(const PieceSet&) = delete;
  PieceSet& operator=(const PieceSet&) = delete;
  void view(std::string name, Shape shape, std::uint64_t begin, std::span<const float> values);
  // Keeps `values` in the set; the span stays valid while the set lives.
  std::span<const float> keep(std::vector<float> values);
  void add(std::string name, Shape shape, std::uint64_t begin, std::vector<float> values);
  void append(PieceSet&& other);
  std::span<const PieceView> pieces() const { return pieces_; }
  std::vector<Piece> copies() const;

 private:
  std::vector<PieceView> pieces_;
  std::deque<std::vector<float>> kept_;
};

// Pieces as a safetensors file: each a 1-D tensor named as its tensor,
// with its place in `__metadata__` ("distopt-piece:NAME":
// "BEGIN:D0,D1,..."). The file is handed to `out` in order -- the header,
// then each piece's values from where they are -- so that no copy of the
// whole is made. A file of pieces holds at most one piece per tensor.
void write_pieces(const PieceSet& pieces, const std::function<void(std::span<const std::byte>)>& out);
std::vector<std::byte> pieces_bytes(const PieceSet& pieces);
// Where a file's tensor `slot` lies in the whole tensor it is a piece of
// (its "distopt-piece:" metadata): the whole's shape and the piece's first
// element. InvalidInput names the file (`path`) and the tensor whose place
// is missing, malformed or does not fit its shape.
struct Place {
  Shape shape;
  std::uint64_t begin = 0;
};
Place place_of(const std::map<std::string, std::string>& metadata, const ParamSlot& slot, const std::string& path);
// The most elements a tensor of a checkpoint may have (2^40: 4 TiB of
// floats), so that no product of dimensions overflows; and numel(shape),
// or kMaxElements + 1 when it is above that.
inline constexpr std::uint64_t kMaxElements = std::uint64_t{1} << 40;
std::uint64_t elements_of(const Shape& shape);
// And back: the pieces of a file read whole.
// InvalidInput names the file (`path`) and the tensor whose place is
// missing or does not fit its shape.
std::vector<Piece> pieces_of(const NamedTensors& file, const std::string& path);

}  // namespace distopt::checkpoint
