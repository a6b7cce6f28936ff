// Scheduler specs from text (include/distopt/optim/scheduler.hpp): the JSON
// form of the replay format, --scheduler and configuration files, and the
// command line's NAME plus KEY=VALUE options. Every error is one
// InvalidInput line naming where it is.
#include <cctype>

#include "distopt/core/error.hpp"
#include "distopt/optim/option_text.hpp"
#include "distopt/optim/scheduler.hpp"
#include "spec_reader.hpp"

namespace distopt {

using nlohmann::json;

// {"name": ..., "options": {...}, "schedulers": [...]} (options and
// schedulers optional); option values are numbers, booleans, strings or
// lists of numbers. The children may also sit inside the options, as
// torch's constructor argument: {"options": {"schedulers": [...], ...}}.
SchedulerSpec read_scheduler_spec(const JsonReader& r, const json& v, const std::string& where, int depth) {
  // Schedulers nest a few levels (SequentialLR of ChainedScheduler ...); a
  // spec nesting deeper is refused before the recursion could exhaust the
  // stack.
  constexpr int kMaxDepth = 64;
  if (depth > kMaxDepth) r.fail(where, str("schedulers nested deeper than ", kMaxDepth, " levels"));
  SchedulerSpec s;
  const json& name = r.member(v, "name", where);
  if (!name.is_string()) r.fail(where + ".name", "must be a string");
  s.name = name.get<std::string>();
  for (const auto& [key, value] : v.items())
    if (key != "name" && key != "options" && key != "schedulers") r.fail(where, str("unknown member '", key, "'"));
  if (const auto o = v.find("options"); o != v.end()) {
    if (!o->is_object()) r.fail(where + ".options", "must be an object");
    for (const auto& [key, value] : o->items()) {
      const std::string at = str(where, ".options.", key);
      if (value.is_null()) continue;  // torch's None: the default
      if (key == "schedulers" && value.is_array() && (value.empty() || value[0].is_object())) {
        if (v.contains("schedulers")) r.fail(at, "schedulers given twice (in options and beside them)");
        for (std::size_t i = 0; i < value.size(); ++i)
          s.schedulers.push_back(read_scheduler_spec(r, value[i], str(at, "[", i, "]"), depth + 1));
        continue;
      }
      if (value.is_boolean()) {
        s.options[key] = value.get<bool>();
      } else if (value.is_string()) {
        s.options[key] = value.get<std::string>();
      } else if (value.is_array()) {
        std::vector<double> list;
        for (std::size_t i = 0; i < value.size(); ++i) list.push_back(r.number(value[i], str(at, "[", i, "]")));
        s.options[key] = std::move(list);
      } else {
        s.options[key] = r.number(value, at);
      }
    }
  }
  if (const auto list = v.find("schedulers"); list != v.end()) {
    if (!list->is_array()) r.fail(where + ".schedulers", "must be an array");
    for (std::size_t i = 0; i < list->size(); ++i)
      s.schedulers.push_back(read_scheduler_spec(r, (*list)[i], str(where, ".schedulers[", i, "]"), depth + 1));
  }
  return s;
}

SchedulerSpec parse_scheduler_spec(std::string_view json_text, std::string_view source) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {  // parse errors, and numbers beyond double's range (1e999)
    throw InvalidInput(str(source, ": not valid JSON (", e.what(), ")"));
  }
  return read_scheduler_spec(JsonReader(source), doc, "scheduler");
}

std::unique_ptr<Scheduler> make_scheduler(Optimizer& opt, std::string_view json_text) {
  return make_scheduler(opt, parse_scheduler_spec(json_text, "scheduler"));
}

SchedulerSpec scheduler_spec_from_options(std::string name, std::span<const std::string> key_values) {
  SchedulerSpec spec;
  spec.name = std::move(name);
  for (const std::string& kv : key_values) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      throw InvalidInput(str("--scheduler-option: '", kv, "' is not KEY=VALUE"));
    const std::string key = kv.substr(0, eq), text = kv.substr(eq + 1);
    const std::string flag = "scheduler-option " + key;
    if (text == "true" || text == "false") {
      spec.options[key] = text == "true";
    } else if (text.find(',') != std::string::npos) {
      std::vector<double> list;
      std::size_t begin = 0;
      for (;;) {
        const auto comma = text.find(',', begin);
        list.push_back(parse_number(flag, text.substr(begin, comma - begin)));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
      spec.options[key] = std::move(list);
    } else if (!text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '-' ||
                                 text[0] == '.' || text[0] == '+')) {
      spec.options[key] = parse_number(flag, text);
    } else {
      spec.options[key] = text;
    }
  }
  return spec;
}

}  // namespace distopt
