// The Optimizer (include/distopt/optim/optimizer.hpp): parameter groups, options, state creation and
// the step. Reading and writing the state (state_tensor, state_dict, load_state_dict) is in
// optimizer_state.cpp; the per-parameter state, ParamState, in optimizer_impl.hpp.
#include "distopt/optim/optimizer.hpp"

#include <cmath>

#include <algorithm>
#include <cstring>
#include <set>

#include "../core/cuda_backend.hpp"
#include "cuda_step.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "optimizer_impl.hpp"

namespace distopt {

namespace {

// Options the rule reads from the optimizer only (LAMB's max_grad_norm, as
// apex): a group may not set them.
void refuse_optimizer_level(const RuleInfo& rule, std::string_view option) {
  for (std::string_view key : rule.optimizer_level)
    if (option == key)
      throw InvalidInput(str(key, " is an option of the whole ", rule.name,
                             " optimizer, not of a parameter group (as in the reference); set it once for all"));
}

}  // namespace

bool rule_runs_on(std::string_view rule, Device device) {
  return device == Device::cpu ? find_rule(rule) != nullptr : cuda::has_kernel(rule);
}

std::string why_rule_cannot_run(std::string_view rule, Device device) {
  if (rule_runs_on(rule, device)) return "";
  if (device == Device::cpu) return str("unknown update rule '", rule, "'");
  return str(rule, " has no CUDA kernel yet (the device runs ", cuda::kernel_rules(), ")");
}

Optimizer::Optimizer(std::string_view rule, std::vector<ParamGroupSpec> groups, OptionMap defaults,
                     OptimizerConfig config)
    : rule_(&rule_or_throw(rule)), config_(config) {
  defaults_ = resolve_options(*rule_, defaults);
  rule_->validate(defaults_);
  if (groups.empty()) throw InvalidInput("optimizer got an empty parameter list");
  for (auto& g : groups) add_param_group(std::move(g));
}

Optimizer::Optimizer(std::string_view rule, std::vector<Param> params, OptionMap defaults,
                     OptimizerConfig config)
    : Optimizer(rule, [&] {
        if (params.empty()) throw InvalidInput("optimizer got an empty parameter list");
        std::vector<ParamGroupSpec> g(1);
        g[0].params = std::move(params);
        return g;
      }(), std::move(defaults), config) {}

Optimizer::~Optimizer() {
  // Device state goes back to the pool, whose next user must not overwrite
  // it under a step still queued on a caller's stream.
  try {
    wait_for_caller();
  } catch (const std::exception&) {  // a failed device: nothing left to order
  }
}

void Optimizer::wait_for_caller() const {
  if (device_ == Device::cuda && cuda_stream_) synchronize_cuda_device(cuda_device_);
}

void Optimizer::skip_next_step_if(const float* device_flag) {
  if (device_flag != nullptr && device_ != Device::cuda)
    throw InvalidInput("skip_next_step_if: a skip flag in device memory needs parameters on the device");
  skip_flag_ = device_flag;
}

void Optimizer::settle_skipped_step() {
  if (!skip_ || !skip_->pending) return;
  SkipState& p = *skip_;
  p.pending = false;
  if (cuda::flag_value(p.flag) == 0.0f) return;
  std::copy(p.group_steps.begin(), p.group_steps.end(), group_steps_.begin());
  for (const auto& [i, scalars] : p.scalars) std::copy(scalars.begin(), scalars.end(), state_[i]->scalars);
  for (std::size_t i : p.created) forget_state(i);  // as if never stepped: the next step starts it afresh
}
Optimizer::Optimizer(Optimizer&&) noexcept = default;
Optimizer& Optimizer::operator=(Optimizer&&) noexcept = default;

void Optimizer::add_param_group(ParamGroupSpec spec) {
  settle_skipped_step();  // its undo knows the groups there were
  // Validate everything before changing anything.
  // A group of another rule (muon's 1-D parameters under adamw) starts
  // from that rule's defaults, not from the optimizer's.
  const RuleInfo& rule = spec.rule.empty() ? *rule_ : rule_or_throw(spec.rule);
  for (const auto& [key, value] : spec.options) refuse_optimizer_level(rule, key);
  OptionMap options = &rule == rule_ ? defaults_ : resolve_options(rule, {});
  for (const auto& [name, value] : resolve_options(rule, spec.options))
    if (spec.options.count(name)) options[name] = value;
  rule.validate(options);
  std::set<const void*> seen;
  for (const Param& p : params_)
    if (p.value.numel() > 0) seen.insert(p.value.data);  // an empty piece shares its address with the next
  if (rule.check_param != nullptr)
    for (const Param& p : spec.params) rule.check_param(options, p.tensor_shape ? *p.tensor_shape : p.value.shape);
  for (std::size_t k = 0; k < spec.params.size(); ++k) {
    const Param& p = spec.params[k];
    const std::size_t i = params_.size() + k;
    if (p.value.numel() > 0 && !seen.insert(p.value.data).second)
      throw InvalidInput(str(param_label(p, i), " appears in more than one parameter group"));
    if (p.value.numel() > 0 && p.value.data == nullptr)
      throw InvalidInput(str(param_label(p, i), " has no data"));
  }
  // Every parameter and gradient of an optimizer lives on one device; on a
  // CUDA device the rule must have a kernel there.
  const Device device = params_.empty() && !spec.params.empty() ? spec.params.front().value.device : device_;
  for (std::size_t k = 0; k < spec.params.size(); ++k) {
    const Param& p = spec.params[k];
    if (p.value.device != device)
      throw InvalidInput(str(param_label(p, params_.size() + k), " is on ", name_of(p.value.device),
                             ", the optimizer's parameters are on ", name_of(device), " (one device per optimizer)"));
  }
  if (device == Device::cuda) {
    require_device(device, "optimizer on cuda");
    if (std::string why = why_rule_cannot_run(rule.name, device); !why.empty()) throw InvalidInput(why);
    if (params_.empty()) cuda_device_ = cuda_current_device();
  }
  device_ = device;
  ParamGroup group;
  group.options = std::move(options);
  for (Param& p : spec.params) {
    group.params.push_back(params_.size());
    group_of_.push_back(groups_.size());
    params_.push_back(std::move(p));
    state_.push_back(std::make_unique<ParamState>());
  }
  group.rule = std::string(rule.name);
  layouts_.push_back({rule.layout(group.options), next_version_++});
  groups_.push_back(std::move(group));
  group_steps_.push_back(0);
  group_rules_.push_back(&rule);
  parsed_.resize(groups_.size());
  coeffs_.resize(params_.size());
  if (rule.eager_state)
    for (std::size_t i : groups_.back().params) ensure_state(i, groups_.size() - 1);
}

const ParamGroup& Optimizer::group(std::size_t g) const {
  DISTOPT_CHECK(g < groups_.size(), "group ", g, " of ", groups_.size());
  return groups_[g];
}

void Optimizer::set_option(std::size_t g, std::string_view option, OptionValue value) {
  DISTOPT_CHECK(g < groups_.size(), "group ", g, " of ", groups_.size());
  const RuleInfo& rule = *group_rules_[g];
  refuse_optimizer_level(rule, option);
  if (option == kStateDTypeOption) {
    (void)resolve_options(rule, OptionMap{{std::string(option), value}});  // a known word, for this rule
    if (quant::parse_state_dtype(value.word()) != state_dtype_of(groups_[g].options))
      throw InvalidInput(str(kStateDTypeOption, " of group ", g, " is ",
                             quant::name_of(state_dtype_of(groups_[g].options)),
                             ": a group's state storage is chosen when the group is added"));
  }
  OptionMap options = groups_[g].options;
  (void)resolve_options(rule, OptionMap{{std::string(option), value}});  // name and kind
  options[std::string(option)] = value;
  rule.validate(options);
  groups_[g].options = std::move(options);
  StateLayout layout = rule.layout(groups_[g].options);
  if (layout.tensors != layouts_[g].layout.tensors || layout.scalars != layouts_[g].layout.scalars)
    layouts_[g] = {std::move(layout), next_version_++};
}

void Optimizer::set_lr(std::size_t g, double lr) {
  DISTOPT_CHECK(g < groups_.size(), "group ", g, " of ", groups_.size());
  if (!std::isfinite(lr)) throw InvalidInput(str("learning rate of group ", g, " must be finite, got ", lr));
  groups_[g].options["lr"] = lr;
}

void Optimizer::set_extra(std::size_t g, std::string_view key, double value) {
  DISTOPT_CHECK(g < groups_.size(), "group ", g, " of ", groups_.size());
  groups_[g].extras[std::string(key)] = value;
}

std::optional<double> Optimizer::extra(std::size_t g, std::string_view key) const {
  const auto& e = group(g).extras;
  auto it = e.find(key);
  if (it == e.end()) return std::nullopt;
  return it->second;
}

Param& Optimizer::param(std::size_t i) {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  return params_[i];
}
const Param& Optimizer::param(std::size_t i) const {
  DISTOPT_CHECK(i < params_.size(), "parameter ", i, " of ", params_.size());
  return params_[i];
}

std::size_t Optimizer::group_of(std::size_t i) const { return group_of_[i]; }

bool Optimizer::state_is_current(std::size_t i) const {
  const ParamState& st = *state_[i];
  return st.initialized && st.layout_version == layouts_[group_of_[i]].version;
}

void Optimizer::forget_state(std::size_t i) {
  state_[i]->initialized = false;
  state_[i]->scalar_names = {};
}

bool Optimizer::ensure_state(std::size_t i, std::size_t g) {
  ParamState& st = *state_[i];
  const GroupLayout& gl = layouts_[g];
  if (state_is_current(i)) return false;
  const bool first = !st.initialized;  // new, or reset (its buffers kept and re-filled below)
  const Param& p = params_[i];
  const auto n = static_cast<std::size_t>(p.value.numel());
  float fill[kMaxStateTensors] = {};
  float scalars[kMaxStateScalars] = {};
  const RuleInfo& rule = *group_rules_[g];
  rule.init(groups_[g].options, fill, scalars);
  bool created = false;
  const quant::StateDType sd = state_dtype_of(groups_[g].options);
  // Keep tensors that exist under the new layout, create the missing ones.
  std::vector<Buffer> tensors;
  std::vector<QuantizedTensor> quantized;
  for (std::size_t k = 0; k < gl.layout.tensors.size(); ++k) {
    auto it = std::find(st.tensor_names.begin(), st.tensor_names.end(), gl.layout.tensors[k]);
    if (it != st.tensor_names.end()) {
      const auto at = static_cast<std::size_t>(it - st.tensor_names.begin());
      tensors.push_back(std::move(st.tensors[at]));
      quantized.push_back(at < st.quantized.size() ? std::move(st.quantized[at]) : QuantizedTensor{});
      if (!st.initialized && !tensors.back().empty())  // kept through reset_state: starts afresh
        fill_floats(tensors.back().as<float>(), n, fill[k], device_);
      if (QuantizedTensor& q = quantized.back(); !st.initialized && q.on()) fill_zero(q, n, device_);
      continue;
    }
    const bool needed = rule.tensor_needed == nullptr || rule.tensor_needed(groups_[g].options, k, tensor_shape_of(i));
    const std::string what = str("state '", gl.layout.tensors[k], "' of ", param_label(p, i));
    quantized.emplace_back();
    created = true;
    if (needed && quantizes(rule, sd, k, tensor_shape_of(i))) {
      // Blocks count from the whole tensor's first element (quant.hpp).
      const std::size_t block = quant::block_of(sd);
      if (p.tensor_offset % block != 0)
        throw InvalidInput(str(param_label(p, i), " is a piece starting at element ", p.tensor_offset,
                               " of its tensor: ", kStateDTypeOption, " ", quant::name_of(sd),
                               " needs pieces that start on a block of ", block, " elements"));
      DISTOPT_CHECK(fill[k] == 0.0f, "quantized ", what);
      QuantizedTensor& q = quantized.back();
      q.dtype = sd;
      q.is_signed = rule.quantized[k] == QuantSign::is_signed;
      q.codes = Buffer(quant::code_bytes(sd, n), kFirstStateSlot + static_cast<int>(k), device_, what);
      q.absmax = Buffer(quant::num_blocks(sd, n) * sizeof(float), 0, device_, what);
      fill_zero(q, n, device_);
      tensors.emplace_back();
      continue;
    }
    Buffer b(needed ? n * sizeof(float) : 0, kFirstStateSlot + static_cast<int>(k), device_, what);
    if (needed && fill[k] != 0.0f) fill_floats(b.as<float>(), n, fill[k], device_);
    tensors.push_back(std::move(b));
  }
  if (rule.aux_size != nullptr) {
    const std::size_t a = rule.aux_size(groups_[g].options, tensor_shape_of(i));
    if (st.aux.size_bytes() != a * sizeof(float)) {
      st.aux = Buffer(a * sizeof(float), kFirstStateSlot + kMaxStateTensors + 1);
      std::fill_n(st.aux.as<float>(), a, 0.0f);
      created = true;
    } else if (!st.initialized) {
      std::fill_n(st.aux.as<float>(), a, 0.0f);
    }
  }
  float kept[kMaxStateScalars];
  for (std::size_t k = 0; k < gl.layout.scalars.size(); ++k) {
    auto it = std::find(st.scalar_names.begin(), st.scalar_names.end(), gl.layout.scalars[k]);
    kept[k] = it != st.scalar_names.end() ? st.scalars[it - st.scalar_names.begin()] : scalars[k];
  }
  std::copy_n(kept, gl.layout.scalars.size(), st.scalars);
  st.tensors = std::move(tensors);
  st.quantized = std::move(quantized);
  st.tensor_names = gl.layout.tensors;
  st.scalar_names = gl.layout.scalars;
  if (!st.initialized && p.value.dtype != DType::f32) {
    if (st.master.size_bytes() != n * sizeof(float))
      st.master = Buffer(n * sizeof(float), kMasterSlot, device_, str("master weights of ", param_label(p, i)));
    widen_to_floats(st.master.as<float>(), p.value.data, p.value.dtype, n, device_);
  }
  st.initialized = true;
  st.layout_version = gl.version;
  return first || created || gl.layout.tensors.empty();
}

void Optimizer::check_grad(std::size_t i) const {
  const Param& p = params_[i];
  if (p.grad.data == nullptr && p.value.numel() > 0)
    throw InvalidInput(str(param_label(p, i), " is marked as having a gradient but has no gradient storage"));
  if (p.grad.numel() != p.value.numel())
    throw InvalidInput(str("gradient of ", param_label(p, i), " has ", p.grad.numel(), " elements (shape ",
                           to_string(p.grad.shape), "), the parameter has ", p.value.numel(), " (shape ",
                           to_string(p.value.shape), ")"));
  if (p.grad.device != p.value.device && p.value.numel() > 0)
    throw InvalidInput(str("gradient of ", param_label(p, i), " is on ", name_of(p.grad.device),
                           ", the parameter is on ", name_of(p.value.device)));
  if (p.grad.dtype != p.value.dtype)
    throw InvalidInput(str("gradient of ", param_label(p, i), " is ", name_of(p.grad.dtype),
                           ", the parameter is ", name_of(p.value.dtype)));
}

Slice Optimizer::slice_of(std::size_t i, std::size_t begin, std::size_t end) const {
  const Param& p = params_[i];
  const ParamState& st = *state_[i];
  const std::size_t es = size_of(p.value.dtype);
  Slice s;
  s.dtype = p.value.dtype;
  s.param = static_cast<char*>(p.value.data) + begin * es;
  s.grad = static_cast<const char*>(p.grad.data) + begin * es;
  s.master = st.master.empty() ? nullptr : const_cast<float*>(st.master.as<float>()) + begin;
  for (std::size_t k = 0; k < st.tensors.size(); ++k)  // quantized: apply_quantized sets them
    s.state[k] = st.tensors[k].empty() ? nullptr : const_cast<float*>(st.tensors[k].as<float>()) + begin;
  s.work = st.work.empty() ? nullptr : const_cast<float*>(st.work.as<float>()) + begin;
  s.aux = st.aux.empty() ? nullptr : const_cast<float*>(st.aux.as<float>());
  s.shape = &tensor_shape_of(i);
  s.offset = p.tensor_offset + begin;
  s.n = end - begin;
  return s;
}

const Shape& Optimizer::tensor_shape_of(std::size_t i) const {
  const Param& p = params_[i];
  return p.tensor_shape ? *p.tensor_shape : p.value.shape;
}

void Optimizer::run_stat_passes(bool threaded) {
  // Each rule with stat passes runs them over the parameters of its own
  // groups (a muon group beside an adamw group: only the muon one).
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const RuleInfo* rule = group_rules_[g];
    if (rule->stat_passes == 0) continue;
    bool seen = false;
    for (std::size_t h = 0; h < g; ++h) seen = seen || group_rules_[h] == rule;
    if (seen) continue;
    pass_active_.clear();
    pass_work_.clear();
    for (std::size_t i : active_)
      if (group_rules_[group_of_[i]] == rule) pass_active_.push_back(i);
    for (const WorkItem& w : work_)
      if (group_rules_[group_of_[w.param]] == rule) pass_work_.push_back(w);
    if (device_ == Device::cuda) stat_passes_on_device(*rule);
    else run_stat_passes(*rule, threaded);
  }
}

void Optimizer::size_stats(const RuleInfo& rule, int pass) {
  stat_offsets_.resize(pass_active_.size() + 1);
  stat_offsets_[0] = 0;
  for (std::size_t j = 0; j < pass_active_.size(); ++j)
    stat_offsets_[j + 1] = stat_offsets_[j] + rule.num_stats(pass, tensor_shape_of(pass_active_[j]));
  stats_.assign(stat_offsets_.back(), 0.0);
}

void Optimizer::finish_stat_pass(const RuleInfo& rule, int pass) {
  if (rule.global_pass(pass)) {
    // One total over every tensor, summed in parameter order.
    const std::size_t c = pass_active_.empty() ? 0 : stat_offsets_[1];
    DISTOPT_CHECK(c <= static_cast<std::size_t>(kMaxStats), c, " global statistics");
    double total[kMaxStats] = {};
    for (std::size_t j = 0; j < pass_active_.size(); ++j)
      for (std::size_t s = 0; s < c; ++s) total[s] += stats_[j * c + s];
    if (stats_reduce_) stats_reduce_(std::span<double>(total, c));
    for (std::size_t j = 0; j < pass_active_.size(); ++j) std::copy(total, total + c, stats_.begin() + j * c);
  } else if (stats_reduce_) {
    stats_reduce_(stats_);
  }
  for (std::size_t j = 0; j < pass_active_.size(); ++j) {
    const std::size_t i = pass_active_[j];
    ParamState& st = *state_[i];
    rule.finish_pass(pass, tensor_shape_of(i), stats_.data() + stat_offsets_[j], coeffs_[i],
                     st.aux.empty() ? nullptr : st.aux.as<float>());
  }
}

void Optimizer::run_stat_passes(const RuleInfo& rule, bool threaded) {
  auto for_each = [&](std::size_t n, auto fn) {
    if (threaded) config_.pool->parallel_for(n, fn);
    else
      for (std::size_t k = 0; k < n; ++k) fn(k);
  };
  if (rule.workspace)
    for (std::size_t i : pass_active_) {
      ParamState& st = *state_[i];
      const std::size_t bytes = static_cast<std::size_t>(params_[i].value.numel()) * sizeof(float);
      if (st.work.size_bytes() != bytes)
        st.work =
            Buffer(bytes, kFirstStateSlot + kMaxStateTensors, device_, str("scratch of ", param_label(params_[i], i)));
    }
  for (int pass = 0; pass < rule.stat_passes; ++pass) {
    if (rule.transform != nullptr)
      for_each(pass_work_.size(), [&](std::size_t k) {
        const WorkItem& w = pass_work_[k];
        rule.transform(coeffs_[w.param], pass, slice_of(w.param, w.begin, w.end));
      });
    // Each tensor's partial statistics over its stat range, in one piece
    // (so the order of the sums does not depend on the threads).
    size_stats(rule, pass);
    for_each(pass_active_.size(), [&](std::size_t j) {
      const std::size_t i = pass_active_[j];
      const auto [begin, end] = stat_range(params_[i]);
      rule.partial(coeffs_[i], pass, slice_of(i, begin, end), stats_.data() + stat_offsets_[j]);
    });
    finish_stat_pass(rule, pass);
    if (rule.whole != nullptr) {
      auto aux_of = [&](std::size_t i) { return state_[i]->aux.empty() ? nullptr : state_[i]->aux.as<float>(); };
      auto is_whole = [&](std::size_t i) {
        return params_[i].tensor_offset == 0 && params_[i].value.numel() == numel(tensor_shape_of(i));
      };
      // Whole tensors: in parallel. Pieces: gathered one tensor at a time,
      // in parameter order (a collective), the step computed on the whole
      // tensor (the same bits on every rank) and the own piece kept.
      for_each(pass_active_.size(), [&](std::size_t j) {
        const std::size_t i = pass_active_[j];
        if (is_whole(i))
          rule.whole(coeffs_[i], pass, tensor_shape_of(i), state_[i]->work.as<float>(), aux_of(i));
      });
      for (std::size_t i : pass_active_) {
        if (is_whole(i)) continue;
        DISTOPT_CHECK(tensor_gather_ != nullptr, rule.name, " needs whole tensors: parameter ", i,
                      " is a piece and no gather is set");
        const auto n = static_cast<std::size_t>(params_[i].value.numel());
        float* piece = n > 0 ? state_[i]->work.as<float>() : nullptr;
        whole_.resize(static_cast<std::size_t>(numel(tensor_shape_of(i))));
        const bool gathered = tensor_gather_(params_[i], std::span<const float>(piece, n), whole_);
        if (n == 0) continue;  // nothing of it here: the gather was for the others
        DISTOPT_CHECK(gathered, "parameter ", i, " is a piece of ", n, " elements but was not gathered");
        rule.whole(coeffs_[i], pass, tensor_shape_of(i), whole_.data(), aux_of(i));
        std::copy_n(whole_.data() + params_[i].tensor_offset, n, piece);
      }
    }
  }
}

void Optimizer::step() {
  // Check every gradient first so that a bad one leaves all parameters as they were.
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].has_grad) check_grad(i);
  // A device step a rule's options or the machine cannot run is refused before anything changes.
  if (device_ == Device::cuda)
    for (std::size_t g = 0; g < groups_.size(); ++g)
      if (group_rules_[g]->whole != nullptr) cuda::check_whole_step(group_rules_[g]->name, groups_[g].options);
  const float* const flag = std::exchange(skip_flag_, nullptr);  // this step's only, whatever happens
  settle_skipped_step();
  work_.clear();
  active_.clear();
  SkipState* skip = nullptr;
  if (flag != nullptr) {
    if (!skip_) skip_ = std::make_unique<SkipState>();
    if (skip_->flag == nullptr) skip_->flag = cuda::new_flag_copy();
    skip = skip_.get();
    skip->group_steps = group_steps_;
    skip->scalars.clear();
    skip->created.clear();
  }
  const bool threaded = config_.pool != nullptr && config_.pool->size() > 1;
  const std::size_t chunk = threaded ? std::max<std::size_t>(config_.chunk_elements, 64) : SIZE_MAX;
  if (device_ == Device::cuda && cuda_stream_)  // state made now reads parameters the caller's stream writes
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].has_grad && !state_is_current(i)) {
        synchronize_stream(*cuda_stream_);
        break;
      }
  if (frozen_at_)
    for (const RuleInfo* rule : group_rules_)
      if (rule->moment == nullptr)
        throw PreconditionError(
            str("a frozen-variance (1-bit) step with rule ", rule->name, ", which has no 1-bit form"));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const RuleInfo& rule = *group_rules_[g];
    rule.parse(groups_[g].options, parsed_[g]);
    ++group_steps_[g];
    for (std::size_t i : groups_[g].params) {
      if (!params_[i].has_grad) continue;  // torch skips p.grad is None entirely
      const bool created = !state_[i]->initialized;
      const bool fresh = ensure_state(i, g);
      if (skip) {
        if (created) skip->created.push_back(i);
        std::array<float, kMaxStateScalars> before;
        std::copy_n(state_[i]->scalars, kMaxStateScalars, before.begin());
        skip->scalars.emplace_back(i, before);
      }
      // The rule advances "step" once: from the group's count before this step.
      if (rule.group_step) state_[i]->scalars[0] = static_cast<float>(group_steps_[g] - 1);
      if (frozen_at_) {
        rule.moment->prepare_frozen(parsed_[g], state_[i]->scalars, *frozen_at_, coeffs_[i]);
      } else {
        rule.prepare(parsed_[g], state_[i]->scalars, fresh, coeffs_[i]);
      }
      active_.push_back(i);
      if (device_ != Device::cpu) continue;  // the device steps whole tensors (step_on_device)
      const auto n = static_cast<std::size_t>(params_[i].value.numel());
      // Quantized state is updated a block at a time: chunks hold whole blocks.
      const std::size_t c = state_[i]->any_quantized() && chunk != SIZE_MAX
                                ? (chunk + quant::kMaxBlock - 1) / quant::kMaxBlock * quant::kMaxBlock
                                : chunk;
      for (std::size_t b = 0; b < n; b += std::min(c, n - b)) work_.push_back({i, b, b + std::min(c, n - b)});
    }
  }
  if (device_ == Device::cuda) {
    step_on_device(flag);
    if (skip) {
      cuda::copy_flag(skip->flag, flag, cuda_stream_);
      skip->pending = true;
    }
    return;
  }
  run_stat_passes(threaded);
  auto run = [&](std::size_t k) {
    const WorkItem& w = work_[k];
    if (state_[w.param]->any_quantized()) apply_quantized(w.param, w.begin, w.end);
    else group_rules_[group_of_[w.param]]->apply(coeffs_[w.param], slice_of(w.param, w.begin, w.end));
  };
  if (threaded) config_.pool->parallel_for(work_.size(), run);
  else
    for (std::size_t k = 0; k < work_.size(); ++k) run(k);
}

void Optimizer::apply_quantized(std::size_t i, std::size_t begin, std::size_t end) {
  ParamState& st = *state_[i];
  const RuleInfo& rule = *group_rules_[group_of_[i]];
  // Every quantized tensor of a group has the group's dtype: its blocks, or
  // (bf16, which has none) chunks of kStage elements from anywhere (as long
  // as the staged values of every state tensor stay in the L1 cache).
  constexpr std::size_t kStage = 1024;
  static_assert(kStage >= quant::kMaxBlock);
  std::size_t block = kStage;
  bool scaled = false;
  for (const QuantizedTensor& q : st.quantized)
    if (q.on() && quant::has_scales(q.dtype)) block = quant::block_of(q.dtype), scaled = true;
  DISTOPT_CHECK(!scaled || begin % block == 0, "a quantized slice starts at ", begin);
  alignas(64) float values[kMaxStateTensors][kStage];
  for (std::size_t b = begin; b < end; b += block) {
    const std::size_t e = std::min(end, b + block);
    Slice s = slice_of(i, b, e);
    for (std::size_t k = 0; k < st.quantized.size(); ++k) {
      const QuantizedTensor& q = st.quantized[k];
      if (!q.on()) continue;
      quant::dequantize_block(q.dtype, q.is_signed, q.codes.as<std::uint8_t>() + quant::code_bytes(q.dtype, b),
                              scaled ? q.absmax.as<float>()[b / block] : 0.0f, e - b, values[k]);
      s.state[k] = values[k];
    }
    rule.apply(coeffs_[i], s);  // from the step's fp32 values; then they are quantized
    for (std::size_t k = 0; k < st.quantized.size(); ++k) {
      QuantizedTensor& q = st.quantized[k];
      if (q.on())
        quant::quantize_block(q.dtype, q.is_signed, values[k], e - b,
                              q.codes.as<std::uint8_t>() + quant::code_bytes(q.dtype, b),
                              scaled ? q.absmax.as<float>() + b / block : nullptr);
    }
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  for (Param& p : params_) {
    if (set_to_none) p.has_grad = false;
    else if (p.grad.data != nullptr) zero_bytes(p.grad.data, p.grad.size_bytes(), p.grad.device);
  }
}

}  // namespace distopt
