// Quantized optimizer state (include/distopt/optim/quant.hpp): the code
// books and torch.optim's steps with state kept quantized between them,
// against PyTorch (tests/golden/lowbit, from scripts/gen_golden_lowbit.py);
// the properties the sharded engines rely on (slicing, pieces on blocks);
// the memory; state_dict; bad input.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "../src/optim/quant_code.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/quant.hpp"
#include "golden_json.hpp"

namespace distopt {
namespace {

using golden::json;
using quant::StateDType;

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// scripts/gen_golden_lowbit.py values(): (h(i, salt) mod 2001 - 1000) / 1000.
std::vector<float> values(std::size_t n, std::uint64_t salt) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t h = (i * 2654435761ull + salt * 40503ull) % (1ull << 32);
    out[i] = static_cast<float>(static_cast<std::int64_t>(h % 2001) - 1000) / 1000.0f;
  }
  return out;
}

// Writes into the gradient's memory (the optimizer holds views of it).
void assign(std::vector<float>& to, const std::vector<float>& from) {
  std::copy(from.begin(), from.end(), to.begin());
}

OptionMap options_of(const json& o) {
  OptionMap m;
  for (const auto& [key, v] : o.items()) {
    if (v.is_boolean()) m[key] = v.get<bool>();
    else if (v.is_array()) m[key] = OptionValue(v[0].get<double>(), v[1].get<double>());
    else m[key] = v.get<double>();
  }
  return m;
}

TEST(Lowbit, CodeBooksAreTorchs) {
  const json doc = golden::load("lowbit/lowbit.json");
  const json& codes = doc["cases"][0]["codes"];
  for (auto [d, name] : {std::pair{StateDType::int8, "int8"}, std::pair{StateDType::int4, "int4"}})
    for (bool s : {true, false}) {
      const auto want = golden::floats(codes[std::string(name) + (s ? "_signed" : "_unsigned")]);
      const auto got = quant::code_book(d, s);
      ASSERT_EQ(got.size(), want.size()) << name << s;
      for (std::size_t k = 0; k < want.size(); ++k)
        EXPECT_TRUE(same_bits(got[k], want[k]))
            << name << (s ? " signed" : " unsigned") << " code " << k << ": " << got[k] << " vs torch " << want[k];
    }
}

TEST(Lowbit, CodesAreNearestAndTheSecondMomentNeverReadsZero) {
  for (StateDType d : {StateDType::int8, StateDType::int4})
    for (bool s : {true, false}) {
      const auto book = quant::code_book(d, s);
      const std::size_t block = quant::block_of(d);
      // Every code times a scale reads back to itself.
      std::vector<float> x(block), back(block);
      for (std::size_t k = 0; k < block; ++k) x[k] = book[k % book.size()] * 3.5f;
      std::vector<std::uint8_t> codes(quant::code_bytes(d, block));
      float absmax = 0;
      quant::quantize_block(d, s, x.data(), block, codes.data(), &absmax);
      EXPECT_EQ(absmax, 3.5f);
      quant::dequantize_block(d, s, codes.data(), absmax, block, back.data());
      for (std::size_t k = 0; k < block; ++k) EXPECT_TRUE(same_bits(back[k], x[k])) << k;
      // Values between codes take a nearest one.
      const auto v = values(block, 7);
      for (std::size_t k = 0; k < block; ++k) x[k] = s ? v[k] : std::fabs(v[k]) * 1e-3f;
      quant::quantize_block(d, s, x.data(), block, codes.data(), &absmax);
      quant::dequantize_block(d, s, codes.data(), absmax, block, back.data());
      for (std::size_t k = 0; k < block; ++k) {
        const float q = x[k] / absmax;
        float best = INFINITY;
        for (float c : book) best = std::min(best, std::fabs(c - q));
        const float got = std::fabs(back[k] / absmax - q);
        if (!s && x[k] > 0) EXPECT_GT(back[k], 0.0f) << k;  // the floor, where it applies
        else EXPECT_LE(got, best * 1.0001f + 1e-7f) << k;
      }
    }
  // A block with a NaN reads back as NaN; a zero block as zeros.
  std::vector<float> x(256, 1.0f), back(256);
  x[3] = NAN;
  std::vector<std::uint8_t> codes(256);
  float absmax = 0;
  quant::quantize_block(StateDType::int8, true, x.data(), 256, codes.data(), &absmax);
  quant::dequantize_block(StateDType::int8, true, codes.data(), absmax, 256, back.data());
  EXPECT_TRUE(std::isnan(back[0]));
  std::fill(x.begin(), x.end(), 0.0f);
  quant::quantize_block(StateDType::int4, false, x.data(), 128, codes.data(), &absmax);
  quant::dequantize_block(StateDType::int4, false, codes.data(), absmax, 128, back.data());
  EXPECT_EQ(back[0], 0.0f);
}

// The quantizer on torch's float32 state: the codes and scales torch's
// operations give (searchsorted, ties to the lower code), bit for bit.
// The quantizer's table search gives the reference binary search's code
// for every value it can see (x / scale lies in [-1, 1]): a sweep over the
// floats in [-1, 1], and each code, its neighbours and every midpoint (the
// ties) with theirs.
// The q of a search's checks: floats of [-1, 1] at a stride of their bits,
// and each code, the midpoints between neighbours (two ways of rounding
// them) and the floats beside them.
std::vector<float> search_cases(StateDType d, bool s) {
  std::vector<float> qs{0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), -1.0f, 1.0f};
  for (std::uint32_t u = 0; u <= 0x3F800000u; u += 1009) {
    qs.push_back(std::bit_cast<float>(u));
    qs.push_back(-std::bit_cast<float>(u));
  }
  const std::span<const float> code = quant::code_book(d, s);
  for (std::size_t k = 0; k < code.size(); ++k) {
    std::vector<float> at{code[k]};
    if (k + 1 < code.size())
      at.push_back((code[k + 1] - code[k]) / 2 + code[k]), at.push_back((code[k] + code[k + 1]) / 2);
    for (float v : at)
      for (float w : {v, std::nextafter(v, -2.0f), std::nextafter(v, 2.0f)}) qs.push_back(w);
  }
  return qs;
}

TEST(Lowbit, TheFastSearchIsTheReferenceSearch) {
  for (StateDType d : {StateDType::int8, StateDType::int4})
    for (bool s : {true, false}) {
      std::vector<float> qs = search_cases(d, s);
      const std::span<const float> code = quant::code_book(d, s);
      std::size_t differ = 0;
      for (float q : qs)
        if (quant::fast_nearest(d, s, q) != quant::reference_nearest(d, s, q) && ++differ < 5)
          ADD_FAILURE() << quant::name_of(d) << (s ? " signed" : " unsigned") << " q=" << q << " fast "
                        << int(quant::fast_nearest(d, s, q)) << " reference " << int(quant::reference_nearest(d, s, q));
      EXPECT_EQ(differ, 0u);
      EXPECT_GT(qs.size(), 2000000u);
      // The quantizer's own loop (8 lanes at a time where the CPU has AVX2):
      // blocks whose scale is 1, so that each element's q is itself.
      const std::size_t block = quant::block_of(d);
      std::vector<float> x(block), back(block);
      std::vector<std::uint8_t> codes(quant::code_bytes(d, block));
      differ = 0;
      std::erase_if(qs, [](float q) { return std::fabs(q) > 1.0f; });  // what x / max |x| can be
      for (std::size_t at = 0; at < qs.size(); at += block - 1) {
        const std::size_t m = std::min(block - 1, qs.size() - at);
        std::copy_n(qs.begin() + static_cast<std::ptrdiff_t>(at), m, x.begin());
        x[m] = 1.0f;
        float scale = 0;
        quant::quantize_block(d, s, x.data(), m + 1, codes.data(), &scale);
        ASSERT_EQ(scale, 1.0f);
        quant::dequantize_block(d, s, codes.data(), scale, m + 1, back.data());
        for (std::size_t j = 0; j < m; ++j)
          if (back[j] != code[quant::reference_nearest(d, s, x[j])] && ++differ < 5)
            ADD_FAILURE() << quant::name_of(d) << " quantize_block q=" << x[j] << " gave " << back[j];
      }
      EXPECT_EQ(differ, 0u);
    }
}

// The CUDA kernels' search (src/optim/quant_code.hpp, the same source run
// here on the host): the thresholds' binary search over the book's table.
TEST(Lowbit, TheDevicesSearchIsTheReferenceSearch) {
  for (StateDType d : {StateDType::int8, StateDType::int4})
    for (bool s : {true, false}) {
      const quant::BookTable& t = quant::book_table(d, s);
      const std::span<const float> code = quant::code_book(d, s);
      ASSERT_EQ(t.size, code.size());
      EXPECT_TRUE(std::equal(code.begin(), code.end(), t.values));
      if (std::find(code.begin(), code.end(), 0.0f) != code.end()) {
        EXPECT_EQ(code[t.zero], 0.0f);
      } else {
        EXPECT_EQ(t.zero, 0);  // int4's unsigned book (k/16): code 0 under a scale of 0
      }
      std::size_t differ = 0, checked = 0;
      for (float q : search_cases(d, s)) {
        if (std::fabs(q) > 1.0f) continue;  // what x / max |x| can be
        ++checked;
        const std::uint32_t c = quant::code_of(t.thresholds, t.size, t.floor_positive, q);
        if (c != quant::reference_nearest(d, s, q) && ++differ < 5)
          ADD_FAILURE() << quant::name_of(d) << (s ? " signed" : " unsigned") << " q=" << q << " device " << c
                        << " reference " << int(quant::reference_nearest(d, s, q));
      }
      EXPECT_EQ(differ, 0u);
      EXPECT_GT(checked, 2000000u);
    }
}

TEST(Lowbit, QuantizingTorchsStateGivesTorchsCodes) {
  const json doc = golden::load("lowbit/lowbit.json");
  int checked = 0;
  for (const json& c : doc["cases"]) {
    if (!c.contains("rule")) continue;
    const StateDType d = *quant::parse_state_dtype(c["state_dtype"].get<std::string>());
    const std::size_t block = quant::block_of(d);
    for (const json& s : c["state"]) {
      const std::string key = s["key"];
      const bool is_signed = key == "exp_avg" || key == "momentum_buffer";
      const auto x = golden::floats(s["fp32"]);
      const auto codes = s["codes"].get<std::vector<int>>();
      const auto absmax = golden::floats(s["absmax"]);
      std::vector<std::uint8_t> got(quant::code_bytes(d, block));
      std::vector<float> back(block);
      for (std::size_t b = 0; b * block < x.size(); ++b) {
        float scale = 0;
        quant::quantize_block(d, is_signed, x.data() + b * block, block, got.data(), &scale);
        ASSERT_TRUE(same_bits(scale, absmax[b])) << c["name"] << " " << key << " block " << b;
        quant::dequantize_block(d, is_signed, got.data(), scale, block, back.data());
        for (std::size_t e = 0; e < block; ++e)
          ASSERT_TRUE(same_bits(back[e], quant::code_book(d, is_signed)[codes[b * block + e]] * scale))
              << c["name"] << " " << key << " element " << b * block + e;
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 5 * 4);
}

// torch.optim's Adam, AdamW and SGD with state quantized between steps.
// Torch's vectorized add fuses a multiply-add where distopt does not, so a
// step agrees to about an ulp (an ulp could move a value to the neighbouring
// code; in these cases none does): the parameters must be within the
// optimizer goldens' tolerance, and a thousand times closer to torch's
// quantized run than an fp32 run is (the update is made from the step's fp32
// moments, then they are quantized).
TEST(Lowbit, TorchCasesAgreeToTheGoldenTolerance) {
  const json doc = golden::load("lowbit/lowbit.json");
  int cases = 0;
  for (const json& c : doc["cases"]) {
    if (!c.contains("rule")) continue;
    const std::string name = c["name"];
    const auto salt = c["salt"].get<std::uint64_t>();
    std::vector<Shape> shapes;
    for (const json& s : c["shapes"]) shapes.push_back(s.get<Shape>());
    auto run = [&](bool quantized) {
      std::vector<std::vector<float>> p, g;
      for (std::size_t k = 0; k < shapes.size(); ++k) {
        p.push_back(values(static_cast<std::size_t>(numel(shapes[k])), salt + k));
        g.emplace_back(p.back().size());
      }
      std::vector<Param> params;
      for (std::size_t k = 0; k < shapes.size(); ++k)
        params.push_back(
            {str("p", k), {p[k].data(), DType::f32, shapes[k]}, {g[k].data(), DType::f32, shapes[k]}, true});
      OptionMap options = options_of(c["options"]);
      if (quantized)
        options[std::string(kStateDTypeOption)] = std::string_view(c["state_dtype"].get_ref<const std::string&>());
      Optimizer opt(c["rule"].get<std::string>(), params, options);
      const auto scales = c["scales"];
      for (std::size_t step = 0; step < scales.size(); ++step) {
        for (std::size_t k = 0; k < shapes.size(); ++k) {
          assign(g[k], values(p[k].size(), salt + 100 * (step + 1) + k));
          for (float& x : g[k]) x *= static_cast<float>(scales[step].get<double>());
        }
        opt.step();
      }
      return p;
    };
    const auto ours = run(true), fp32 = run(false);
    std::size_t total = 0, within = 0;
    double worst = 0, ours_err = 0, fp32_err = 0;
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      const auto want = golden::floats(c["expected"][k]);
      ASSERT_EQ(want.size(), ours[k].size());
      for (std::size_t e = 0; e < want.size(); ++e) {
        const double d = std::fabs(static_cast<double>(ours[k][e]) - want[e]);
        within += d <= 1e-6 + 1e-5 * std::fabs(want[e]);
        worst = std::max(worst, d);
        ours_err += d;
        fp32_err += std::fabs(static_cast<double>(fp32[k][e]) - want[e]);
        ++total;
      }
    }
    EXPECT_EQ(within, total) << name;
    EXPECT_LE(worst, 1e-5) << name;
    EXPECT_LE(ours_err, 1e-3 * fp32_err) << name << ": distance to torch's quantized run " << ours_err << ", fp32's "
                                         << fp32_err;
    std::printf("%s: %zu of %zu within tolerance, largest difference %.3g; summed distance %.3g (fp32 state: %.3g)\n",
                name.c_str(), within, total, worst, ours_err, fp32_err);
    ++cases;
  }
  EXPECT_EQ(cases, 5);
}

// One tensor of n elements stepped `steps` times by `rule` with state
// `dtype`, held whole or as pieces cut at `cuts` (each its own optimizer,
// as ranks hold shards), optionally threaded in chunks. Returns the
// parameter after the steps, then every state value.
struct Outcome {
  std::vector<float> param;
  std::map<std::string, std::vector<float>> state;  // by key, the pieces' values one after another
};
Outcome run_pieces(const std::string& rule, StateDType dtype, std::size_t n, std::vector<std::size_t> cuts,
                   bool whole_shape = true, ThreadPool* pool = nullptr, std::size_t chunk = 1u << 16) {
  std::vector<float> p = values(n, 3), g(n);
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(n);
  std::vector<Optimizer> opts;
  OptionMap options{{std::string(kStateDTypeOption), quant::name_of(dtype)}};
  if (rule == "sgd") options["momentum"] = 0.9;
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    const auto m = static_cast<std::int64_t>(cuts[k + 1] - cuts[k]);
    Param piece{"w", {p.data() + cuts[k], DType::f32, {m}}, {g.data() + cuts[k], DType::f32, {m}}, true};
    if (whole_shape) {
      piece.tensor_shape = Shape{static_cast<std::int64_t>(n)};
      piece.tensor_offset = cuts[k];
    }
    opts.emplace_back(rule, std::vector<Param>{piece}, options, OptimizerConfig{pool, chunk});
  }
  for (int step = 0; step < 5; ++step) {
    assign(g, values(n, 50 + static_cast<std::uint64_t>(step)));
    for (float& x : g) x *= step == 2 ? 1e-3f : 1.0f;
    for (Optimizer& o : opts) o.step();
  }
  Outcome out{p, {}};
  for (Optimizer& o : opts) {
    const StateDict d = o.state_dict();
    for (const auto& [key, value] : d.state.at(0))
      if (const auto* t = std::get_if<StateTensor>(&value); t && key.find(".absmax") == std::string::npos)
        out.state[key].insert(out.state[key].end(), t->data.begin(), t->data.end());
  }
  return out;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool same(const Outcome& a, const Outcome& b) {
  if (!same_floats(a.param, b.param) || a.state.size() != b.state.size()) return false;
  for (const auto& [key, values] : a.state)
    if (!b.state.count(key) || !same_floats(values, b.state.at(key))) return false;
  return true;
}

TEST(Lowbit, ThreadsAndPiecesOnBlocksGiveTheWholeTensorsBits) {
  ThreadPool pool(3);
  for (const char* rule : {"adamw", "adam", "sgd", "lion"})
    for (StateDType d : {StateDType::bf16, StateDType::int8, StateDType::int4}) {
      const std::size_t n = 5000;
      const Outcome whole = run_pieces(rule, d, n, {});
      EXPECT_TRUE(same(whole, run_pieces(rule, d, n, {}, true, &pool, 300))) << rule << " threaded";
      EXPECT_TRUE(same(whole, run_pieces(rule, d, n, {1024, 1280, 4096}))) << rule << " pieces";
      EXPECT_TRUE(same(whole, run_pieces(rule, d, n, {2560, 2560}))) << rule << " an empty piece";
    }
}

// What bitsandbytes and torchao do under FSDP (bitsandbytes#2080,
// pytorch/ao#4912): blocks counted from each shard's start, the size
// threshold applied to the shard. Both change the result; distopt's pieces
// off a block boundary are refused instead.
TEST(Lowbit, PerShardQuantizationChangesTheResult) {
  for (StateDType d : {StateDType::int8, StateDType::int4}) {
    const Outcome whole = run_pieces("adamw", d, 8000, {});
    EXPECT_FALSE(same(whole, run_pieces("adamw", d, 8000, {4100}, false))) << "blocks from the shard's start";
    EXPECT_FALSE(same(whole, run_pieces("adamw", d, 8000, {4000}, false))) << "threshold on the shard";
    EXPECT_TRUE(
        same(run_pieces("adamw", d, 8192, {}), run_pieces("adamw", d, 8192, {4096}, false)));  // they agree there
    try {
      run_pieces("adamw", d, 8000, {4100});
      ADD_FAILURE() << "a piece off a block boundary was accepted";
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find("starting at element 4100 of its tensor"), std::string::npos) << e.what();
    }
  }
}

// bf16 state has no blocks: pieces cut anywhere give the whole tensor's bits.
TEST(Lowbit, Bf16PiecesCutAnywhereGiveTheWholeTensorsBits) {
  for (const char* rule : {"adamw", "sgd", "lion"}) {
    const Outcome whole = run_pieces(rule, StateDType::bf16, 5000, {});
    EXPECT_TRUE(same(whole, run_pieces(rule, StateDType::bf16, 5000, {1, 777, 4100}))) << rule;
    EXPECT_FALSE(same(whole, run_pieces(rule, StateDType::f32, 5000, {}))) << rule << ": rounded to bf16";
    for (const auto& [key, values] : whole.state)  // every value is a bfloat16
      for (float v : values) ASSERT_EQ(std::bit_cast<std::uint32_t>(v) & 0xFFFFu, 0u) << rule << " " << key;
  }
}

// torch's float -> bfloat16 (c10/util/BFloat16.h round_to_nearest_even):
// to nearest, ties to even; every NaN to 0x7FC0; overflow to infinity.
TEST(Lowbit, Bf16RoundsAsTorch) {
  const std::pair<std::uint32_t, std::uint16_t> cases[] = {
      {0x3F800000u, 0x3F80},  // 1
      {0x3F808000u, 0x3F80},  // 1 + 2^-8: a tie, to the even 1
      {0x3F818000u, 0x3F82},  // a tie, to the even above
      {0x3F808001u, 0x3F81},  // above the tie
      {0xBF80FFFFu, 0xBF81},  // negative, to nearest
      {0x7F7FFFFFu, 0x7F80},  // the largest float: to infinity
      {0xFF800000u, 0xFF80},  // -infinity
      {0x00000001u, 0x0000},  // the smallest subnormal: to +0
      {0x00018000u, 0x0002},  // a subnormal tie, to even
      {0x80000000u, 0x8000},  // -0
      {0x7FC00001u, 0x7FC0},  // NaN
      {0xFFFFFFFFu, 0x7FC0},  // a negative NaN: torch's one NaN
  };
  for (const auto& [in, out] : cases) {
    EXPECT_EQ(quant::to_bf16(std::bit_cast<float>(in)), out) << std::hex << in;
    if ((out & 0x7F80) != 0x7F80 || (out & 0x7F) == 0) {  // not a NaN: back exactly
      EXPECT_EQ(std::bit_cast<std::uint32_t>(quant::from_bf16(out)), std::uint32_t{out} << 16);
    }
  }
  // The whole-tensor quantizer (8 lanes at a time, then one by one) and its dequantizer agree.
  std::vector<float> x;
  for (int r = 0; r < 3; ++r)
    for (const auto& [in, out] : cases) x.push_back(std::bit_cast<float>(in));
  std::vector<std::uint8_t> codes(quant::code_bytes(StateDType::bf16, x.size()));
  quant::quantize(StateDType::bf16, true, x.data(), x.size(), codes.data(), nullptr);
  std::vector<float> back(x.size());
  quant::dequantize(StateDType::bf16, true, codes.data(), nullptr, x.size(), back.data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint16_t h;
    std::memcpy(&h, codes.data() + 2 * i, sizeof h);
    EXPECT_EQ(h, quant::to_bf16(x[i])) << i;
    EXPECT_EQ(std::bit_cast<std::uint32_t>(back[i]), std::uint32_t{h} << 16) << i;
  }
}

TEST(Lowbit, StateIsAQuarterOrAnEighthOfFloat32s) {
  const std::size_t n = 1 << 20;
  std::vector<float> p(n, 0.5f), g(n, 0.25f);
  auto bytes = [&](const char* rule, const char* dtype) {
    OptionMap o{{std::string(kStateDTypeOption), dtype}};
    Optimizer opt(
        rule,
        std::vector<Param>{{"w", {p.data(), DType::f32, {1024, 1024}}, {g.data(), DType::f32, {1024, 1024}}, true}}, o);
    opt.step();
    return static_cast<double>(opt.state_bytes());
  };
  for (const char* rule : {"adamw", "lion"}) {
    const double f32 = bytes(rule, "f32");
    EXPECT_EQ(bytes(rule, "bf16") / f32, 0.5) << rule;
    EXPECT_LE(bytes(rule, "int8") / f32, 0.27) << rule;
    EXPECT_LE(bytes(rule, "int4") / f32, 0.15) << rule;
  }
}

TEST(Lowbit, StateDictRoundTripsBitwise) {
  const std::size_t n = 6000;
  for (StateDType d : {StateDType::int8, StateDType::int4}) {
    std::vector<float> p = values(n, 1), g(n), q;
    auto param = [&](std::vector<float>& w) {
      return std::vector<Param>{{"w",
                                 {w.data(), DType::f32, {static_cast<std::int64_t>(n)}},
                                 {g.data(), DType::f32, {static_cast<std::int64_t>(n)}},
                                 true}};
    };
    const OptionMap o{{std::string(kStateDTypeOption), quant::name_of(d)}, {"amsgrad", true}};
    Optimizer a("adam", param(p), o);
    for (int s = 0; s < 3; ++s) {
      assign(g, values(n, 10 + static_cast<std::uint64_t>(s)));
      a.step();
    }
    q = p;
    Optimizer b("adam", param(q), o);
    b.load_state_dict(a.state_dict());
    for (int s = 3; s < 6; ++s) {
      assign(g, values(n, 10 + static_cast<std::uint64_t>(s)));
      a.step();
      b.step();
    }
    ASSERT_EQ(std::memcmp(p.data(), q.data(), n * sizeof(float)), 0) << quant::name_of(d);
    EXPECT_LT(b.state_bytes(), n * 3 * sizeof(float) / 2);
    // Values that are not codes times the saved scales: one line, nothing loaded.
    StateDict bad = a.state_dict();
    std::get<StateTensor>(bad.state.at(0).at("exp_avg")).data[7] += 1e-3f;
    try {
      b.load_state_dict(bad);
      ADD_FAILURE() << "tampered state loaded";
    } catch (const InvalidInput& e) {
      EXPECT_NE(
          std::string(e.what()).find("is not " + std::string(quant::name_of(d)) + " codes times 'exp_avg.absmax'"),
          std::string::npos)
          << e.what();
    }
    // An fp32 optimizer's state loads into quantized storage (quantized afresh).
    std::vector<float> r = values(n, 1);
    Optimizer f("adam", param(r), {{"amsgrad", true}});
    f.step();
    b.load_state_dict(f.state_dict());
    EXPECT_EQ(b.state_dict().state.at(0).count("exp_avg.absmax"), 1u);
  }
}

// A group's storage is what it was made with: a state_dict of another
// storage (or of fp32 state) loads into it, quantized afresh, and a dict's
// state_dtype does not change it.
TEST(Lowbit, LoadingAnotherStoragesStateKeepsTheGroupsOwn) {
  const std::size_t n = 6000;
  std::vector<float> p = values(n, 1), g = values(n, 2), q = p;
  auto param = [&](std::vector<float>& w) {
    return std::vector<Param>{{"w",
                               {w.data(), DType::f32, {static_cast<std::int64_t>(n)}},
                               {g.data(), DType::f32, {static_cast<std::int64_t>(n)}},
                               true}};
  };
  Optimizer a("adamw", param(p), {{std::string(kStateDTypeOption), "int8"}});
  a.step();
  const StateDict int8 = a.state_dict();
  for (const char* into : {"int4", "f32", "bf16"}) {
    Optimizer b("adamw", param(q), {{std::string(kStateDTypeOption), into}});
    b.load_state_dict(int8);
    EXPECT_EQ(b.group(0).options.at(std::string(kStateDTypeOption)).word(), into);
    const StateDict back = b.state_dict();
    EXPECT_EQ(back.state.at(0).count("exp_avg.absmax"), std::string(into) == "int4" ? 1u : 0u) << into;
    const auto& was = std::get<StateTensor>(int8.state.at(0).at("exp_avg")).data;
    const auto& now = std::get<StateTensor>(back.state.at(0).at("exp_avg")).data;
    if (std::string(into) == "f32") EXPECT_EQ(now, was);  // the values as they were
    else EXPECT_NE(now, was);                             // int4's codes, bf16's roundings: afresh
    if (std::string(into) == "bf16") {  // each value rounded as torch rounds it; and a bf16 state loads as it was
      for (std::size_t k = 0; k < n; ++k) ASSERT_EQ(now[k], quant::from_bf16(quant::to_bf16(was[k]))) << k;
      Optimizer again("adamw", param(q), {{std::string(kStateDTypeOption), "bf16"}});
      again.load_state_dict(back);
      EXPECT_EQ(std::get<StateTensor>(again.state_dict().state.at(0).at("exp_avg")).data, now);
    }
  }
  StateDict bad = int8;
  std::get<StateTensor>(bad.state.at(0).at("exp_avg.absmax")).data.resize(3);
  Optimizer c("adamw", param(q), {{std::string(kStateDTypeOption), "int8"}});
  try {
    c.load_state_dict(bad);
    ADD_FAILURE() << "scales of no storage's size were loaded";
  } catch (const InvalidInput& e) {
    EXPECT_EQ(std::string(e.what()),
              "loaded state 'exp_avg.absmax' of parameter 0 must be a tensor of 24 block scales (got 3 elements)");
  }
  EXPECT_FALSE(c.has_state(0));
}

TEST(Lowbit, BadOptionsAreOneLine) {
  std::vector<float> p(5000), g(5000);
  const std::vector<Param> ps{{"w", {p.data(), DType::f32, {5000}}, {g.data(), DType::f32, {5000}}, true}};
  auto message = [&](const char* rule, OptionMap o) {
    try {
      Optimizer opt(rule, ps, o);
    } catch (const InvalidInput& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message("adagrad", {{"state_dtype", "int8"}}),
            "adagrad keeps no state that can be quantized (state_dtype int8 is for sgd, adam, adamw, lion)");
  EXPECT_EQ(message("adamw", {{"state_dtype", "int3"}}), "unknown state_dtype 'int3' (known: f32, bf16, int8, int4)");
  EXPECT_EQ(message("adamw", {{"state_dtype", 8.0}}).find("option 'state_dtype' of optimizer adamw must be one of"),
            0u);
  EXPECT_EQ(message("adagrad", {{"state_dtype", "f32"}}), "accepted");
  Optimizer opt("adamw", ps, {{"state_dtype", "int8"}});
  EXPECT_THROW(opt.set_option(0, "state_dtype", "int4"), InvalidInput);
  opt.set_option(0, "state_dtype", "int8");
  opt.step();
  // In place: the step count through state_views, the moments as codes and scales.
  std::vector<std::string> keys;
  for (const auto& v : opt.state_views(0)) keys.push_back(v.key);
  EXPECT_EQ(keys, std::vector<std::string>{"step"});
  const auto q = opt.quantized_views(0);
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q[0].key, "exp_avg");
  EXPECT_TRUE(q[0].is_signed);
  EXPECT_EQ(q[1].key, "exp_avg_sq");
  EXPECT_FALSE(q[1].is_signed);
  EXPECT_EQ(q[1].elements, 5000u);
  // The views are the state: a scale written through them is what state_dict reads.
  q[1].absmax[0] *= 2;
  const auto dict = opt.state_dict();
  EXPECT_EQ(std::get<StateTensor>(dict.state.at(0).at("exp_avg_sq.absmax")).data[0], q[1].absmax[0]);
}

}  // namespace
}  // namespace distopt
