// Weight averaging (AveragedModel's SWA and EMA) against PyTorch
// (tests/golden/swa, from scripts/gen_golden_swa.py), and the properties a
// sharded engine relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "distopt/core/error.hpp"
#include "distopt/optim/averaging.hpp"
#include "golden_json.hpp"

namespace distopt {
namespace {

using golden::json;

// The custom avg_fn of the golden cases: avg * 0.75 + p * 0.25 + 0.001 * n,
// each operation rounded to float as torch's tensor operations round.
float custom_fn(float a, float p, std::int64_t n) {
  const float x = a * 0.75f, y = p * 0.25f, z = 0.001f * static_cast<float>(n);
  return (x + y) + z;
}

AveragingOptions options_of(const json& c) {
  AveragingOptions o;
  const std::string kind = c["kind"];
  if (kind == "custom") {
    o.kind = AveragingKind::custom;
    o.fn = custom_fn;
  } else {
    o.kind = averaging_kind(kind);
  }
  if (c.contains("decay")) o.decay = c["decay"].get<double>();
  return o;
}

// Every torch case, bit for bit: the averages are float32 pointwise
// formulas, computed in the same order as torch computes them.
TEST(SwaGolden, EveryTorchCaseMatchesBitwise) {
  const json doc = golden::load("swa/averaged.json");
  std::map<std::string, int> per_kind;
  for (const json& c : doc["cases"]) {
    const std::string name = c["name"];
    std::size_t elements = 0;
    for (const json& u : c["updates"][0]) elements += u.size();
    AveragedParams avg(elements, options_of(c));
    for (std::size_t k = 0; k < c["updates"].size(); ++k) {
      std::vector<float> current;
      for (const json& t : c["updates"][k]) {
        const auto v = golden::floats(t);
        current.insert(current.end(), v.begin(), v.end());
      }
      avg.update(current);
      EXPECT_EQ(avg.n_averaged(), c["expected_n_averaged"][k].get<std::int64_t>()) << name;
      std::size_t i = 0;
      for (const json& t : c["expected"][k])
        for (const json& x : t) {
          const auto want = static_cast<float>(golden::num(x));
          ASSERT_EQ(std::memcmp(&avg.params()[i], &want, sizeof want), 0)
              << name << " update " << k << " element " << i << ": " << avg.params()[i] << " vs torch " << want;
          ++i;
        }
    }
    ++per_kind[c["kind"]];
  }
  for (const char* kind : {"swa", "swa_lerp", "ema", "ema_lerp", "custom"}) EXPECT_GE(per_kind[kind], 2) << kind;
}

TEST(Swa, ShardsAverageToTheShardsOfTheWhole) {
  // Two "ranks" averaging halves of the same vectors get exactly the halves
  // of the unsharded average: every formula is pointwise.
  for (const char* kind : {"swa", "swa_lerp", "ema", "ema_lerp"}) {
    AveragingOptions o;
    o.kind = averaging_kind(kind);
    o.decay = 0.9;
    AveragedParams whole(1001, o), a(400, o), b(601, o);
    std::vector<float> v(1001);
    for (int k = 0; k < 9; ++k) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.1f * float(i) + float(k)) * float(k + 1);
      whole.update(v);
      a.update({v.data(), 400});
      b.update({v.data() + 400, 601});
    }
    for (std::size_t i = 0; i < 400; ++i) ASSERT_EQ(a.params()[i], whole.params()[i]) << kind << " " << i;
    for (std::size_t i = 0; i < 601; ++i) ASSERT_EQ(b.params()[i], whole.params()[400 + i]) << kind << " " << i;
  }
}

TEST(Swa, StateDictRoundTripContinuesIdentically) {
  AveragingOptions o;
  o.kind = AveragingKind::swa;
  AveragedParams a(5, o), b(5, o);
  std::vector<float> v(5);
  auto feed = [&](AveragedParams& x, int k) {
    for (int i = 0; i < 5; ++i) v[std::size_t(i)] = float(k * 5 + i) * 0.37f;
    x.update(v);
  };
  for (int k = 0; k < 4; ++k) feed(a, k);
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.n_averaged(), 4);
  for (int k = 4; k < 8; ++k) {
    feed(a, k);
    feed(b, k);
  }
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(a.params()[i], b.params()[i]);
  EXPECT_EQ(a.n_averaged(), b.n_averaged());
}

TEST(Swa, BadInputIsRefusedWithoutChangingAnything) {
  AveragingOptions o;
  o.kind = AveragingKind::ema;
  o.decay = 1.5;
  EXPECT_THROW(AveragedParams(3, o), InvalidInput);
  o.decay = -0.1;
  EXPECT_THROW(AveragedParams(3, o), InvalidInput);
  o.kind = AveragingKind::custom;
  o.decay = 0.5;
  EXPECT_THROW(AveragedParams(3, o), InvalidInput) << "custom without a function";
  EXPECT_THROW(averaging_kind("swag"), InvalidInput);

  AveragedParams a(3);
  const float v[3] = {1, 2, 3};
  a.update(v);
  const float w[2] = {1, 2};
  EXPECT_THROW(a.update(w), InvalidInput);
  EXPECT_THROW(a.load_state_dict({1, {1, 2}}), InvalidInput);
  EXPECT_THROW(a.load_state_dict({-1, {1, 2, 3}}), InvalidInput);
  EXPECT_EQ(a.n_averaged(), 1);
  EXPECT_EQ(a.params()[2], 3.0f);
}

TEST(Swa, LerpEndpointsAreExact) {
  EXPECT_EQ(lerp_torch(3.0f, 7.0f, 1.0f), 7.0f);
  EXPECT_EQ(lerp_torch(3.0f, 7.0f, 0.0f), 3.0f);
  EXPECT_EQ(lerp_torch(1e30f, -1e30f, 0.5f), 0.0f);
}

}  // namespace
}  // namespace distopt
