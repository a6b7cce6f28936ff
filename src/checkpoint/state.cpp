#include "distopt/checkpoint/state.hpp"

#include <algorithm>
#include <iterator>
#include <set>
#include <string_view>

#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/quant.hpp"

namespace distopt::checkpoint {
namespace {

// Position of each parameter in the model, by name.
std::map<std::string, std::size_t> slot_index(const parallel::ShardLayout& layout) {
  std::map<std::string, std::size_t> index;
  for (std::size_t k = 0; k < layout.params().size(); ++k) index[layout.params()[k].name] = k;
  return index;
}

std::string state_name(std::size_t index, const std::string& key) { return str("state.", index, ".", key); }

// The group of parameter i.
std::size_t group_index(const Optimizer& opt, std::size_t i) {
  std::size_t g = 0;
  while (g + 1 < opt.num_groups() &&
         std::find(opt.group(g).params.begin(), opt.group(g).params.end(), i) == opt.group(g).params.end())
    ++g;
  return g;
}

// The names of a parameter's small state (whole, not cut like it).
std::vector<std::string> aux_names(const Optimizer& opt, std::size_t i) {
  const Param& p = opt.param(i);
  const std::size_t g = group_index(opt, i);
  const RuleInfo& rule = opt.rule_of_group(g);
  std::vector<std::string> names;
  if (rule.aux_parts != nullptr)
    for (const AuxPart& part : rule.aux_parts(opt.group(g).options, p.tensor_shape ? *p.tensor_shape : p.value.shape))
      names.emplace_back(part.name);
  return names;
}

// Whether the strategy holds every parameter whole (in the padded layout)
// or its shard of each.
bool replicated(const parallel::Strategy& s) { return s.info().replicated_params; }

// This rank's pieces of values shaped like own_params(), named
// PREFIX<param name>, viewed in place: its shard's, or of replicated values
// the piece the rank's shard would hold.
void cut(parallel::Strategy& s, int rank, std::span<const float> own, const std::string& prefix, PieceSet& out) {
  const parallel::ShardLayout& layout = s.layout();
  const bool whole = replicated(s);
  for (const auto& pc : layout.pieces(rank)) {
    if (pc.count == 0) continue;
    const ParamSlot& slot = layout.params()[pc.param];
    const std::size_t at = whole ? pc.padded_offset : pc.shard_offset;
    DISTOPT_CHECK(at + pc.count <= own.size(), prefix, slot.name, ": ", own.size(), " own values");
    out.view(prefix + slot.name, slot.shape, pc.param_begin, own.subspan(at, pc.count));
  }
}

// Every parameter whole, from padded values, named PREFIX<param name>.
void whole_pieces(const parallel::ShardLayout& layout, std::span<const float> padded, const std::string& prefix,
                  PieceSet& out) {
  for (std::size_t p = 0; p < layout.params().size(); ++p) {
    const ParamSlot& slot = layout.params()[p];
    out.view(prefix + slot.name, slot.shape, 0, padded.subspan(layout.padded_offset(p), slot.numel()));
  }
}

// A gossip rank's optimizer state, whole, under its local prefix (no
// communication); the values packed in dict's order.
std::vector<float> add_local_state(parallel::Strategy& s, int rank, const StateDict& dict, PieceSet& out) {
  const auto index = slot_index(s.layout());
  const Optimizer& opt = s.optimizer();
  std::vector<float> packed;
  for (const auto& [i, entries] : dict.state) {
    const std::size_t slot = index.at(opt.param(i).name);
    for (const auto& [key, value] : entries) {
      const std::string name = local_prefix(rank) + state_name(slot, key);
      if (std::holds_alternative<double>(value)) {
        packed.push_back(static_cast<float>(std::get<double>(value)));
        out.add(name, {}, 0, {packed.back()});
      } else {
        const StateTensor& t = std::get<StateTensor>(value);
        out.add(name, t.shape, 0, t.data);  // a copy: the mean replaces dict's values below
        packed.insert(packed.end(), t.data.begin(), t.data.end());
      }
    }
  }
  return packed;
}

// A gossip rank's optimizer state, whole, under its local prefix; and the
// ranks' mean of it put into `dict`, for the consensus tensors (a step
// count as a float, as every checkpoint keeps it).
void local_state_pieces(parallel::Strategy& s, int rank, StateDict& dict, PieceSet& out) {
  const std::vector<float> mean = s.mean_over_ranks(add_local_state(s, rank, dict, out));
  std::size_t at = 0;
  for (auto& [i, entries] : dict.state)
    for (auto& [key, value] : entries) {
      if (std::holds_alternative<double>(value)) {
        value = static_cast<double>(mean[at++]);
      } else {
        auto& data = std::get<StateTensor>(value).data;
        std::copy_n(mean.begin() + static_cast<std::ptrdiff_t>(at), data.size(), data.begin());
        at += data.size();
      }
    }
}

}  // namespace

std::string local_prefix(int rank) { return str("gossip.", rank, "."); }

PieceSet own_pieces(parallel::Strategy& s, int rank, std::span<const float> own, const std::string& prefix) {
  PieceSet out;
  if (!s.info().per_rank_models) {
    cut(s, rank, own, prefix, out);
    return out;
  }
  cut(s, rank, out.keep(s.mean_over_ranks(own)), prefix, out);
  whole_pieces(s.layout(), own, local_prefix(rank) + prefix, out);
  return out;
}

PieceSet feedback_pieces(parallel::Strategy& s, int rank) {
  const parallel::Strategy::Feedback f = s.feedback();
  const parallel::ShardLayout& layout = s.layout();
  PieceSet out;
  if (!f.residual.empty()) whole_pieces(layout, f.residual, str("feedback.", rank, "."), out);
  if (!f.sums.empty())
    for (const auto& pc : layout.pieces(rank))
      if (pc.count > 0) {
        const ParamSlot& slot = layout.params()[pc.param];
        out.view("feedback.sums." + slot.name, slot.shape, pc.param_begin, f.sums.subspan(pc.shard_offset, pc.count));
      }
  if (rank == 0)  // the same on every rank
    for (const auto& q : f.factors)
      out.view("feedback.q." + layout.params()[q.param].name, {std::int64_t(q.q.size() / q.rank), std::int64_t(q.rank)},
               0, q.q);
  return out;
}

std::string load_feedback(parallel::Strategy& s, const TensorSource& source, int rank, int world) {
  const parallel::ShardLayout& layout = s.layout();
  const auto& params = layout.params();
  const std::vector<std::string> names = source.names_under("feedback.");
  const auto index = slot_index(layout);
  int saved_world = 0;  // 1 + the highest rank with feedback saved
  for (const std::string& name : names) {
    const std::string rest = name.substr(std::string_view("feedback.").size());
    const std::size_t dot = rest.find('.');
    const std::string who = rest.substr(0, dot);
    const bool known_kind = who == "sums" || who == "q" ||
                            (!who.empty() && who.size() < 10 && (who.size() == 1 || who[0] != '0') &&
                             std::all_of(who.begin(), who.end(), [](char c) { return c >= '0' && c <= '9'; }));
    if (dot == std::string::npos || !known_kind || !index.contains(rest.substr(dot + 1)))
      throw InvalidInput(str("the checkpoint's ", name,
                             " is no parameter's error feedback (feedback.<rank>.<param>, feedback.sums.<param> or "
                             "feedback.q.<param>)"));
    if (who != "sums" && who != "q") saved_world = std::max(saved_world, std::stoi(who) + 1);
  }
  const parallel::Strategy::Feedback f = s.feedback();
  std::fill(f.residual.begin(), f.residual.end(), 0.0f);
  std::fill(f.sums.begin(), f.sums.end(), 0.0f);
  if (f.residual.empty())
    return names.empty()
               ? ""
               : "resuming without --grad-compression int8, powersgd or onebit: the checkpoint's error feedback is "
                 "dropped";
  // PowerSGD's warm start, where the checkpoint's has this run's rank (else
  // the run's own first draw).
  for (const auto& q : f.factors) {
    const std::string name = "feedback.q." + params[q.param].name;
    const Shape* shape = source.shape(name);
    if (shape != nullptr && *shape == Shape{std::int64_t(q.q.size() / q.rank), std::int64_t(q.rank)})
      source.read(name, 0, q.q);
  }
  auto saved = [&](const std::string& prefix) {  // whether the checkpoint has them, shaped as the model's
    bool any = false;
    for (const ParamSlot& slot : params) {
      const Shape* shape = source.shape(prefix + slot.name);
      if (shape == nullptr) continue;
      if (*shape != slot.shape)
        throw InvalidInput(str(prefix, slot.name, " is ", to_string(*shape), " in the checkpoint, ",
                               to_string(slot.shape), " in the model"));
      any = true;
    }
    return any;
  };
  for (int r = 0; r < saved_world; ++r)  // every rank's, or what the ranks owe in total is lost
    if (!saved(str("feedback.", r, ".")))
      throw InvalidInput(str("the checkpoint has error feedback for rank ", saved_world - 1, " but none for rank ", r));
  std::vector<float> values;
  auto add_whole = [&](const std::string& prefix) {  // every parameter whole, added to the residual
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (source.shape(prefix + params[p].name) == nullptr)
        throw InvalidInput(str("the checkpoint has no ", prefix, params[p].name, " beside its other error feedback"));
      values.resize(params[p].numel());
      source.read(prefix + params[p].name, 0, values);
      float* to = f.residual.data() + layout.padded_offset(p);
      for (std::size_t i = 0; i < values.size(); ++i) to[i] += values[i];
    }
  };
  for (int r = rank; r < saved_world; r += world) add_whole(str("feedback.", r, "."));
  if (!saved("feedback.sums.")) return "";
  if (f.sums.empty()) {
    if (rank == 0) add_whole("feedback.sums.");
    return "";
  }
  for (const auto& pc : layout.pieces(rank)) {
    const std::string name = "feedback.sums." + params[pc.param].name;
    if (pc.count == 0) continue;
    if (source.shape(name) == nullptr)
      throw InvalidInput(str("the checkpoint has no ", name, " beside its other error feedback"));
    source.read(name, pc.param_begin, f.sums.subspan(pc.shard_offset, pc.count));
  }
  return "";
}

std::vector<float> own_values(parallel::Strategy& s, int rank, const TensorSource& source, const std::string& prefix) {
  const parallel::ShardLayout& layout = s.layout();
  std::vector<float> own(s.own_elements(), 0.0f);
  for (std::size_t p = 0; p < layout.params().size(); ++p) {
    const ParamSlot& slot = layout.params()[p];
    const Shape* shape = source.shape(prefix + slot.name);
    if (shape == nullptr) throw InvalidInput(str("the checkpoint has no tensor ", prefix, slot.name));
    if (*shape != slot.shape)
      throw InvalidInput(str(prefix, slot.name, " is ", to_string(*shape), " in the checkpoint, ",
                             to_string(slot.shape), " in the model"));
  }
  const std::span<float> to(own);
  // Replicated values (ddp, gossip) hold every parameter whole; a shard its pieces.
  if (replicated(s)) {
    for (std::size_t p = 0; p < layout.params().size(); ++p) {
      const ParamSlot& slot = layout.params()[p];
      source.read(prefix + slot.name, 0, to.subspan(layout.padded_offset(p), slot.numel()));
    }
    return own;
  }
  for (const auto& pc : layout.pieces(rank))
    if (pc.count > 0)
      source.read(prefix + layout.params()[pc.param].name, pc.param_begin, to.subspan(pc.shard_offset, pc.count));
  return own;
}

PieceSet strategy_pieces(parallel::Strategy& s, int rank) {
  const bool gossip = s.info().per_rank_models;
  const std::span<const float> params = s.own_params();
  PieceSet out;
  cut(s, rank, gossip ? out.keep(s.mean_over_ranks(params)) : params, "param.", out);
  const parallel::ShardLayout& layout = s.layout();
  const bool whole = replicated(s);
  Optimizer& opt = s.optimizer();
  const auto index = slot_index(layout);
  const auto pieces = layout.pieces(rank);
  // One tensor of parameter i's state: the rank's piece of a whole (ddp,
  // gossip) tensor, or the whole of its piece; a small state whole.
  auto add_state = [&](std::size_t i, const std::string& key, const Shape& shape, std::span<const float> values,
                       bool scalar) {
    const std::size_t slot = index.at(opt.param(i).name);
    const auto& pc = pieces[slot];
    const std::string name = state_name(slot, key);
    if (scalar) return out.add(name, {}, 0, {values[0]});
    const std::vector<std::string> aux = aux_names(opt, i);
    if (std::find(aux.begin(), aux.end(), key) != aux.end()) return out.view(name, shape, 0, values);
    const std::size_t skip = whole ? pc.param_begin : 0;
    DISTOPT_CHECK(values.size() >= skip + pc.count, name, ": ", values.size(), " elements");
    out.view(name, layout.params()[slot].shape, pc.param_begin, values.subspan(skip, pc.count));
  };
  auto here = [&](std::size_t i) { return pieces[index.at(opt.param(i).name)].count > 0; };
  if (gossip) {
    for (std::size_t i = 0; i < opt.num_params(); ++i)
      if (!opt.quantized_views(i).empty())
        throw InvalidInput(
            str(s.info().name, " checkpoints keep each rank's optimizer state in fp32: ", kStateDTypeOption, " ",
                quant::name_of(opt.quantized_views(i).front().dtype), " is checkpointed under ddp and zero1-3 only"));
    // The ranks' mean of their states (collective: every rank takes part).
    StateDict dict = opt.state_dict();
    PieceSet mine;
    local_state_pieces(s, rank, dict, mine);
    out.append(std::move(mine));
    for (auto& [i, entries] : dict.state) {
      if (!here(i)) continue;  // nothing of it here (its small state may be stale)
      for (auto& [key, value] : entries) {
        if (std::holds_alternative<double>(value)) {
          const float v = static_cast<float>(std::get<double>(value));
          add_state(i, key, {}, std::span(&v, 1), true);
        } else {
          StateTensor& t = std::get<StateTensor>(value);
          add_state(i, key, t.shape, out.keep(std::move(t.data)), false);
        }
      }
    }
    return out;
  }
  // Quantized state as state_dict() gives it: the values its codes stand for,
  // cut like the parameter, and its block scales under KEY.absmax, each
  // block's scale written by the rank whose piece holds the block's first
  // element (the sharded layouts start pieces on blocks: quant.hpp).
  auto add_quantized = [&](std::size_t i, const Optimizer::QuantizedView& in_place) {
    const Optimizer::HostQuantized host(in_place, true);  // device state: a copy
    const Optimizer::QuantizedView& q = host.view();
    const std::size_t slot = index.at(opt.param(i).name);
    const auto& pc = pieces[slot];
    const std::size_t block = quant::block_of(q.dtype);
    const std::size_t held_from = whole ? 0 : pc.param_begin;  // the optimizer's first element, in the tensor
    DISTOPT_CHECK(held_from % block == 0 && pc.param_begin + pc.count <= held_from + q.elements,
                  state_name(slot, q.key));
    // The blocks that hold the piece (under ddp a piece may start mid-block), then the piece of them.
    const std::size_t begin = pc.param_begin - held_from, from = begin / block * block;
    std::vector<float> values(begin + pc.count - from);
    const bool scaled = quant::has_scales(q.dtype);
    quant::dequantize(q.dtype, q.is_signed, q.codes + quant::code_bytes(q.dtype, from),
                      scaled ? q.absmax + from / block : nullptr, values.size(), values.data());
    values.erase(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(begin - from));
    const ParamSlot& p = layout.params()[slot];
    out.view(state_name(slot, q.key), p.shape, pc.param_begin, out.keep(std::move(values)));
    const std::size_t first = (pc.param_begin + block - 1) / block,
                      last = (pc.param_begin + pc.count + block - 1) / block;
    if (scaled && first < last) {
      std::span<const float> scales(q.absmax + (first - held_from / block), last - first);
      if (in_place.device != Device::cpu) scales = out.keep(std::vector<float>(scales.begin(), scales.end()));
      out.view(state_name(slot, q.key + std::string(quant::kAbsmaxSuffix)),
               {static_cast<std::int64_t>(quant::num_blocks(q.dtype, p.numel()))}, first, scales);
    }
  };
  // The state where the optimizer keeps it, in state_dict()'s order (by key).
  for (std::size_t i = 0; i < opt.num_params(); ++i) {
    if (!here(i)) continue;
    std::vector<Optimizer::StateView> views = opt.state_views(i);
    std::sort(views.begin(), views.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
    for (const Optimizer::StateView& v : views) {
      const bool scalar = v.shape.empty();
      add_state(i, v.key, v.shape, {v.data, scalar ? 1 : static_cast<std::size_t>(numel(v.shape))}, scalar);
    }
    for (const Optimizer::QuantizedView& q : opt.quantized_views(i)) add_quantized(i, q);
  }
  return out;
}

std::map<std::string, Whole> read_wholes(const std::filesystem::path& dir, const Manifest& manifest) {
  const PieceFiles files(dir, manifest);
  std::map<std::string, Whole> out;
  for (const std::string& name : files.names()) out.emplace(name, Whole{*files.shape(name), files.whole(name)});
  return out;
}

parallel::InitialParams initial_params(const parallel::FlatLayout& layout, const TensorSource& source) {
  for (const std::string& name : source.names()) {
    if (name.rfind("param.", 0) == 0) {
      const bool known = std::any_of(layout.params.begin(), layout.params.end(),
                                     [&](const ParamSlot& s) { return "param." + s.name == name; });
      if (!known) throw InvalidInput(str("the checkpoint has a parameter ", name.substr(6), " that the model lacks"));
    } else if (name.rfind("state.", 0) != 0 && name.rfind("avg.", 0) != 0 && name.rfind("gossip.", 0) != 0 &&
               name.rfind("feedback.", 0) != 0) {
      throw InvalidInput(str("the checkpoint has a tensor ", name,
                             " that is no parameter, optimizer state, average, gossip rank's state or error feedback"));
    }
  }
  for (const ParamSlot& s : layout.params) {
    const Shape* shape = source.shape("param." + s.name);
    if (shape == nullptr) throw InvalidInput(str("the checkpoint has no parameter ", s.name));
    if (*shape != s.shape)
      throw InvalidInput(str("parameter ", s.name, " is ", to_string(*shape), " in the checkpoint, ",
                             to_string(s.shape), " in the model"));
  }
  // Each range read as a strategy asks for it (a shard, a unit, or all).
  return parallel::InitialParams(layout.elements, [&layout, &source](std::size_t begin, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.0f);
    const std::size_t end = begin + out.size();
    for (const ParamSlot& s : layout.params) {
      const std::size_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel());
      if (lo < hi) source.read("param." + s.name, lo - s.offset, out.subspan(lo - begin, hi - lo));
    }
  });
}

void load_optimizer_state(parallel::Strategy& s, const TensorSource& source, const std::string& from) {
  Optimizer& opt = s.optimizer();
  StateDict none = opt.state_dict();  // the groups as they are; the state from the checkpoint
  none.state.clear();
  const auto index = slot_index(s.layout());
  // Every state tensor of the checkpoint must be one this run's rules keep.
  std::set<std::string> known;
  for (std::size_t i = 0; i < opt.num_params(); ++i) {
    const std::size_t g = group_index(opt, i);
    const std::string prefix = from + state_name(index.at(opt.param(i).name), "");
    const StateLayout l = opt.rule_of_group(g).layout(opt.group(g).options);
    const RuleInfo& rule = opt.rule_of_group(g);
    for (std::size_t k = 0; k < l.tensors.size(); ++k) {  // and the scales of one the rule may quantize
      known.insert(prefix + std::string(l.tensors[k]));
      if (rule.quantized[k] != QuantSign::none)
        known.insert(prefix + std::string(l.tensors[k]) + std::string(quant::kAbsmaxSuffix));
    }
    for (auto key : l.scalars) known.insert(prefix + std::string(key));
    for (const std::string& key : aux_names(opt, i)) known.insert(prefix + key);
    known.insert(prefix + "master_param");
  }
  const std::vector<std::string> saved = source.names_under(from + "state.");
  for (const std::string& name : saved)
    if (!known.count(name))
      throw InvalidInput(str("the checkpoint's ", name, " is not a state this run's optimizer keeps (",
                             opt.rule().name, "; another optimizer's checkpoint, or another model's?)"));
  // Each parameter with saved state gets its state made, as its first step
  // would make it, and every tensor of it is checked against the saved one;
  // then the values are read into place. No copy of the state is held
  // besides the optimizer's own.
  struct Fill {
    std::string name;
    std::uint64_t begin;
    Optimizer::StateView view;
    std::size_t count;
  };
  std::vector<Fill> fills;
  // A quantized tensor: its values, and its scales where the checkpoint
  // has them for this storage (else the values are quantized afresh: a
  // checkpoint of fp32 state, or of another state_dtype).
  struct QuantizedFill {
    std::string name, scales;
    std::uint64_t begin;
    Optimizer::QuantizedView view;
  };
  std::vector<QuantizedFill> quantized;
  opt.load_state_dict(none);
  try {
    for (std::size_t i = 0; i < opt.num_params(); ++i) {
      const Param& p = opt.param(i);
      const std::string prefix = from + state_name(index.at(p.name), "");
      const auto first = std::lower_bound(saved.begin(), saved.end(), prefix);
      if (first == saved.end() || first->rfind(prefix, 0) != 0) continue;  // none: its next step starts it
      opt.init_state(i);
      const std::vector<std::string> aux = aux_names(opt, i);
      const bool empty = p.value.numel() == 0;  // a rank's piece of no elements: its tensors hold nothing
      for (Optimizer::StateView& v : opt.state_views(i)) {
        const std::string name = prefix + v.key;
        const bool aux_part = std::find(aux.begin(), aux.end(), v.key) != aux.end();
        if (empty && !v.shape.empty() && !aux_part) continue;
        const Shape* shape = source.shape(name);
        if (shape == nullptr) throw InvalidInput(str("the checkpoint's state of parameter ", p.name, " lacks ", name));
        const std::uint64_t held = elements_of(*shape);
        const bool scalar = v.shape.empty();
        if (scalar != shape->empty())
          throw InvalidInput(str("the checkpoint's ", name, " must be a ", scalar ? "number" : "tensor"));
        if (aux_part) {
          const auto count = static_cast<std::size_t>(numel(v.shape));
          if (held != count)
            throw InvalidInput(
                str("the checkpoint's ", name, " has ", held, " elements, parameter ", p.name, " needs ", count));
          fills.push_back({name, 0, std::move(v), count});
        } else {
          // Cut like the parameter: its piece here (the whole under ddp).
          const std::uint64_t begin = scalar ? 0 : p.tensor_offset;
          const std::size_t count = scalar ? 1 : static_cast<std::size_t>(p.value.numel());
          if (held < begin + count)
            throw InvalidInput(str("optimizer state ", name, " has ", held, " elements, parameter ", p.name, " needs ",
                                   begin + count));
          fills.push_back({name, begin, std::move(v), count});
        }
      }
      for (Optimizer::QuantizedView& q : opt.quantized_views(i)) {
        const std::string name = prefix + q.key;
        const Shape* shape = source.shape(name);
        if (shape == nullptr) throw InvalidInput(str("the checkpoint's state of parameter ", p.name, " lacks ", name));
        const std::uint64_t held = elements_of(*shape), begin = p.tensor_offset;
        if (shape->empty() || held < begin + q.elements)
          throw InvalidInput(str("optimizer state ", name, " has ", held, " elements, parameter ", p.name, " needs ",
                                 begin + q.elements));
        // The scales, where the checkpoint has this storage's; none, or
        // another storage's (int8 scales into int4 state): quantized afresh.
        std::string scales = name + std::string(quant::kAbsmaxSuffix);
        if (const Shape* s_shape = source.shape(scales); s_shape != nullptr) {
          const auto kind = s_shape->size() != 1 ? quant::SavedScales::misfit
                                                 : quant::classify_scales(q.dtype, held, elements_of(*s_shape));
          if (kind == quant::SavedScales::misfit)
            throw InvalidInput(str("the checkpoint's ", scales, " is ", to_string(*s_shape), "; ", held,
                                   " elements have ", quant::num_blocks(q.dtype, held), " blocks of ",
                                   quant::block_of(q.dtype), " (", quant::name_of(q.dtype), ")"));
          if (kind == quant::SavedScales::other_storage) scales.clear();
        } else {
          scales.clear();
        }
        quantized.push_back({name, std::move(scales), begin, std::move(q)});
      }
    }
    std::vector<float> staged;  // for state on a device
    for (const Fill& f : fills) {
      if (f.view.device == Device::cpu) {
        source.read(f.name, f.begin, {f.view.data, f.count});
        continue;
      }
      staged.resize(f.count);
      source.read(f.name, f.begin, staged);
      copy_bytes(f.view.data, f.view.device, staged.data(), Device::cpu, f.count * sizeof(float));
    }
    std::vector<float> scales;
    for (const QuantizedFill& f : quantized) {
      const Optimizer::HostQuantized host(f.view, false);  // device state: written from a copy
      const Optimizer::QuantizedView& q = host.view();
      const std::size_t block = quant::block_of(q.dtype);
      DISTOPT_CHECK(f.begin % block == 0, f.name, " from element ", f.begin);
      staged.resize(q.elements);
      source.read(f.name, f.begin, staged);
      if (!f.scales.empty()) {
        scales.resize(quant::num_blocks(q.dtype, q.elements));
        source.read(f.scales, f.begin / block, scales);
      }
      if (const long b = quant::load(q.dtype, q.is_signed, staged.data(), q.elements,
                                     f.scales.empty() ? nullptr : scales.data(), q.codes, q.absmax);
          b >= 0)
        throw InvalidInput(str("the checkpoint's ", f.name, " is not ", quant::name_of(q.dtype), " codes times ",
                               f.scales, " (block ", f.begin / block + static_cast<std::size_t>(b), ")"));
      host.commit();
    }
  } catch (...) {
    opt.load_state_dict(none);  // nothing half-loaded: no state
    throw;
  }
  opt.state_written();
}

}  // namespace distopt::checkpoint

namespace distopt::checkpoint {

PieceSet local_pieces(const parallel::LocalState& state, int rank) {
  PieceSet out;
  for (const auto& [name, values] : state.tensors)
    out.view(local_prefix(rank) + name, {static_cast<std::int64_t>(values.size())}, 0, values);
  return out;
}

parallel::LocalState local_state(const TensorSource& source, int rank, std::uint64_t steps,
                                 std::vector<double> scalars) {
  parallel::LocalState st;
  st.steps = steps;
  st.scalars = std::move(scalars);
  const std::string prefix = local_prefix(rank);
  for (const std::string& full : source.names_under(prefix)) {
    const std::string name = full.substr(prefix.size());
    if (name.rfind("state.", 0) == 0 || name.rfind("avg.", 0) == 0) continue;
    st.tensors.emplace_back(name, source.whole(full));
  }
  if (st.tensors.empty()) throw InvalidInput(str("the checkpoint has no gossip state of rank ", rank));
  return st;
}

PieceSet survivor_pieces(parallel::Strategy& s, int rank, const parallel::LocalState& state,
                         std::span<const float> averaged) {
  PieceSet out;
  for (const auto& [name, values] : state.tensors)
    if (name == "x")  // (in the model's flat layout)
      for (const ParamSlot& slot : s.layout().params())
        out.view("param." + slot.name, slot.shape, 0, std::span<const float>(values).subspan(slot.offset, slot.numel()));
  add_local_state(s, rank, s.optimizer().state_dict(), out);
  if (!averaged.empty()) whole_pieces(s.layout(), averaged, local_prefix(rank) + "avg.", out);
  out.append(local_pieces(state, rank));
  return out;
}

}  // namespace distopt::checkpoint
