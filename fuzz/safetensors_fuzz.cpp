// libFuzzer target: safetensors files as checkpoints and --export-params
// hold them (parse_safetensors, behind read_safetensors), then the pieces
// a checkpoint's rank file carries (pieces_of) assembled into whole
// tensors; the same bytes as a rank file a resume reads a range at a
// time (PieceFiles over a memory file: its header, its places, every
// tensor read whole, the same values as assembled); and as a checkpoint
// manifest (parse_manifest). Only distopt::Error may escape as an answer;
// every tensor read must lie in the data it claims.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/source.hpp"
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
  // The same bytes as a rank file read a range at a time.
  static const int fd = ::memfd_create("fuzz.safetensors", 0);
  if (fd >= 0 && ::ftruncate(fd, 0) == 0 && ::pwrite(fd, data, size, 0) == static_cast<ssize_t>(size)) {
    std::map<std::string, std::vector<float>> assembled;
    try {
      const auto t = distopt::checkpoint::parse_safetensors(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), "fuzz.safetensors");
      for (auto& [name, whole] : distopt::checkpoint::assemble(distopt::checkpoint::pieces_of(t, "fuzz.safetensors")))
        assembled[name] = std::move(whole.values);
    } catch (const distopt::Error&) {
    }
    try {
      const distopt::checkpoint::PieceFiles files({"/proc/self/fd/" + std::to_string(fd)});
      for (const std::string& name : files.names()) {
        const std::vector<float> whole = files.whole(name);
        // A file PieceFiles takes is one assemble takes, with the same values.
        const auto it = assembled.find(name);
        if (it == assembled.end() || it->second.size() != whole.size() ||
            std::memcmp(it->second.data(), whole.data(), whole.size() * sizeof(float)) != 0)
          __builtin_trap();
      }
    } catch (const distopt::Error&) {
    }
  }
  try {  // the same bytes as a checkpoint manifest
    (void)distopt::checkpoint::parse_manifest(std::string(reinterpret_cast<const char*>(data), size), "fuzz: ");
  } catch (const distopt::Error&) {
  }
  return 0;
}
