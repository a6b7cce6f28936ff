// The table of update rules, by torch name.
#include <array>
#include <string>

#include "distopt/optim/quant.hpp"
#include "rule_impl.hpp"

namespace distopt {

std::string_view name_of(Locality l) {
  switch (l) {
    case Locality::pointwise: return "pointwise";
    case Locality::tensor_stats: return "tensor_stats";
    case Locality::whole_tensor: return "whole_tensor";
  }
  return "?";
}

std::span<const RuleInfo* const> all_rules() {
  static const std::array<const RuleInfo*, 18> rules = {
      &rules::sgd_rule(),     &rules::adam_rule(),    &rules::adamw_rule(), &rules::adamax_rule(),
      &rules::adadelta_rule(), &rules::adagrad_rule(), &rules::rmsprop_rule(), &rules::nadam_rule(),
      &rules::radam_rule(),   &rules::rprop_rule(),   &rules::asgd_rule(),  &rules::lion_rule(),
      &rules::lars_rule(),    &rules::lamb_rule(),    &rules::adafactor_rule(), &rules::muon_rule(),
      &rules::shampoo_rule(), &rules::adagrad_full_rule(),
  };
  return rules;
}

const RuleInfo* find_rule(std::string_view name) {
  for (const RuleInfo* r : all_rules())
    if (r->name == name) return r;
  return nullptr;
}

const RuleInfo& rule_or_throw(std::string_view name) {
  if (const RuleInfo* r = find_rule(name)) return *r;
  std::string known;
  for (const RuleInfo* r : all_rules()) known += (known.empty() ? "" : ", ") + std::string(r->name);
  throw InvalidInput(str("unknown optimizer '", name, "' (known: ", known, ")"));
}

const OptionSpec& option_spec(const RuleInfo& rule, std::string_view option) {
  for (const OptionSpec& s : rule.options)
    if (s.name == option) return s;
  std::string known;
  for (const OptionSpec& s : rule.options) known += (known.empty() ? "" : ", ") + std::string(s.name);
  throw InvalidInput(str("unknown option '", option, "' for optimizer ", rule.name, " (known: ", known, ")"));
}

// The state_dtype option: a known word, and a quantized one only for a rule
// with state that may be quantized.
void check_state_dtype(const RuleInfo& rule, const OptionValue& value) {
  if (value.kind() != OptionValue::Kind::word)
    throw InvalidInput(str("option '", kStateDTypeOption, "' of optimizer ", rule.name, " must be one of ",
                           quant::state_dtype_names(), ", got ", value.to_string()));
  const auto d = quant::parse_state_dtype(value.word());
  if (!d)
    throw InvalidInput(
        str("unknown ", kStateDTypeOption, " '", value.word(), "' (known: ", quant::state_dtype_names(), ")"));
  if (*d != quant::StateDType::f32 && !rule.quantizable()) {
    std::string which;
    for (const RuleInfo* r : all_rules())
      if (r->quantizable()) which += (which.empty() ? "" : ", ") + std::string(r->name);
    throw InvalidInput(str(rule.name, " keeps no state that can be quantized (", kStateDTypeOption, " ", value.word(),
                           " is for ", which, ")"));
  }
}

OptionMap resolve_options(const RuleInfo& rule, const OptionMap& given) {
  OptionMap out;
  for (const OptionSpec& s : rule.options) out.emplace(std::string(s.name), s.default_value);
  for (const auto& [name, value] : given) {
    if (name == kStateDTypeOption) {  // every rule's, absent unless given
      check_state_dtype(rule, value);
      out[name] = value;
      continue;
    }
    const OptionSpec& spec = option_spec(rule, name);
    if (value.kind() != spec.default_value.kind())
      throw InvalidInput(str("option '", name, "' of optimizer ", rule.name, " must be ",
                             name_of(spec.default_value.kind()), ", got ", value.to_string()));
    out[name] = value;
  }
  return out;
}

}  // namespace distopt
