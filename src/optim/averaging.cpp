#include "distopt/optim/averaging.hpp"

#include <algorithm>
#include <cmath>

#include "distopt/core/error.hpp"

namespace distopt {

namespace {

struct KindName {
  AveragingKind kind;
  std::string_view name;
};
constexpr KindName kKinds[] = {{AveragingKind::swa, "swa"},
                               {AveragingKind::swa_lerp, "swa_lerp"},
                               {AveragingKind::ema, "ema"},
                               {AveragingKind::ema_lerp, "ema_lerp"},
                               {AveragingKind::custom, "custom"}};

}  // namespace

AveragingKind averaging_kind(std::string_view name) {
  for (const KindName& k : kKinds)
    if (k.name == name && k.kind != AveragingKind::custom) return k.kind;
  throw InvalidInput(str("unknown averaging '", name, "' (known: swa, swa_lerp, ema, ema_lerp)"));
}

std::string_view averaging_name(AveragingKind kind) {
  for (const KindName& k : kKinds)
    if (k.kind == kind) return k.name;
  return "?";
}

AveragedParams::AveragedParams(std::size_t elements, AveragingOptions options)
    : options_(std::move(options)), avg_(elements, 0.0f) {
  const bool ema = options_.kind == AveragingKind::ema || options_.kind == AveragingKind::ema_lerp;
  if (ema && !(options_.decay >= 0.0 && options_.decay <= 1.0))
    throw InvalidInput(str("Invalid decay value ", options_.decay, " provided. Please provide a value in [0,1] range."));
  if (options_.kind == AveragingKind::custom && !options_.fn)
    throw InvalidInput("custom averaging needs a function");
}

void AveragedParams::update(std::span<const float> current) {
  if (current.size() != avg_.size())
    throw InvalidInput(str("averaging: got ", current.size(), " values for an average of ", avg_.size()));
  float* a = avg_.data();
  const float* p = current.data();
  const std::size_t n = avg_.size();
  if (n_ == 0) {
    std::copy(p, p + n, a);
  } else {
    switch (options_.kind) {
      case AveragingKind::swa: {
        // torch 1.13: avg + (p - avg) / (n_averaged + 1), a true division.
        const auto count = static_cast<float>(n_ + 1);
        for (std::size_t i = 0; i < n; ++i) a[i] = a[i] + (p[i] - a[i]) / count;
        break;
      }
      case AveragingKind::swa_lerp: {
        const float w = 1.0f / static_cast<float>(n_ + 1);  // torch: 1 / (n_averaged + 1) in float32
        for (std::size_t i = 0; i < n; ++i) a[i] = lerp_torch(a[i], p[i], w);
        break;
      }
      case AveragingKind::ema: {
        // decay * ema + (1 - decay) * p with both factors rounded to float.
        const auto d = static_cast<float>(options_.decay), e = static_cast<float>(1.0 - options_.decay);
        for (std::size_t i = 0; i < n; ++i) a[i] = d * a[i] + e * p[i];
        break;
      }
      case AveragingKind::ema_lerp: {
        const auto w = static_cast<float>(1.0 - options_.decay);
        for (std::size_t i = 0; i < n; ++i) a[i] = lerp_torch(a[i], p[i], w);
        break;
      }
      case AveragingKind::custom:
        for (std::size_t i = 0; i < n; ++i) a[i] = options_.fn(a[i], p[i], n_);
        break;
    }
  }
  ++n_;
}

void AveragedParams::load_state_dict(const AveragedState& state) {
  if (state.params.size() != avg_.size())
    throw InvalidInput(str("averaged state holds ", state.params.size(), " values, this average has ", avg_.size()));
  if (state.n_averaged < 0) throw InvalidInput(str("averaged state: n_averaged ", state.n_averaged, " is negative"));
  avg_ = state.params;
  n_ = state.n_averaged;
}

}  // namespace distopt
