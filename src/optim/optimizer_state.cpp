// The Optimizer's state, read and written (include/distopt/optim/optimizer.hpp): per-parameter
// access (has_state, state_tensor, state_scalar, state_views, init_state, reset_state), torch's
// state_dict and load_state_dict, and its size (state_bytes, master_bytes).
#include "distopt/optim/optimizer.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "optimizer_impl.hpp"

namespace distopt {

namespace {

// A quantized state tensor's values (n elements on `device`).
void dequantize(const QuantizedTensor& q, std::size_t n, Device device, float* out) {
  const Optimizer::HostQuantized h(view_of(q, "", n, device), true);
  quant::dequantize(q.dtype, q.is_signed, h.view().codes, h.view().absmax, n, out);
}

// Saved values into quantized state: with their saved scales (validated
// before: exact), else quantized afresh (an fp32 state, or another
// storage's, loaded into quantized storage).
void load_quantized(QuantizedTensor& q, const std::vector<float>& values, const std::vector<float>* absmax,
                    Device device) {
  const Optimizer::HostQuantized h(view_of(q, "", values.size(), device), false);
  DISTOPT_CHECK(quant::load(q.dtype, q.is_signed, values.data(), values.size(),
                            absmax == nullptr ? nullptr : absmax->data(), h.view().codes, h.view().absmax) < 0,
                "validated state");
  h.commit();
}

// The saved scales of state tensor `key` when they are this storage's;
// nullptr when there are none, or another storage's (quant::classify_scales);
// InvalidInput for any other size.
const std::vector<float>* saved_scales(const std::map<std::string, std::variant<double, StateTensor>>& entry,
                                       std::string_view key, quant::StateDType sd, std::size_t n, std::size_t id) {
  const auto e = entry.find(str(key, kAbsmaxSuffix));
  if (e == entry.end()) return nullptr;
  const auto* t = std::get_if<StateTensor>(&e->second);
  const auto kind = t == nullptr ? quant::SavedScales::misfit : quant::classify_scales(sd, n, t->data.size());
  if (kind == quant::SavedScales::this_storage) return &t->data;
  if (kind == quant::SavedScales::other_storage) return nullptr;
  throw InvalidInput(str("loaded state '", e->first, "' of parameter ", id, " must be a tensor of ",
                         quant::num_blocks(sd, n), " block scales (got ",
                         t == nullptr ? "a number" : str(t->data.size(), " elements"), ")"));
}

}  // namespace

Optimizer::HostQuantized::HostQuantized(const QuantizedView& q, bool read) : of_(q), host_(q) {
  if (q.device == Device::cpu) return;
  codes_.resize(quant::code_bytes(q.dtype, q.elements));
  absmax_.resize(quant::num_blocks(q.dtype, q.elements));
  host_.codes = codes_.data();
  host_.absmax = quant::has_scales(q.dtype) ? absmax_.data() : nullptr;
  host_.device = Device::cpu;
  if (!read) return;
  copy_bytes(codes_.data(), Device::cpu, q.codes, q.device, codes_.size());
  if (!absmax_.empty()) copy_bytes(absmax_.data(), Device::cpu, q.absmax, q.device, absmax_.size() * sizeof(float));
}

void Optimizer::HostQuantized::commit() const {
  if (of_.device == Device::cpu) return;
  copy_bytes(of_.codes, of_.device, codes_.data(), Device::cpu, codes_.size());
  if (!absmax_.empty()) copy_bytes(of_.absmax, of_.device, absmax_.data(), Device::cpu, absmax_.size() * sizeof(float));
}

bool Optimizer::has_state(std::size_t i) const {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  return state_[i]->initialized;
}

std::span<const float> Optimizer::state_tensor(std::size_t i, std::string_view key) const {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  wait_for_caller();
  const ParamState& st = *state_[i];
  const auto n = static_cast<std::size_t>(params_[i].value.numel());
  // Device state is copied to the host (valid until the next call for this parameter).
  auto readable = [&](const Buffer& b, std::size_t count) -> std::span<const float> {
    if (b.device() == Device::cpu) return {b.as<float>(), count};
    st.host_copy.resize(count);
    copy_bytes(st.host_copy.data(), Device::cpu, b.data(), b.device(), count * sizeof(float));
    return st.host_copy;
  };
  if (key == "master_param" && !st.master.empty()) return readable(st.master, n);
  for (std::size_t k = 0; k < st.tensor_names.size(); ++k) {
    if (st.tensor_names[k] != key) continue;
    if (k < st.quantized.size() && st.quantized[k].on()) {  // its values, read back from the codes
      st.host_copy.resize(n);
      dequantize(st.quantized[k], n, device_, st.host_copy.data());
      return st.host_copy;
    }
    if (!st.tensors[k].empty() || n == 0) return readable(st.tensors[k], n);
  }
  for (std::size_t k = 0; k < st.quantized.size(); ++k) {
    const QuantizedTensor& q = st.quantized[k];
    if (quant::has_scales(q.dtype) && key == str(st.tensor_names[k], kAbsmaxSuffix))
      return readable(q.absmax, quant::num_blocks(q.dtype, n));
  }
  const RuleInfo& rule = *group_rules_[group_of_[i]];
  if (rule.aux_parts != nullptr && st.initialized)
    for (const AuxPart& part : rule.aux_parts(groups_[group_of_[i]].options, tensor_shape_of(i)))
      if (part.name == key)
        return {st.aux.as<float>() + part.offset, static_cast<std::size_t>(numel(part.shape))};
  throw InvalidInput(str("parameter ", i, " has no state tensor '", key, "'"));
}

double Optimizer::state_scalar(std::size_t i, std::string_view key) const {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  const ParamState& st = *state_[i];
  for (std::size_t k = 0; k < st.scalar_names.size(); ++k)
    if (st.scalar_names[k] == key) return st.scalars[k];
  throw InvalidInput(str("parameter ", i, " has no state scalar '", key, "'"));
}

std::vector<Optimizer::StateView> Optimizer::state_views(std::size_t i) {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  ParamState& st = *state_[i];
  std::vector<StateView> views;
  if (!st.initialized) return views;
  const Shape& shape = params_[i].value.shape;
  for (std::size_t k = 0; k < st.scalar_names.size(); ++k)
    views.push_back({std::string(st.scalar_names[k]), &st.scalars[k], {}});
  for (std::size_t k = 0; k < st.tensor_names.size(); ++k) {
    if (k < st.quantized.size() && st.quantized[k].on()) continue;        // quantized_views
    if (st.tensors[k].empty() && params_[i].value.numel() > 0) continue;  // not kept for this shape
    views.push_back({std::string(st.tensor_names[k]), st.tensors[k].as<float>(), shape, device_});
  }
  const RuleInfo& rule = *group_rules_[group_of_[i]];
  if (rule.aux_parts != nullptr)
    for (const AuxPart& part : rule.aux_parts(groups_[group_of_[i]].options, tensor_shape_of(i)))
      views.push_back({std::string(part.name), st.aux.as<float>() + part.offset, part.shape});
  if (!st.master.empty()) views.push_back({"master_param", st.master.as<float>(), shape, device_});
  return views;
}

std::vector<Optimizer::QuantizedView> Optimizer::quantized_views(std::size_t i) {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  wait_for_caller();  // device state is read and written from the host (HostQuantized)
  ParamState& st = *state_[i];
  std::vector<QuantizedView> views;
  if (!st.initialized) return views;
  for (std::size_t k = 0; k < st.quantized.size(); ++k) {
    QuantizedTensor& q = st.quantized[k];
    if (q.on())
      views.push_back(view_of(q, st.tensor_names[k], static_cast<std::size_t>(params_[i].value.numel()), device_));
  }
  return views;
}

void Optimizer::init_state(std::size_t i) {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  wait_for_caller();
  settle_skipped_step();
  ensure_state(i, group_of_[i]);
}

void Optimizer::reset_state(std::size_t i) {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  wait_for_caller();
  settle_skipped_step();
  forget_state(i);  // ensure_state re-fills the kept buffers
  if (group_rules_[group_of_[i]]->eager_state) ensure_state(i, group_of_[i]);
  state_written();  // a group-counted step (LAMB) follows the parameters that keep state
}

StateDict Optimizer::state_dict() const {
  StateDict d;
  d.param_groups = groups_;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamState& st = *state_[i];
    if (!st.initialized) continue;
    auto& entry = d.state[i];
    const Shape& shape = params_[i].value.shape;
    for (std::size_t k = 0; k < st.scalar_names.size(); ++k)
      entry[std::string(st.scalar_names[k])] = double{st.scalars[k]};
    for (std::size_t k = 0; k < st.tensor_names.size(); ++k) {
      const bool quantized = k < st.quantized.size() && st.quantized[k].on();
      if (!quantized && st.tensors[k].empty() && params_[i].value.numel() > 0) continue;  // not kept for this shape
      auto span = state_tensor(i, st.tensor_names[k]);
      entry[std::string(st.tensor_names[k])] = StateTensor{shape, {span.begin(), span.end()}};
      if (!quantized || !quant::has_scales(st.quantized[k].dtype)) continue;
      // The values read back, and each block's scale: a load quantizes them to the same codes.
      const std::string key = str(st.tensor_names[k], kAbsmaxSuffix);
      span = state_tensor(i, key);
      entry[key] = StateTensor{{static_cast<std::int64_t>(span.size())}, {span.begin(), span.end()}};
    }
    const RuleInfo& rule = *group_rules_[group_of_[i]];
    if (rule.aux_parts != nullptr)
      for (const AuxPart& part : rule.aux_parts(groups_[group_of_[i]].options, tensor_shape_of(i))) {
        const float* a = st.aux.as<float>() + part.offset;
        entry[std::string(part.name)] = StateTensor{part.shape, {a, a + numel(part.shape)}};
      }
    if (!st.master.empty()) {
      auto span = state_tensor(i, "master_param");
      entry["master_param"] = StateTensor{shape, {span.begin(), span.end()}};
    }
  }
  return d;
}

void Optimizer::load_state_dict(const StateDict& dict) {
  // Validate the whole dict before touching anything.
  if (dict.param_groups.size() != groups_.size())
    throw InvalidInput(str("loaded state dict has ", dict.param_groups.size(),
                           " parameter groups, the optimizer has ", groups_.size()));
  std::vector<OptionMap> options(groups_.size());
  std::vector<StateLayout> layouts(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (dict.param_groups[g].params.size() != groups_[g].params.size())
      throw InvalidInput(str("loaded state dict contains a parameter group (", g, ") of ",
                             dict.param_groups[g].params.size(), " parameters that doesn't match the size of "
                             "optimizer's group (", groups_[g].params.size(), ")"));
    const RuleInfo& rule = *group_rules_[g];
    if (!dict.param_groups[g].rule.empty() && dict.param_groups[g].rule != rule.name)
      throw InvalidInput(str("loaded state dict's parameter group ", g, " is for optimizer ", dict.param_groups[g].rule,
                             ", this group's is ", rule.name));
    OptionMap given = dict.param_groups[g].options;
    given.erase(std::string(kStateDTypeOption));  // a group's storage stays what it was made with
    if (const auto sd = groups_[g].options.find(kStateDTypeOption); sd != groups_[g].options.end())
      given[sd->first] = sd->second;
    options[g] = resolve_options(rule, given);
    rule.validate(options[g]);
    layouts[g] = rule.layout(options[g]);
  }
  // Saved ids map to current parameters by position, as in torch.
  std::map<std::size_t, std::size_t> id_to_param;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (std::size_t k = 0; k < groups_[g].params.size(); ++k)
      id_to_param[dict.param_groups[g].params[k]] = groups_[g].params[k];
  for (const auto& item : dict.state) {
    // Named copies, not structured bindings: the lambda below captures them
    // (clang 14, used for fuzzing, cannot capture a structured binding).
    const std::size_t id = item.first;
    const auto& entry = item.second;
    auto it = id_to_param.find(id);
    if (it == id_to_param.end()) throw InvalidInput(str("loaded state refers to unknown parameter id ", id));
    const std::size_t i = it->second;
    const StateLayout& l = layouts[group_of_[i]];
    const auto n = static_cast<std::size_t>(params_[i].value.numel());
    auto need = [&](std::string_view key, bool tensor, std::size_t size) {
      auto e = entry.find(std::string(key));
      if (e == entry.end()) throw InvalidInput(str("loaded state of parameter ", id, " lacks '", key, "'"));
      if (tensor != std::holds_alternative<StateTensor>(e->second))
        throw InvalidInput(str("loaded state '", key, "' of parameter ", id, " must be a ",
                               tensor ? "tensor" : "number"));
      if (tensor && std::get<StateTensor>(e->second).data.size() != size)
        throw InvalidInput(str("loaded state '", key, "' of parameter ", id, " has ",
                               std::get<StateTensor>(e->second).data.size(), " elements, it needs ", size));
    };
    const OptionMap& group_options = options[group_of_[i]];
    const RuleInfo& rule = *group_rules_[group_of_[i]];
    for (std::size_t k = 0; k < l.tensors.size(); ++k)
      if (rule.tensor_needed == nullptr || rule.tensor_needed(group_options, k, tensor_shape_of(i)))
        need(l.tensors[k], true, n);
    // Saved scales of state that is kept quantized here: the values must be
    // exactly codes times these scales (what state_dict() gives).
    const quant::StateDType sd = state_dtype_of(group_options);
    for (std::size_t k = 0; k < l.tensors.size(); ++k) {
      if (!quantizes(rule, sd, k, tensor_shape_of(i)) || !entry.count(std::string(l.tensors[k]))) continue;
      const std::vector<float>* absmax = saved_scales(entry, l.tensors[k], sd, n, id);
      if (absmax == nullptr) continue;
      const auto& values = std::get<StateTensor>(entry.at(std::string(l.tensors[k]))).data;
      std::vector<std::uint8_t> codes(quant::code_bytes(sd, n));
      if (const long b = quant::requantize(sd, rule.quantized[k] == QuantSign::is_signed, values.data(), n,
                                           absmax->data(), codes.data());
          b >= 0)
        throw InvalidInput(str("loaded state '", l.tensors[k], "' of parameter ", id, " is not ", quant::name_of(sd),
                               " codes times '", l.tensors[k], kAbsmaxSuffix, "' (block ", b, ")"));
    }
    for (auto key : l.scalars) need(key, false, 0);
    if (rule.aux_parts != nullptr)
      for (const AuxPart& part : rule.aux_parts(group_options, tensor_shape_of(i)))
        need(part.name, true, static_cast<std::size_t>(numel(part.shape)));
    if (params_[i].value.dtype != DType::f32) need("master_param", true, n);
  }
  // Apply.
  wait_for_caller();
  if (skip_) skip_->pending = false;  // the loaded state replaces whatever that step did
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].options = std::move(options[g]);
    groups_[g].extras = dict.param_groups[g].extras;
    layouts_[g] = {std::move(layouts[g]), next_version_++};
  }
  for (std::size_t i = 0; i < params_.size(); ++i) *state_[i] = ParamState{};
  for (const auto& [id, entry] : dict.state) {
    const std::size_t i = id_to_param.at(id);
    const std::size_t g = group_of_[i];
    ensure_state(i, g);
    ParamState& st = *state_[i];
    for (std::size_t k = 0; k < st.tensor_names.size(); ++k) {
      const bool quantized = k < st.quantized.size() && st.quantized[k].on();
      if (!quantized && st.tensors[k].empty()) continue;  // not kept for this shape
      const auto& t = std::get<StateTensor>(entry.at(std::string(st.tensor_names[k])));
      if (quantized) {
        load_quantized(st.quantized[k], t.data,
                       saved_scales(entry, st.tensor_names[k], st.quantized[k].dtype, t.data.size(), id), device_);
        continue;
      }
      copy_bytes(st.tensors[k].data(), device_, t.data.data(), Device::cpu, t.data.size() * sizeof(float));
    }
    if (group_rules_[g]->aux_parts != nullptr)
      for (const AuxPart& part : group_rules_[g]->aux_parts(groups_[g].options, tensor_shape_of(i))) {
        const auto& t = std::get<StateTensor>(entry.at(std::string(part.name)));
        std::copy(t.data.begin(), t.data.end(), st.aux.as<float>() + part.offset);
      }
    for (std::size_t k = 0; k < st.scalar_names.size(); ++k)
      st.scalars[k] = static_cast<float>(std::get<double>(entry.at(std::string(st.scalar_names[k]))));
    if (!st.master.empty()) {
      const auto& t = std::get<StateTensor>(entry.at("master_param"));
      copy_bytes(st.master.data(), device_, t.data.data(), Device::cpu, t.data.size() * sizeof(float));
    }
  }
  // Eager-state rules (Adagrad) have state for every parameter.
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (group_rules_[group_of_[i]]->eager_state) ensure_state(i, group_of_[i]);
  state_written();
}

void Optimizer::state_written() {
  ++state_loads_;
  // Group-counted steps (LAMB) continue from the largest saved step.
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    group_steps_[g] = 0;
    if (group_rules_[g]->group_step)
      for (std::size_t i : groups_[g].params)
        if (state_[i]->initialized)
          group_steps_[g] = std::max(group_steps_[g], static_cast<std::uint64_t>(state_[i]->scalars[0]));
  }
}

std::size_t Optimizer::state_bytes() const {
  std::size_t bytes = 0;
  for (const auto& st : state_) {
    for (const Buffer& b : st->tensors) bytes += b.size_bytes();
    for (const QuantizedTensor& q : st->quantized) bytes += q.codes.size_bytes() + q.absmax.size_bytes();
    bytes += st->master.size_bytes() + st->work.size_bytes() + st->aux.size_bytes();
  }
  return bytes;
}

std::size_t Optimizer::master_bytes() const {
  std::size_t bytes = 0;
  for (const auto& st : state_) bytes += st->master.size_bytes();
  return bytes;
}

}  // namespace distopt
