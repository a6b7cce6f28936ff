// The verbs of the `distopt` command-line tool (spec/cli-contract.md).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>
#include <string>

namespace distopt::cli {

// Each verb adds its subcommand to the app and returns the function that
// runs it (returning the process exit status).
using Runner = std::function<int()>;

// A validator that refuses a leading minus with "must be a non-negative
// <kind> (got -5)": CLI11 would wrap a negative into a huge unsigned number,
// and its range validators print their bound, 1.8e308, in 300 digits. Text
// that is not a number is left to the conversion's own error.
inline CLI::Validator non_negative(const std::string& kind) {
  return CLI::Validator(
      [kind](std::string& v) -> std::string {
        return !v.empty() && v[0] == '-' ? "must be a non-negative " + kind + " (got " + v + ")" : std::string();
      },
      "X>=0");
}
// An error message as one printable line: control characters and other
// bytes below 0x20 (from file names or option values) are written \xNN.
inline std::string printable(const char* what) {
  std::string out;
  for (const char* p = what; *p != 0; ++p) {
    const auto c = static_cast<unsigned char>(*p);
    if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

Runner add_replay(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_train(CLI::App& app);

}  // namespace distopt::cli
