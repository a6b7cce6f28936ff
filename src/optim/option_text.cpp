// Optimizer options from text (include/distopt/optim/option_text.hpp).
#include "distopt/optim/option_text.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

#include "distopt/core/error.hpp"

namespace distopt {

namespace {

std::string dashed(std::string_view name) {
  std::string flag(name);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '-'; }

// Where the first item of "NAME=VALUE,NAME=VALUE..." ends: at the first
// comma followed by NAME=, or npos; other commas belong to the value (a
// pair's, a triple's).
std::size_t item_end(std::string_view text) {
  for (std::size_t comma = text.find(','); comma != std::string_view::npos; comma = text.find(',', comma + 1)) {
    std::size_t k = comma + 1;
    while (k < text.size() && is_name_char(text[k])) ++k;
    if (k > comma + 1 && k < text.size() && text[k] == '=') return comma;
  }
  return std::string_view::npos;
}

}  // namespace

double parse_number(std::string_view flag, std::string_view text) {
  const std::string t(text);
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != t.size() || !std::isfinite(v))
    throw InvalidInput(str("--", flag, ": '", text, "' is not a finite number"));
  return v;
}

OptionMap parse_option_values(const RuleInfo& rule, const std::map<std::string, std::string>& given) {
  OptionMap out;
  for (const auto& [name, text] : given) {
    const std::string flag = dashed(name);
    if (name == kStateDTypeOption) {  // every rule's (resolve_options checks the word)
      if (!OptionValue::word_fits(text)) throw InvalidInput(str("--", flag, ": '", text, "' is too long"));
      out[name] = OptionValue(std::string_view(text));
      continue;
    }
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : rule.options)
      if (s.name == name) spec = &s;
    if (spec == nullptr) throw InvalidInput(str("--", flag, " is not an option of optimizer ", rule.name));
    switch (spec->default_value.kind()) {
      case OptionValue::Kind::number:
        out[name] = parse_number(flag, text);
        break;
      case OptionValue::Kind::flag:
        if (text == "true" || text == "1" || text.empty()) out[name] = true;
        else if (text == "false" || text == "0") out[name] = false;
        else throw InvalidInput(str("--", flag, ": '", text, "' is not true or false"));
        break;
      case OptionValue::Kind::pair: {
        const auto comma = text.find(',');
        if (comma == std::string::npos)
          throw InvalidInput(str("--", flag, ": '", text, "' is not a pair like 0.9,0.999"));
        out[name] = OptionValue(parse_number(flag, text.substr(0, comma)), parse_number(flag, text.substr(comma + 1)));
        break;
      }
      case OptionValue::Kind::triple: {
        const auto a = text.find(','), b = a == std::string::npos ? a : text.find(',', a + 1);
        if (b == std::string::npos || text.find(',', b + 1) != std::string::npos)
          throw InvalidInput(str("--", flag, ": '", text, "' is not three numbers like 3.4445,-4.775,2.0315"));
        out[name] = OptionValue(parse_number(flag, text.substr(0, a)), parse_number(flag, text.substr(a + 1, b - a - 1)),
                                parse_number(flag, text.substr(b + 1)));
        break;
      }
      case OptionValue::Kind::word:
        if (text.empty() || !OptionValue::word_fits(text))
          throw InvalidInput(str("--", flag, ": '", text, "' is not one of the option's words"));
        out[name] = OptionValue(std::string_view(text));
        break;
    }
  }
  return out;
}

OptionMap parse_options(const RuleInfo& rule, std::string_view text) {
  std::map<std::string, std::string> given;
  while (!text.empty()) {
    const std::size_t end = item_end(text);
    const std::string_view item = text.substr(0, end);
    const auto eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      throw InvalidInput(str("optimizer options: '", item, "' is not NAME=VALUE (e.g. lr=0.1,betas=0.9,0.999)"));
    std::string name(item.substr(0, eq));
    std::replace(name.begin(), name.end(), '-', '_');
    if (!given.emplace(name, std::string(item.substr(eq + 1))).second)
      throw InvalidInput(str("optimizer options: ", name, " is given twice"));
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
  }
  return parse_option_values(rule, given);
}

}  // namespace distopt
