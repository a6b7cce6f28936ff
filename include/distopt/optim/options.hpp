// Hyper-parameters of an optimizer, by torch name.
//
// A value is a number (lr, eps, ...), a flag (amsgrad, nesterov, ...) or a
// pair (betas, etas, step_sizes). Optimizers validate every group's options
// when they are set, with torch's own checks, so a step never meets a bad one.
#pragma once

#include <array>
#include <map>
#include <string>
#include <string_view>

namespace distopt {

class OptionValue {
 public:
  enum class Kind { number, flag, pair };

  constexpr OptionValue() = default;
  constexpr OptionValue(double v) : kind_(Kind::number), number_(v) {}  // NOLINT: implicit
  constexpr OptionValue(int v) : OptionValue(static_cast<double>(v)) {}  // NOLINT
  constexpr OptionValue(bool v) : kind_(Kind::flag), flag_(v) {}        // NOLINT
  constexpr OptionValue(double a, double b) : kind_(Kind::pair), pair_{a, b} {}

  Kind kind() const { return kind_; }
  double number() const;
  bool flag() const;
  std::array<double, 2> pair() const;
  std::string to_string() const;
  friend bool operator==(const OptionValue&, const OptionValue&) = default;

 private:
  Kind kind_ = Kind::number;
  double number_ = 0;
  bool flag_ = false;
  std::array<double, 2> pair_{0, 0};
};

std::string_view name_of(OptionValue::Kind kind);

using OptionMap = std::map<std::string, OptionValue, std::less<>>;

}  // namespace distopt
