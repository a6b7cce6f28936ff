// Run configuration files: a command's flags as one JSON object, as
// DeepSpeed and FairScale users keep their runs in config files.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace distopt::cli {

// Adds `--config FILE` to `command`, storing the name in `path`. The file
// is a JSON object whose keys are the long flag names (with or without the
// leading dashes, `-` or `_` alike), whose values are numbers, strings,
// booleans (flags), arrays (lists) or objects (JSON-valued flags such as
// --scheduler).
void add_config_file(CLI::App& command, std::string& path);

// After parsing: applies the file's flags that the command line did not
// give. An unknown key, a bad value or a malformed file is one error naming
// it, before any flag is applied.
void apply_config_file(CLI::App& command, const std::string& path);
// The same for the file's text (`path` names it in errors).
void apply_config_text(CLI::App& command, const std::string& text, const std::string& path);

// The effective configuration of `command` after parsing, in the format
// --config reads: every flag given on the command line or in the file, and
// every other flag that has a default.
std::string effective_config(const CLI::App& command);

}  // namespace distopt::cli
