// Hyper-parameters of an optimizer, by torch name.
//
// A value is a number (lr, eps, ...), a flag (amsgrad, nesterov, ...), a
// pair (betas, etas, step_sizes), a triple (Muon's ns_coefficients) or a
// word (Muon's adjust_lr_fn: one of the rule's choices, at most kMaxWord
// characters, held inline). Optimizers validate every group's options when
// they are set, with torch's own checks, so a step never meets a bad one.
#pragma once

#include <array>
#include <map>
#include <string>
#include <string_view>

namespace distopt {

class OptionValue {
 public:
  enum class Kind { number, flag, pair, triple, word };
  static constexpr std::size_t kMaxWord = 31;

  constexpr OptionValue() = default;
  constexpr OptionValue(double v) : kind_(Kind::number), number_(v) {}  // NOLINT: implicit
  constexpr OptionValue(int v) : OptionValue(static_cast<double>(v)) {}  // NOLINT
  constexpr OptionValue(bool v) : kind_(Kind::flag), flag_(v) {}        // NOLINT
  constexpr OptionValue(double a, double b) : kind_(Kind::pair), nums_{a, b, 0} {}
  constexpr OptionValue(double a, double b, double c) : kind_(Kind::triple), nums_{a, b, c} {}
  // A word; one longer than kMaxWord characters is cut (words() callers
  // check the length first: see word_fits).
  constexpr OptionValue(std::string_view w) : kind_(Kind::word) {  // NOLINT: implicit
    for (std::size_t i = 0; i < w.size() && i < kMaxWord; ++i) word_[i] = w[i];
    word_len_ = w.size() < kMaxWord ? w.size() : kMaxWord;
  }
  // Without this a string literal would become a flag (pointer to bool).
  constexpr OptionValue(const char* w) : OptionValue(std::string_view(w)) {}  // NOLINT: implicit
  static constexpr bool word_fits(std::string_view w) { return w.size() <= kMaxWord; }

  constexpr Kind kind() const { return kind_; }
  double number() const;
  bool flag() const;
  std::array<double, 2> pair() const;
  std::array<double, 3> triple() const;
  std::string_view word() const;
  std::string to_string() const;
  friend bool operator==(const OptionValue&, const OptionValue&) = default;

 private:
  Kind kind_ = Kind::number;
  double number_ = 0;
  bool flag_ = false;
  std::array<double, 3> nums_{0, 0, 0};
  std::array<char, kMaxWord> word_{};
  std::size_t word_len_ = 0;
};

std::string_view name_of(OptionValue::Kind kind);

using OptionMap = std::map<std::string, OptionValue, std::less<>>;

}  // namespace distopt
