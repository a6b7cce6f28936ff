// libFuzzer target: a run's state as bytes, as a rank that joins a run
// receives it from rank 0 (checkpoint::from_bytes), then written back and
// read again: the second reading must give the same bytes. Only
// distopt::Error may escape as an answer.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "distopt/checkpoint/survival.hpp"
#include "distopt/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto state = distopt::checkpoint::from_bytes(std::span(reinterpret_cast<const char*>(data), size));
    const std::vector<char> once = distopt::checkpoint::to_bytes(state);
    if (distopt::checkpoint::to_bytes(distopt::checkpoint::from_bytes(once)) != once) __builtin_trap();
  } catch (const distopt::Error&) {
  }
  return 0;
}
