// libFuzzer target: a replay case (JSON) -- parse_case, then run it when it
// is small. A clean distopt::Error is the expected answer to bad input;
// anything else that escapes (std::out_of_range, bad_alloc, a crash, a
// sanitizer report) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "distopt/core/error.hpp"
#include "distopt/replay/replay.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const distopt::replay::Case c = distopt::replay::parse_case(text, "fuzz.json");
    std::size_t work = 0;
    for (const auto& p : c.params) work += p.size();
    if (work * (c.steps.size() + 1) <= (1u << 16)) (void)distopt::replay::run(c);
  } catch (const distopt::Error&) {
  }
  return 0;
}
