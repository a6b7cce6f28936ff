// What every strategy shares besides its engine: the model's flat layout,
// unpadding, the agreement check all ranks run at setup, and the optimizer's
// groups over a strategy's parameter views (strategy.hpp, internal.hpp).
#include "distopt/parallel/strategy.hpp"

#include <algorithm>
#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/optim/quant.hpp"
#include "distopt/optim/rule.hpp"
#include "internal.hpp"

namespace distopt::parallel {

namespace {

std::uint64_t fnv(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::uint64_t fnv(std::uint64_t h, std::string_view s) { return fnv(fnv(h, s.data(), s.size()), "\0", 1); }
template <class T>
std::uint64_t fnv_value(std::uint64_t h, T v) {
  return fnv(h, &v, sizeof v);
}
constexpr std::uint64_t kFnvBasis = 14695981039346656037ull;

}  // namespace

namespace detail {

std::size_t layout_align(const StrategyArgs& a) {
  const quant::StateDType sd = state_dtype_of(a.optimizer.options);
  if (!quant::has_scales(sd)) return ShardLayout::kAlign;  // f32, bf16: any element may start a piece
  if (!a.info.replicated_params) {
    for (const ParamSlot& s : a.layout.params) {
      if (s.numel() < quant::kMinElements) continue;
      const auto u = std::find_if(a.layout.units.begin(), a.layout.units.end(),
                                  [&](const UnitRange& r) { return s.offset >= r.begin && s.offset < r.end; });
      const std::size_t at = u == a.layout.units.end() ? s.offset : s.offset - u->begin;
      if (at % quant::kMaxBlock != 0)
        throw InvalidInput(str("parameter ", s.name, " starts at element ", at, " of its unit: ", a.info.name, " with ",
                               kStateDTypeOption, " ", quant::name_of(sd), " needs every tensor of ",
                               quant::kMinElements, " or more elements to start on a multiple of ", quant::kMaxBlock,
                               " (place it so, or use ddp or ", kStateDTypeOption, " f32)"));
    }
  }
  return quant::kMaxBlock;
}

std::vector<ParamGroupSpec> optimizer_groups(const OptimizerSpec& spec, std::vector<Param> views, bool fallback_only) {
  std::vector<ParamGroupSpec> groups(1);
  const RuleInfo& rule = rule_or_throw(spec.name);
  if (spec.fallback.empty() || rule.check_param == nullptr) {
    groups[0].params = std::move(views);
    return groups;
  }
  ParamGroupSpec other;
  other.rule = spec.fallback;
  const OptionMap options = resolve_options(rule, spec.options);
  for (Param& p : views) {
    bool accepted = true;
    try {
      rule.check_param(options, p.tensor_shape ? *p.tensor_shape : p.value.shape);
    } catch (const InvalidInput&) {
      accepted = false;
    }
    (accepted ? groups[0] : other).params.push_back(std::move(p));
  }
  if (groups[0].params.empty() && !fallback_only)
    throw InvalidInput(str("optimizer ", spec.name, " takes none of the model's parameters"));
  if (!other.params.empty()) groups.push_back(std::move(other));
  return groups;
}

// Setup check: every rank must agree on what it is about to train. Each
// rank contributes one fingerprint per item; a mismatch names the first
// rank that differs from rank 0 and the item, on every rank alike.
void check_agreement(Communicator& comm, std::string_view strategy, const ShardLayout& layout,
                     const OptimizerSpec& spec, const StrategyOptions& options) {
  enum { kWorld, kStrategy, kModel, kOptimizer, kDtype, kCompression, kBucket, kLive, kGossip, kItems };
  static constexpr const char* kWhat[kItems] = {
      "world size",      "strategy",
      "model shapes",    "optimizer or its options",
      "parameter dtype", "gradient compression",
      "bucket size",     "live limits (prefetch, live parameters, buckets in flight)",
      "gossip options"};
  std::uint64_t mine[kItems];
  mine[kWorld] = static_cast<std::uint64_t>(comm.size());
  mine[kStrategy] = fnv(kFnvBasis, strategy);
  std::uint64_t h = kFnvBasis;
  for (const ParamSlot& s : layout.params()) {
    h = fnv(h, s.name);
    for (auto d : s.shape) h = fnv_value(h, d);
  }
  for (const auto& u : layout.units()) h = fnv_value(fnv_value(h, u.begin), u.end);
  mine[kModel] = h;
  h = fnv(fnv(kFnvBasis, spec.name), spec.fallback);
  for (const auto& [k, v] : spec.options) h = fnv(fnv(h, k), v.to_string());
  mine[kOptimizer] = h;
  mine[kDtype] = static_cast<std::uint64_t>(options.param_dtype);
  // The scheme in the low byte; PowerSGD's rank and warm-up above it.
  mine[kCompression] = static_cast<std::uint64_t>(options.grad_compression);
  if (options.grad_compression == GradCompression::powersgd)
    mine[kCompression] |= static_cast<std::uint64_t>(options.powersgd_rank) << 8 |
                          std::min<std::uint64_t>(options.powersgd_warmup, std::uint64_t{1} << 32) << 24;
  if (options.grad_compression == GradCompression::onebit)
    mine[kCompression] |= std::min<std::uint64_t>(options.onebit_warmup, std::uint64_t{1} << 32) << 24;
  if (options.int8_gather) mine[kCompression] |= std::uint64_t{1} << 63;
  mine[kBucket] = options.bucket_elements;
  // Prefetching and buckets in flight change the order in which a rank
  // starts its collectives, where they apply.
  const StrategyInfo* info = find_strategy(strategy);
  mine[kLive] = kFnvBasis;
  if (info != nullptr && info->sharded_params)
    mine[kLive] = fnv_value(fnv_value(mine[kLive], options.prefetch_units), options.max_live_params);
  if (info != nullptr && info->sharded_grads) mine[kLive] = fnv_value(mine[kLive], options.max_buckets_in_flight);
  const GossipOptions& g = options.gossip;
  h = fnv(fnv(fnv(fnv(kFnvBasis, g.topology), g.slowmo_base), g.outer_optimizer), g.outer_dtype);
  for (double v :
       {double(g.peers_per_iteration), double(g.synch_freq), double(g.localsgd_frequency), double(g.slowmo_frequency),
        g.slowmo_momentum, g.slowmo_lr, double(g.sync_every), g.outer_lr, g.outer_momentum, double(g.fragments),
        double(g.sync_delay), g.fragment_alpha, double(g.outer_error_feedback), double(g.fragment_carry)})
    h = fnv_value(h, v);
  mine[kGossip] = h;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> all(n * kItems);
  comm.all_gather(mine, all.data(), kItems, ElemType::i64);
  for (std::size_t r = 1; r < n; ++r)
    for (int k = 0; k < kItems; ++k)
      if (all[r * kItems + k] != all[k]) {
        std::string detail;
        if (k == kWorld || k == kBucket) detail = str(" (", all[r * kItems + k], " vs ", all[k], ")");
        if (k == kDtype)
          detail = str(" (", name_of(static_cast<DType>(all[r * kItems + k])), " vs ", name_of(static_cast<DType>(all[k])), ")");
        if (k == kCompression) {
          auto scheme = [](std::uint64_t v) {
            const auto c = static_cast<GradCompression>(v & 0xff);
            const std::string gathers = v >> 63 ? " and int8 gathers" : "";
            if (c == GradCompression::onebit) return str("onebit warm-up ", (v >> 24) & 0xffffffffff, gathers);
            if (c != GradCompression::powersgd) return str(name_of(c), gathers);
            return str("powersgd rank ", (v >> 8) & 0xffff, " warm-up ", (v >> 24) & 0xffffffffff, gathers);
          };
          detail = str(" (", scheme(all[r * kItems + k]), " vs ", scheme(all[k]), ")");
        }
        throw InvalidInput(str("rank ", r, " disagrees with rank 0 on the ", kWhat[k], detail,
                               ": every rank must be started with the same configuration"));
      }
}

}  // namespace detail

std::string_view name_of(GradCompression c) {
  switch (c) {
    case GradCompression::none:
      return "none";
    case GradCompression::bf16:
      return "bf16";
    case GradCompression::fp16:
      return "fp16";
    case GradCompression::int8:
      return "int8";
    case GradCompression::powersgd:
      return "powersgd";
    case GradCompression::onebit:
      return "onebit";
  }
  return "?";
}

std::optional<GradCompression> parse_grad_compression(std::string_view name) {
  for (GradCompression c : kGradCompressions)
    if (name == name_of(c)) return c;
  return std::nullopt;
}

std::string_view grad_compression_names() {
  return "none, bf16, fp16, int8, powersgd, onebit";
}

FlatLayout flat_layout(const models::Model& model) {
  FlatLayout out{model.params(), model.buffer_elements(), {}};
  for (const models::Unit& u : model.units()) out.units.push_back({u.name, u.begin, u.end, u.tile});
  return out;
}

void for_each_padded_param(const ShardLayout& layout, std::span<const float> padded,
                           const Strategy::ParamVisitor& each) {
  DISTOPT_CHECK(padded.size() >= layout.padded_elements(), padded.size(), " vs ", layout.padded_elements());
  for (std::size_t p = 0; p < layout.params().size(); ++p)
    each(p, padded.subspan(layout.padded_offset(p), layout.params()[p].numel()));
}

std::vector<float> Strategy::gather(std::span<const float> own) {
  std::vector<float> out;
  out.reserve(layout().param_elements());
  for_each_param(own, [&](std::size_t, std::span<const float> values) { out.insert(out.end(), values.begin(), values.end()); });
  return out;
}

double Strategy::consensus_distance() { return std::nan(""); }

}  // namespace distopt::parallel
