#include "distopt/optim/options.hpp"

#include <sstream>

#include "distopt/core/error.hpp"

namespace distopt {

std::string_view name_of(OptionValue::Kind kind) {
  switch (kind) {
    case OptionValue::Kind::number: return "a number";
    case OptionValue::Kind::flag: return "a boolean";
    case OptionValue::Kind::pair: return "a pair of numbers";
  }
  return "?";
}

double OptionValue::number() const {
  DISTOPT_CHECK(kind_ == Kind::number, "option is ", name_of(kind_), ", not a number");
  return number_;
}
bool OptionValue::flag() const {
  DISTOPT_CHECK(kind_ == Kind::flag, "option is ", name_of(kind_), ", not a boolean");
  return flag_;
}
std::array<double, 2> OptionValue::pair() const {
  DISTOPT_CHECK(kind_ == Kind::pair, "option is ", name_of(kind_), ", not a pair");
  return pair_;
}

std::string OptionValue::to_string() const {
  std::ostringstream os;
  os.precision(17);
  switch (kind_) {
    case Kind::number: os << number_; break;
    case Kind::flag: os << (flag_ ? "true" : "false"); break;
    case Kind::pair: os << "(" << pair_[0] << ", " << pair_[1] << ")"; break;
  }
  return os.str();
}

}  // namespace distopt
