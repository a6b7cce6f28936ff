// safetensors files (the Hugging Face format torch users load with
// safetensors.torch.load_file): an 8-byte little-endian header length, a
// JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the tensors' bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "distopt/core/flat.hpp"

namespace distopt::checkpoint {

struct NamedTensors {
  std::vector<ParamSlot> slots;  // offsets into data
  std::vector<float> data;
  std::map<std::string, std::string> metadata;
};

// Writes F32 tensors atomically: to PATH.tmp.<pid>, then renamed over PATH,
// so an existing file is never left half-written.
void write_safetensors(const std::string& path, const NamedTensors& tensors);
// The file's bytes.
std::vector<std::byte> safetensors_bytes(const NamedTensors& tensors);
// The start of a file whose F32 tensors are `slots`, packed in their order
// from the data's first byte (the slots' offsets are not read): the 8-byte
// header length and the header, padded so that the data is 8-aligned. The
// tensors' bytes follow it (a checkpoint streams them from where they live).
std::vector<std::byte> safetensors_head(std::span<const ParamSlot> slots,
                                        const std::map<std::string, std::string>& metadata);
// Reads a file of F32 tensors; InvalidInput names what is malformed. Sizes
// in the header are checked against the file before anything is allocated.
NamedTensors read_safetensors(const std::string& path);
// Only its header, checked the same way: the slots index the data region
// as floats, and the data region starts at byte `data_start` of the file
// (a reader then reads the ranges it needs).
struct SafetensorsHeader {
  std::vector<ParamSlot> slots;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;
};
SafetensorsHeader read_safetensors_header(const std::string& path);
// The same for a file's bytes (`path` names it in errors).
NamedTensors parse_safetensors(std::span<const std::byte> file, const std::string& path);

}  // namespace distopt::checkpoint
