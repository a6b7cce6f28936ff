// The verbs of the `distopt` command-line tool (docs/formats.md).
#pragma once

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>

#include "distopt/core/error.hpp"

namespace distopt::cli {

// Each verb adds its subcommand to the app and returns the function that
// runs it (returning the process exit status).
using Runner = std::function<int()>;

// A validator that refuses a leading minus with "must be a non-negative
// <kind> (got -5)": CLI11 would wrap a negative into a huge unsigned number,
// and its range validators print their bound, 1.8e308, in 300 digits. Text
// that is not a number is left to the conversion's own error.
// Whole numbers of more than 19 digits are refused as too large (CLI11
// would saturate them into the largest value silently).
inline CLI::Validator non_negative(const std::string& kind) {
  return CLI::Validator(
      [kind](std::string& v) -> std::string {
        if (!v.empty() && v[0] == '-') return "must be a non-negative " + kind + " (got " + v + ")";
        const auto digits = v.find_first_not_of('0');
        if (kind == "integer" && v.find_first_not_of("0123456789") == std::string::npos && digits != std::string::npos &&
            v.size() - digits > 19)
          return "is too large (got " + v + ")";
        return {};
      },
      "X>=0");
}

// An option given with an empty value ("--seed ''"), which CLI11 would
// otherwise take as not given.
inline CLI::Validator non_empty() {
  return CLI::Validator([](std::string& v) -> std::string { return v.empty() ? "needs a value (got an empty one)" : ""; },
                        "VALUE");
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

// Resident memory of process `pid` (0: this one) from /proc; 0 where it
// cannot be read (the process has ended).
inline std::uint64_t resident_bytes(long pid = 0) {
  const std::string path = pid == 0 ? "/proc/self/statm" : "/proc/" + std::to_string(pid) + "/statm";
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int got = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return got == 2 ? resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

// A float for JSON output: %.9g, or null where it is NaN or infinite (a
// diverged run, a figure not measured), which JSON cannot spell.
inline std::string jnum(double v) {
  if (!std::isfinite(v)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

// A positive number with an optional one-letter suffix from `scales`
// ("100M"): the number times the suffix's scale; NaN when `text` is not one.
inline double parse_scaled(std::string digits, std::initializer_list<std::pair<char, double>> scales) {
  double scale = 1.0;
  for (const auto& [suffix, s] : scales)
    if (!digits.empty() && digits.back() == suffix) {
      scale = s;
      digits.pop_back();
      break;
    }
  std::size_t used = 0;
  double v = -1;
  try {
    v = std::stod(digits, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != digits.size() || !(v > 0)) return std::nan("");
  return v * scale;
}

// A bandwidth in bits per second: a number with an optional k, M or G
// (10^3, 10^6, 10^9), e.g. "100M"; "0" or "none": unshaped.
inline double parse_bandwidth(const std::string& flag, const std::string& text) {
  if (text == "none" || text == "0") return 0.0;
  const double v = parse_scaled(text, {{'k', 1e3}, {'M', 1e6}, {'G', 1e9}});
  if (!(v < 1e15))
    throw InvalidInput(flag + ": '" + text + "' is not a positive bandwidth in bits per second (e.g. 100M, 1G)");
  return v;
}

// A size in bytes: a number with an optional k, M, G or T, binary (as
// ulimit and cgroups count) and optionally followed by B or iB: "1G",
// "1536M", "2GiB", "4000000000".
inline std::uint64_t parse_size(const std::string& flag, const std::string& text) {
  std::string digits = text;
  for (const std::string suffix : {"iB", "B"})
    if (digits.size() > suffix.size() && digits.ends_with(suffix)) {
      digits.resize(digits.size() - suffix.size());
      break;
    }
  constexpr double k = 1024.0;
  const double v = parse_scaled(digits, {{'k', k}, {'K', k}, {'M', k * k}, {'G', k * k * k}, {'T', k * k * k * k}});
  if (!(v <= 1e18))
    throw InvalidInput(flag + " must be a positive size in bytes such as 1G, 1536M or 2GiB (got '" + text + "')");
  return static_cast<std::uint64_t>(v);
}

// After spawn() abandoned a stuck rank: one line, then the process ends
// without unwinding, since the rank may still use the memory unwinding
// would free. `cleanup` removes temporary files first.
[[noreturn]] inline void exit_abandoned(const std::exception& e, const std::function<void()>& cleanup = {}) {
  if (cleanup) cleanup();
  std::fprintf(stderr, "distopt: error: %s\n", printable(e.what()).c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(2);
}

Runner add_replay(CLI::App& app);
Runner add_bench(CLI::App& app);
// `bench memory` (bench_memory.cpp), a subcommand of `bench`: sets `run`
// to a function that runs it when parsed and returns -1 otherwise.
void add_bench_memory(CLI::App& bench, Runner& run);
Runner add_train(CLI::App& app);
Runner add_gossip(CLI::App& app);
Runner add_checkpoint(CLI::App& app);
Runner add_sample(CLI::App& app);

}  // namespace distopt::cli
