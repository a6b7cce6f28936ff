// Optimizer options from text, as the command line (docs/formats.md,
// "distopt train"), a configuration file and (next) the Python front end
// give them, typed by the rule's table of torch-named options
// (RuleInfo::options; docs/optimizers.md). Every error is one InvalidInput
// line naming the option as a flag (--weight-decay), the way users type it.
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "distopt/optim/options.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt {

// A finite number: "--FLAG: 'TEXT' is not a finite number" otherwise.
double parse_number(std::string_view flag, std::string_view text);

// Each option's text by its torch name ({"lr": "0.1", "betas": "0.9,0.99",
// "amsgrad": "true"}): a number, true/false/1/0 (empty: true), a pair or
// triple of numbers with commas, or one of the option's words.
OptionMap parse_option_values(const RuleInfo& rule, const std::map<std::string, std::string>& given);

// One string of NAME=VALUE items separated by commas, where a pair's or a
// triple's own commas stay with it: "lr=0.1,betas=0.9,0.99,amsgrad=true".
// Names may use dashes (weight-decay) or underscores; empty text gives no
// options. A missing '=', an unknown name or a name given twice is an error.
OptionMap parse_options(const RuleInfo& rule, std::string_view text);

}  // namespace distopt
