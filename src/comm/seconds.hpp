// How the communicators write a duration in their messages ("timed out
// after 1.5 s"): private to src/comm (the backends and the TCP store).
#pragma once

#include <chrono>
#include <string>

#include "distopt/core/error.hpp"

namespace distopt::comm_detail {

// Hidden from libdistopt.so, like the rest of src/comm's internals.
__attribute__((visibility("hidden"))) inline std::string seconds(std::chrono::milliseconds t) {
  return str(static_cast<double>(t.count()) / 1000.0, " s");
}

}  // namespace distopt::comm_detail
