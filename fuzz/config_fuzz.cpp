// libFuzzer target: run configuration files (distopt train --config). The
// fuzzed text is applied to a command with every kind of flag train has --
// numbers with validators, a list with a delimiter, a repeatable list, a
// flag, a negated flag, a function-valued option, a JSON-valued string --
// and the effective configuration is printed and read back. Only
// distopt::Error may escape as an answer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../tools/run_config.hpp"
#include "distopt/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto make = [](CLI::App& app, std::string& config) {
    static int epochs;
    static double lr;
    static std::vector<std::size_t> hidden;
    static std::vector<std::string> repeated;
    static bool json, flush;
    static std::string scheduler, option;
    app.add_option("--epochs", epochs)->check(CLI::NonNegativeNumber);
    app.add_option("--lr", lr);
    app.add_option("--hidden", hidden)->delimiter(',');
    app.add_option("--scheduler-option", repeated);
    app.add_flag("--json", json);
    app.add_flag("!--keep-denormals", flush);
    app.add_option("--scheduler", scheduler);
    app.add_option_function<std::string>("--ns-coefficients,--ns_coefficients", [](const std::string& v) { option = v; });
    distopt::cli::add_config_file(app, config);
  };
  try {
    CLI::App first("fuzz"), second("fuzz");
    std::string c1, c2;
    make(first, c1);
    make(second, c2);
    first.parse(std::vector<std::string>{});
    distopt::cli::apply_config_text(first, text, "fuzz.json");
    const std::string printed = distopt::cli::effective_config(first);
    second.parse(std::vector<std::string>{});
    distopt::cli::apply_config_text(second, printed, "printed.json");
    if (distopt::cli::effective_config(second) != printed) __builtin_trap();  // the printed form reads back as itself
  } catch (const distopt::Error&) {
  }
  return 0;
}
