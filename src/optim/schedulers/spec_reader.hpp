// Reading a scheduler spec from a JSON value with core's JsonReader (not
// installed): spec.cpp's parse_scheduler_spec reads a whole text with it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "../../core/json_reader.hpp"
#include "distopt/optim/scheduler.hpp"

namespace distopt {

// A scheduler spec from its JSON value (spec.cpp).
SchedulerSpec read_scheduler_spec(const JsonReader& r, const nlohmann::json& v, const std::string& where,
                                  int depth = 0);

}  // namespace distopt
