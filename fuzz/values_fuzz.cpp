// libFuzzer target: the single-value parsers of outside input -- a
// time-out (--comm-timeout, DISTOPT_COMM_TIMEOUT), a bandwidth
// (--link-bandwidth, bench gossip --bandwidths), a size (bench memory
// --cap) -- and gossip topologies
// built from a fuzzed name, world size and peer count, whose peers are then
// asked for; optimizer options from one string (parse_options, for the rule
// the first byte picks) and the command line's --scheduler-option
// KEY=VALUE items (split at ';'); a launcher's environment (srun's,
// torchrun's: launch_env over NAME=VALUE lines) and a SLURM node list.
// Only distopt::Error may escape as an answer.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../tools/commands.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/comm/launch_env.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/topology.hpp"
#include "distopt/optim/option_text.hpp"
#include "distopt/optim/rule.hpp"
#include "distopt/optim/scheduler.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 3, size - 3);
  try {
    (void)distopt::Communicator::parse_timeout(text, "--comm-timeout");
  } catch (const distopt::Error&) {
  }
  try {
    (void)distopt::cli::parse_bandwidth("--link-bandwidth", text);
  } catch (const distopt::Error&) {
  }
  try {
    (void)distopt::cli::parse_size("--cap", text);
  } catch (const distopt::Error&) {
  }
  try {
    // World 1..256, peers -2..125: names from the input's text.
    const int world = 1 + data[0];
    const int peers = static_cast<int>(data[1] % 128) - 2;
    const distopt::gossip::Topology t(text, world, peers);
    const std::uint64_t k = data[2];
    for (int r = 0; r < world; r += 1 + world / 8) (void)t.peers(r, k);
    (void)t.predicted_rate();
  } catch (const distopt::Error&) {
  }
  try {
    const auto rules = distopt::all_rules();
    (void)distopt::parse_options(*rules[data[0] % rules.size()], text);
  } catch (const distopt::Error&) {
  }
  try {
    std::vector<std::string> items;
    for (std::size_t at = 0;;) {
      const std::size_t end = text.find(';', at);
      items.push_back(text.substr(at, end == std::string::npos ? std::string::npos : end - at));
      if (end == std::string::npos) break;
      at = end + 1;
    }
    (void)distopt::scheduler_spec_from_options("steplr", items);
  } catch (const distopt::Error&) {
  }
  try {
    (void)distopt::first_host(text);
  } catch (const distopt::Error&) {
  }
  try {
    // NAME=VALUE lines; a name not among them is unset.
    std::vector<std::pair<std::string, std::string>> env;
    for (std::size_t at = 0; at < text.size();) {
      std::size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(at, end - at);
      const std::size_t eq = line.find('=');
      if (eq != std::string::npos) env.emplace_back(line.substr(0, eq), line.substr(eq + 1));
      at = end + 1;
    }
    (void)distopt::launch_env([&](const char* name) -> const char* {
      for (const auto& [k, v] : env)
        if (k == name) return v.c_str();
      return nullptr;
    });
  } catch (const distopt::Error&) {
  }
  return 0;
}
