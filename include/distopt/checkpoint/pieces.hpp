// Pieces of named tensors, as each rank of a sharded run holds them, and
// the whole tensors they make up: the data movement of resharding (a
// checkpoint saved at one world size and strategy, loaded at another).
#pragma once

#include <cstdint>
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

// Pieces as safetensors tensors (1-D, named as the tensor) with their
// place in `__metadata__` ("distopt-piece:NAME": "BEGIN:D0,D1,..."), and
// back. A file of pieces holds at most one piece per tensor.
NamedTensors to_safetensors(std::span<const Piece> pieces);
// InvalidInput names the file (`path`) and the tensor whose place is
// missing or does not fit its shape.
std::vector<Piece> pieces_of(const NamedTensors& file, const std::string& path);

}  // namespace distopt::checkpoint
