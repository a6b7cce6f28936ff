// Reading JSON from outside (a checkpoint manifest, its run state) without
// undefined behaviour (not installed). nlohmann's operator[] on a const
// object with a missing key is undefined behaviour (its documentation says
// so; a crafted manifest reached it), so readers take members through
// member(), which gives a null value for a missing key or a non-object.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace distopt::checkpoint::detail {

inline const nlohmann::json& member(const nlohmann::json& j, const std::string& key) {
  static const nlohmann::json kNull;
  if (!j.is_object()) return kNull;
  const auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

}  // namespace distopt::checkpoint::detail
