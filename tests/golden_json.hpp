// Reading the golden files written by scripts/gen_golden_*.py: numbers may
// be the strings "NaN", "Infinity", "-Infinity"; comparisons treat NaN as
// equal to NaN.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace distopt::golden {

using nlohmann::json;

inline double num(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    return s == "Infinity" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  }
  return v.get<double>();
}

inline std::vector<float> floats(const json& list) {
  std::vector<float> out;
  for (const json& x : list) out.push_back(static_cast<float>(num(x)));
  return out;
}

// The golden file tests/golden/<relative>, parsed; fails the test if absent.
inline json load(const std::string& relative) {
  std::ifstream in(std::string(DISTOPT_SOURCE_DIR) + "/tests/golden/" + relative);
  EXPECT_TRUE(in) << "golden file missing: " << relative;
  return in ? json::parse(in) : json::object();
}

// Same value, NaN equal to NaN, infinities exact; finite values within rtol.
inline ::testing::AssertionResult close(double got, double want, double rtol) {
  if (std::isnan(want)) return std::isnan(got) ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << got;
  if (std::isinf(want)) return got == want ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << got;
  if (std::abs(got - want) <= 1e-30 + rtol * std::abs(want)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << got << " vs torch " << want;
}

}  // namespace distopt::golden
