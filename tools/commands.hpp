// The verbs of the `distopt` command-line tool (spec/cli-contract.md).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace distopt::cli {

// Each verb adds its subcommand to the app and returns the function that
// runs it (returning the process exit status).
using Runner = std::function<int()>;
Runner add_replay(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_train(CLI::App& app);

}  // namespace distopt::cli
