#include "distopt/optim/options.hpp"

#include <sstream>

#include "distopt/core/error.hpp"

namespace distopt {

std::string_view name_of(OptionValue::Kind kind) {
  switch (kind) {
    case OptionValue::Kind::number: return "a number";
    case OptionValue::Kind::flag: return "a boolean";
    case OptionValue::Kind::pair: return "a pair of numbers";
    case OptionValue::Kind::triple: return "three numbers";
    case OptionValue::Kind::word: return "a word";
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
  return {nums_[0], nums_[1]};
}
std::array<double, 3> OptionValue::triple() const {
  DISTOPT_CHECK(kind_ == Kind::triple, "option is ", name_of(kind_), ", not three numbers");
  return nums_;
}
std::string_view OptionValue::word() const {
  DISTOPT_CHECK(kind_ == Kind::word, "option is ", name_of(kind_), ", not a word");
  return {word_.data(), word_len_};
}

std::string OptionValue::to_string() const {
  std::ostringstream os;
  os.precision(17);
  switch (kind_) {
    case Kind::number: os << number_; break;
    case Kind::flag: os << (flag_ ? "true" : "false"); break;
    case Kind::pair: os << "(" << nums_[0] << ", " << nums_[1] << ")"; break;
    case Kind::triple: os << "(" << nums_[0] << ", " << nums_[1] << ", " << nums_[2] << ")"; break;
    case Kind::word: os << word(); break;
  }
  return os.str();
}

}  // namespace distopt
