// libFuzzer target: a checkpoint manifest's run state (the groups' options,
// the schedulers', the loss scaler's, the averaging count, a gossip run's
// per-rank numbers) as --resume reads it (checkpoint::parse_run_state),
// then written back and read again: the second reading must give the same
// JSON. Only distopt::Error may escape as an answer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distopt/checkpoint/run_state.hpp"
#include "distopt/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto state =
        distopt::checkpoint::parse_run_state(std::string_view(reinterpret_cast<const char*>(data), size));
    const std::string once = distopt::checkpoint::run_state_json(state);
    if (distopt::checkpoint::run_state_json(distopt::checkpoint::parse_run_state(once)) != once) __builtin_trap();
  } catch (const distopt::Error&) {
  }
  return 0;
}
