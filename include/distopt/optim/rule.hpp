// Update rules: the math of one optimizer, separate from bookkeeping.
//
// A rule is an options struct, a per-parameter state (fp32 tensors shaped
// like the parameter plus a few fp32 scalars such as `step`) and a kernel
// that updates a contiguous slice of one parameter given per-step scalars
// computed once on the host. Kernels allocate nothing and communicate
// nothing. Every rule declares its locality (docs/optimizers.md,
// "Locality"): a pointwise rule's update of element i reads only element i
// of the parameter, gradient and state, so any slicing of a tensor --
// across threads or across ranks -- gives bitwise the same result as one
// call over the whole tensor.
//
// A tensor_stats rule (LAMB, LARS) also needs statistics of whole tensors
// (norms). It declares stat passes: pass k may first transform each slice
// (pointwise, e.g. LAMB's moments and update direction), then accumulates
// per-tensor partial statistics over the elements the rank accounts for;
// the Optimizer reduces them over the ranks holding pieces of the tensor
// (Optimizer::set_stats_reduce) and hands the totals to the rule's
// finish_pass, which folds them into the step's coefficients. apply then
// runs pointwise, as for any rule. Kernels still allocate and communicate
// nothing.
//
// RuleInfo is the type-erased table through which Optimizer and the
// sharding engine drive a rule. Rules are looked up by their torch name.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "distopt/core/dtype.hpp"
#include "distopt/core/tensor.hpp"
#include "distopt/optim/options.hpp"
#include "distopt/optim/quant.hpp"

namespace distopt {

enum class Locality { pointwise, tensor_stats, whole_tensor };
std::string_view name_of(Locality l);

inline constexpr int kMaxStateTensors = 4;

// How a state tensor may be quantized (RuleInfo::quantized): not at all,
// with the signed code book (a moment of either sign), or the unsigned one
// (a non-negative second moment).
enum class QuantSign : std::uint8_t { none, is_signed, non_negative };
inline constexpr int kMaxStateScalars = 4;

struct OptionSpec {
  std::string_view name;
  OptionValue default_value;
  std::string_view help;
};

// Storage big enough for any rule's parsed options or per-step coefficients.
struct alignas(16) RuleBlob {
  unsigned char bytes[256];
  template <class T>
  T& as() {
    static_assert(sizeof(T) <= sizeof(bytes) && alignof(T) <= 16);
    return *reinterpret_cast<T*>(bytes);
  }
  template <class T>
  const T& as() const {
    static_assert(sizeof(T) <= sizeof(bytes) && alignof(T) <= 16);
    return *reinterpret_cast<const T*>(bytes);
  }
};

// Which state a parameter needs under given options.
struct StateLayout {
  std::vector<std::string_view> tensors;  // fp32, one element per parameter element
  std::vector<std::string_view> scalars;  // fp32 scalars, e.g. "step"
};

// One contiguous piece of one parameter, as a kernel sees it.
struct Slice {
  DType dtype = DType::f32;       // of the parameter and its gradient
  void* param = nullptr;          // the parameter's elements
  const void* grad = nullptr;     // the gradient's elements
  float* master = nullptr;        // fp32 master weights (bf16/f16 params), else null
  float* state[kMaxStateTensors] = {};  // in StateLayout::tensors order
  float* work = nullptr;          // fp32 scratch kept between passes of one step (RuleInfo::workspace)
  float* aux = nullptr;           // the tensor's small state, whole (RuleInfo::aux_size)
  const Shape* shape = nullptr;   // the whole tensor's shape (a shard may hold a piece of it)
  std::size_t offset = 0;         // index in the whole tensor of this slice's first element
  std::size_t n = 0;
};

// A named part of a tensor's small state, as state_dict shows it.
struct AuxPart {
  std::string_view name;
  std::size_t offset = 0;  // in the aux buffer
  Shape shape;
};

// The most statistics a rule gathers per tensor in one pass.
inline constexpr int kMaxStats = 4;

// 1-bit Adam's view of a rule (--grad-compression onebit; docs/sharding.md,
// "1-bit Adam"): after a warm-up of ordinary steps, the variance is frozen
// and each rank advances the first moment with its own gradient; the
// strategy averages those moments compressed to signs and hands the average
// to the rule in the gradient's place. The rule communicates nothing.
struct MomentForm {
  std::string_view state;  // the first moment's state tensor ("exp_avg")
  // out[i] = m[i]*b1 + (1-b1)*g'[i] for n elements, g' the gradient after the
  // rule's prologue (maximize; L2 decay with the parameter p), in the
  // rule's own rounding. out may be g.
  void (*local)(const RuleBlob& parsed, const float* m, const float* g, const float* p, float* out, std::size_t n);
  // The state tensor the frozen step divides by (Adam: exp_avg_sq, with
  // amsgrad max_exp_avg_sq), and that division's denominator for n
  // elements of it, out[i] = sqrt(v[i]) / sqrt(bc2(frozen_at)) + eps, in the
  // kernel's rounding: the strategy averages m / denominator, whose sign
  // errors are the size of the step's (docs/sharding.md, "1-bit Adam").
  std::string_view (*variance)(const RuleBlob& parsed);
  void (*denominator)(const RuleBlob& parsed, const float* v, std::uint64_t frozen_at, float* out, std::size_t n);
  // The coefficients of a step whose gradient is the averaged first moment
  // (it replaces the state's) and whose variance stays as it was after
  // step `frozen_at` (its bias correction too); advances the scalars.
  void (*prepare_frozen)(const RuleBlob& parsed, float* scalars, std::uint64_t frozen_at, RuleBlob& coeffs);
};

struct RuleInfo {
  std::string_view name;
  Locality locality;
  std::span<const OptionSpec> options;
  // Throws InvalidInput (torch's message) for a bad combination of options.
  void (*validate)(const OptionMap& options);
  StateLayout (*layout)(const OptionMap& options);
  // True when state exists from construction, before any step (Adagrad).
  bool eager_state;
  // Initial value of each state tensor and scalar (layout order).
  void (*init)(const OptionMap& options, float* tensor_fill, float* scalars);
  // Parses a group's options into a typed struct (once per group and step).
  void (*parse)(const OptionMap& options, RuleBlob& parsed);
  // Advances a parameter's scalar state by one step and computes the
  // per-step coefficients. `fresh` is true on the parameter's first step.
  void (*prepare)(const RuleBlob& parsed, float* scalars, bool fresh, RuleBlob& coeffs);
  // Updates one slice.
  void (*apply)(const RuleBlob& coeffs, const Slice& slice);

  // ---- tensor_stats rules only (stat_passes == 0 otherwise) ----
  int stat_passes = 0;
  // Statistics per tensor gathered in pass k, for a tensor of that shape
  // (at most kMaxStats for a global pass).
  std::size_t (*num_stats)(int pass, const Shape& tensor) = nullptr;
  // Whether pass k's statistics are global: summed over every tensor of
  // every group (LAMB's gradient norm) before finish_pass sees them.
  bool (*global_pass)(int pass) = nullptr;
  // Optional pointwise work on a whole slice before pass k's statistics.
  void (*transform)(const RuleBlob& coeffs, int pass, const Slice& slice) = nullptr;
  // Adds pass k's partial statistics of `slice` to out[0 .. num_stats(k)).
  void (*partial)(const RuleBlob& coeffs, int pass, const Slice& slice, double* out) = nullptr;
  // Folds pass k's reduced statistics of the tensor into its coefficients
  // and its small state.
  void (*finish_pass)(int pass, const Shape& tensor, const double* stats, RuleBlob& coeffs, float* aux) = nullptr;
  // Small per-tensor state, whole on every rank that holds a piece of the
  // tensor (Adafactor's row and column averages): its size in floats (0:
  // none) and its named parts, zero at the start.
  std::size_t (*aux_size)(const OptionMap& options, const Shape& tensor) = nullptr;
  std::vector<AuxPart> (*aux_parts)(const OptionMap& options, const Shape& tensor) = nullptr;
  // Whether state tensor k (StateLayout::tensors order) exists for a tensor
  // of this shape (Adafactor keeps exp_avg_sq only for 1-D ones); null: all.
  bool (*tensor_needed)(const OptionMap& options, std::size_t k, const Shape& tensor) = nullptr;
  // Whether slices carry an fp32 scratch buffer (Slice::work).
  bool workspace = false;
  // whole_tensor rules (Muon, Shampoo, full-matrix Adagrad): after pass k,
  // work on the whole tensor's scratch (a piece is first gathered whole,
  // Optimizer::set_tensor_gather) and its small state, and may set
  // coefficients that depend on the shape.
  void (*whole)(RuleBlob& coeffs, int pass, const Shape& tensor, float* work, float* aux) = nullptr;
  // Refuses a parameter the rule cannot take under these options (Muon: not
  // 2-D; full-matrix Adagrad: above its size limit), by shape.
  void (*check_param)(const OptionMap& options, const Shape& tensor) = nullptr;
  // The rule `distopt train` gives the parameters this one refuses by shape,
  // in a second group (Muon: adamw, as torch's documentation advises);
  // empty: a refused parameter is an error.
  std::string_view companion = {};
  // Whether the scalar state "step" (the first scalar) counts the group's
  // steps, as apex's FusedLAMB does, rather than the parameter's: every
  // step() advances it, with or without a gradient.
  bool group_step = false;
  // Options read from the optimizer's defaults only (apex reads LAMB's
  // max_grad_norm from self.defaults): a group may not set them.
  std::span<const std::string_view> optimizer_level;
  // Which state tensors (StateLayout::tensors order) may be kept quantized
  // under the group option state_dtype (include/distopt/optim/quant.hpp),
  // and with which code book; all none: the rule keeps fp32 state only.
  std::array<QuantSign, kMaxStateTensors> quantized{};
  // Its 1-bit form (Adam, AdamW); null: none.
  const MomentForm* moment = nullptr;
  bool quantizable() const {
    for (QuantSign q : quantized)
      if (q != QuantSign::none) return true;
    return false;
  }
};

// The group option that chooses the state's storage: a word of
// quant::state_dtype_names(), "f32" when absent.
inline constexpr std::string_view kStateDTypeOption = "state_dtype";
// A group's state storage: its state_dtype option (f32 when absent or not
// a known word; resolve_options refuses those).
inline quant::StateDType state_dtype_of(const OptionMap& options) {
  const auto it = options.find(kStateDTypeOption);
  if (it == options.end() || it->second.kind() != OptionValue::Kind::word) return quant::StateDType::f32;
  return quant::parse_state_dtype(it->second.word()).value_or(quant::StateDType::f32);
}

// Every rule, in a stable order; the registry feeds the property tests.
std::span<const RuleInfo* const> all_rules();
// nullptr when unknown.
const RuleInfo* find_rule(std::string_view name);
// Like find_rule, but throws InvalidInput listing the known names.
const RuleInfo& rule_or_throw(std::string_view name);

// The option's default; throws InvalidInput for names the rule lacks.
const OptionSpec& option_spec(const RuleInfo& rule, std::string_view option);
// Defaults overlaid with `given`; unknown names and wrongly typed values
// throw InvalidInput. Does not validate ranges (see RuleInfo::validate).
OptionMap resolve_options(const RuleInfo& rule, const OptionMap& given);

}  // namespace distopt
