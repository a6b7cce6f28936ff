// libFuzzer target: safetensors files as checkpoints and --export-params
// hold them (parse_safetensors, behind read_safetensors), then the pieces
// a checkpoint's rank file carries (pieces_of) assembled into whole
// tensors; and the same bytes as a checkpoint manifest (parse_manifest).
// Only distopt::Error may escape as an answer; every tensor read must lie
// in the data it claims.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto t = distopt::checkpoint::parse_safetensors(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), "fuzz.safetensors");
    for (const auto& s : t.slots)
      if (s.offset + s.numel() > t.data.size()) __builtin_trap();
    const auto pieces = distopt::checkpoint::pieces_of(t, "fuzz.safetensors");
    for (const auto& [name, whole] : distopt::checkpoint::assemble(pieces))
      if (whole.values.size() != static_cast<std::size_t>(distopt::numel(whole.shape))) __builtin_trap();
  } catch (const distopt::Error&) {
  }
  try {  // the same bytes as a checkpoint manifest
    (void)distopt::checkpoint::parse_manifest(std::string(reinterpret_cast<const char*>(data), size), "fuzz: ");
  } catch (const distopt::Error&) {
  }
  return 0;
}
