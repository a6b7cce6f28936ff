// Run configuration files (see run_config.hpp). CLI11 reads its own config
// files for the main command only, so a subcommand's file is applied here,
// after parsing: each key to the flag of that name, unless the command line
// gave the flag already, through the flag's own validators and callbacks.
#include "run_config.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>

#include "distopt/core/error.hpp"

namespace distopt::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::size_t kMaxConfigBytes = 16u << 20;

// The flags a configuration does not carry: asking for help, the file
// itself, the printing of it, and --resume (a run saved with it would
// resume again).
bool carried(const CLI::Option& opt) {
  const std::string& name = opt.get_name();
  return name != "--help" && name != "--config" && name != "--print-config" && name != "--resume" &&
         !opt.get_lnames().empty();
}

// A key as the flag it names: "--weight-decay", "weight_decay" and
// "weight-decay" alike.
CLI::Option* flag_of(CLI::App& app, std::string key) {
  key.erase(0, key.find_first_not_of('-'));
  for (const std::string& spelling : {key, [&] {
                                        std::string s = key;
                                        std::replace(s.begin(), s.end(), '_', '-');
                                        return s;
                                      }()}) {
    CLI::Option* opt = app.get_option_no_throw("--" + spelling);
    if (opt != nullptr && carried(*opt)) return opt;
  }
  return nullptr;
}

std::string scalar_text(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  return v.dump();
}

// TEXT (from `path`) as one JSON object of flags.
Json parse_object(const std::string& text, const std::string& path) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    std::string what = e.what();
    what.erase(0, what.find(' ') + 1);  // drop nlohmann's "[json.exception.parse_error.101]"
    throw InvalidInput("--config: " + path + " is not valid JSON: " + what);
  }
  if (!j.is_object())
    throw InvalidInput("--config: " + path + " must hold one JSON object of flags, like {\"lr\": 0.01}");
  return j;
}

// A value as the flag's inputs: a list for a flag of one value
// (--ns-coefficients 1,2,3) is that value written with commas, for a list
// flag its items; an object is its JSON text (--scheduler).
std::vector<std::string> inputs_of(const CLI::Option& opt, const std::string& key, const Json& value) {
  if (value.is_null()) throw InvalidInput("--config: key '" + key + "' is null; leave it out instead");
  if (value.is_object()) return {value.dump()};
  if (!value.is_array()) return {scalar_text(value)};
  std::vector<std::string> parts;
  for (const Json& v : value) {
    if (v.is_structured()) throw InvalidInput("--config: key '" + key + "' holds a nested list or object");
    parts.push_back(scalar_text(v));
  }
  if (opt.get_items_expected_max() > 1) return parts;
  std::string joined;
  for (const std::string& p : parts) joined += (joined.empty() ? "" : ",") + p;
  return {joined};
}

// A flag's text as JSON: a number when it reads as one, true/false for a
// flag, an object for a JSON-valued flag, else the string.
Json value_of(const std::string& text, bool is_flag) {
  if (is_flag && (text == "true" || text == "false")) return text == "true";
  if (!text.empty() && (text.front() == '{' || text.front() == '[')) {
    Json j = Json::parse(text, nullptr, false);
    if (!j.is_discarded()) return j;
  }
  try {
    std::size_t used = 0;
    const double d = std::stod(text, &used);
    if (used == text.size() && std::isfinite(d)) {
      const Json j = Json::parse(text, nullptr, false);  // keeps 3 an integer and 0.1 as written
      return j.is_discarded() ? Json(d) : j;
    }
  } catch (const std::exception&) {
  }
  return text;
}

}  // namespace

void add_config_file(CLI::App& command, std::string& path) {
  command.add_option("--config", path,
                     "read flags from a JSON file, {\"lr\": 0.01, \"strategy\": \"zero2\", ...}, keys the long "
                     "flag names; flags on the command line override it");
}

void apply_config_file(CLI::App& command, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidInput("--config: cannot read " + path);
  std::string text;
  char buffer[65536];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    text.append(buffer, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxConfigBytes)
      throw InvalidInput("--config: " + path + " is larger than 16 MiB; a run configuration is a small JSON object");
  }
  apply_config_text(command, text, path);
}

void apply_config_text(CLI::App& command, const std::string& text, const std::string& path) {
  const Json j = parse_object(text, path);
  // Check every key before applying any.
  std::vector<std::pair<CLI::Option*, std::vector<std::string>>> todo;
  for (const auto& [key, value] : j.items()) {
    CLI::Option* opt = flag_of(command, key);
    if (opt != nullptr && opt->get_expected_min() == 0 && !value.is_boolean())
      throw InvalidInput("--config: key '" + key + "' in " + path + " is a flag: its value is true or false");
    if (opt == nullptr)
      throw InvalidInput("--config: unknown key '" + key + "' in " + path + " (keys are the long flag names of distopt " +
                                 command.get_name() + ", e.g. \"lr\" for --lr)");
    todo.emplace_back(opt, inputs_of(*opt, key, value));
  }
  for (auto& [opt, inputs] : todo) {
    if (opt->count() > 0) continue;  // the command line wins
    try {
      if (opt->get_expected_min() == 0) opt->add_result(opt->get_flag_value(opt->get_lnames().front(), inputs.front()));
      else opt->add_result(inputs);
      opt->run_callback();  // the flag's validators and callbacks, as on the command line
    } catch (const CLI::ParseError& e) {
      throw InvalidInput(std::string(e.what()) + " (from --config " + path + ")");
    }
  }
}

std::string effective_config(const CLI::App& command) {
  Json out = Json::object();
  for (const CLI::Option* opt : command.get_options()) {
    if (!carried(*opt)) continue;
    const std::string key = opt->get_lnames().front();
    const bool is_flag = opt->get_expected_min() == 0;
    std::vector<std::string> texts;
    if (opt->count() > 0) {
      texts = opt->results();
      // A flag as given: true when its result is what "true" gives (for
      // !--keep-denormals that is the stored false).
      if (is_flag) texts = {texts.back() == opt->get_flag_value(key, "true") ? "true" : "false"};
    } else if (!opt->get_default_str().empty()) {
      texts = {opt->get_default_str()};
    } else {
      continue;
    }
    if (opt->get_items_expected_max() > 1 && (texts.size() > 1 || opt->count() > 0)) {
      Json list = Json::array();
      for (const std::string& t : texts) list.push_back(value_of(t, false));
      out[key] = list;
    } else {
      out[key] = value_of(texts.back(), is_flag);
    }
  }
  return out.dump(2) + "\n";
}

}  // namespace distopt::cli
