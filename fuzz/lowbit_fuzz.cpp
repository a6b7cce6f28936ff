// libFuzzer target: quantized optimizer state (include/distopt/optim/quant.hpp)
// from outside values. The first byte picks int8, int4 or bf16 and the
// signed or unsigned book; the rest, read as floats, are quantized a block at a time,
// read back, and the values read back must requantize with their scale to
// the same values (what a state_dict's load relies on). Then the floats, with
// scales taken from the input too, are loaded as a quantized adam's saved
// state (load_state_dict's check of "codes times scales"): the load must
// either refuse them with an InvalidInput, changing nothing, or take them
// and give exactly those values back (bf16, which has no scales: each value
// rounded as torch rounds it).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <variant>
#include <vector>

#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/quant.hpp"

namespace {

using distopt::quant::StateDType;

// Equal values (0 and -0 alike, as a load compares them), NaN equal to NaN.
bool same(float a, float b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

void round_trip(StateDType d, bool is_signed, const std::vector<float>& x) {
  const std::size_t block = distopt::quant::block_of(d);
  std::vector<std::uint8_t> codes(distopt::quant::code_bytes(d, block)), again(codes.size());
  std::vector<float> back(block), back2(block);
  for (std::size_t b = 0; b < x.size(); b += block) {
    const std::size_t n = std::min(block, x.size() - b);
    float absmax = 0;
    distopt::quant::quantize_block(d, is_signed, x.data() + b, n, codes.data(), &absmax);
    distopt::quant::dequantize_block(d, is_signed, codes.data(), absmax, n, back.data());
    if (!distopt::quant::requantize_block(d, is_signed, back.data(), n, absmax, again.data())) std::abort();
    distopt::quant::dequantize_block(d, is_signed, again.data(), absmax, n, back2.data());
    for (std::size_t i = 0; i < n; ++i)
      if (!same(back[i], back2[i])) std::abort();
  }
}

void load(StateDType d, const std::vector<float>& x) {
  constexpr std::size_t kN = 4096;
  std::vector<float> p(kN, 0.5f), g(kN, 0.25f);
  const auto n = static_cast<std::int64_t>(kN);
  distopt::Optimizer opt("adam",
                         std::vector<distopt::Param>{
                             {"w", {p.data(), distopt::DType::f32, {n}}, {g.data(), distopt::DType::f32, {n}}, true}},
                         {{std::string(distopt::kStateDTypeOption), distopt::quant::name_of(d)}});
  opt.step();
  distopt::StateDict dict = opt.state_dict();
  const distopt::StateDict before = dict;
  auto& values = std::get<distopt::StateTensor>(dict.state.at(0).at("exp_avg")).data;
  const bool scaled = distopt::quant::has_scales(d);
  const std::size_t half = scaled ? x.size() / 2 : x.size();
  for (std::size_t i = 0; i < half && i < values.size(); ++i) values[i] = x[i];
  if (scaled) {
    auto& scales = std::get<distopt::StateTensor>(dict.state.at(0).at("exp_avg.absmax")).data;
    for (std::size_t i = 0; half + i < x.size() && i < scales.size(); ++i) scales[i] = x[half + i];
  }
  try {
    opt.load_state_dict(dict);
  } catch (const distopt::InvalidInput&) {
    const distopt::StateDict after = opt.state_dict();
    const auto& now = std::get<distopt::StateTensor>(after.state.at(0).at("exp_avg")).data;
    const auto& was = std::get<distopt::StateTensor>(before.state.at(0).at("exp_avg")).data;
    for (std::size_t i = 0; i < now.size(); ++i)
      if (!same(now[i], was[i])) std::abort();  // a refused load changed the state
    return;
  }
  const distopt::StateDict loaded = opt.state_dict();
  const auto& got = std::get<distopt::StateTensor>(loaded.state.at(0).at("exp_avg")).data;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float want = scaled ? values[i] : distopt::quant::from_bf16(distopt::quant::to_bf16(values[i]));
    if (!same(got[i], want)) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const StateDType d = (data[0] & 4) != 0 ? StateDType::bf16 : (data[0] & 1) != 0 ? StateDType::int4 : StateDType::int8;
  const bool is_signed = (data[0] & 2) != 0;
  std::vector<float> x((size - 1) / sizeof(float));
  if (!x.empty()) std::memcpy(x.data(), data + 1, x.size() * sizeof(float));
  round_trip(d, is_signed, x);
  load(d, x);
  return 0;
}
