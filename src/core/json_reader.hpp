// Reading JSON documents with one-line errors, "SOURCE: WHERE: WHAT" (not
// installed): the scheduler specs of src/optim/schedulers/spec.cpp and the
// replay cases of src/replay/replay.cpp (docs/formats.md, "distopt replay").
// Numbers may also be the strings of NaN and the infinities, which JSON
// cannot write. An internal interface of core for optim and replay
// (docs/architecture.md, "Layers").
#pragma once

#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "distopt/core/error.hpp"

namespace distopt {

class JsonReader {
 public:
  using json = nlohmann::json;

  explicit JsonReader(std::string_view source) : source_(source) {}

  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    throw InvalidInput(str(source_, ": ", where, ": ", what));
  }

  const json& member(const json& obj, const char* key, const std::string& where) const {
    if (!obj.is_object()) fail(where, "must be an object");
    auto it = obj.find(key);
    if (it == obj.end()) fail(where, str("missing member '", key, "'"));
    return *it;
  }

  double number(const json& v, const std::string& where) const {
    if (v.is_number()) return v.get<double>();
    if (v.is_string()) {  // JSON has no NaN/Infinity literals
      const auto& s = v.get_ref<const std::string&>();
      if (s == "NaN" || s == "nan") return std::numeric_limits<double>::quiet_NaN();
      if (s == "Infinity" || s == "inf") return std::numeric_limits<double>::infinity();
      if (s == "-Infinity" || s == "-inf") return -std::numeric_limits<double>::infinity();
    }
    fail(where, str("expected a number, got ", v.dump()));
  }

 private:
  std::string_view source_;
};

}  // namespace distopt
