// The Optimizer's device step: implemented in src/cuda/rules.cu when the
// build has CUDA, and by src/optim/cuda_step_none.cpp (no rule has a
// kernel; a step is refused in one line) when it has not. An internal
// interface of optim for src/cuda/ (docs/architecture.md, "Layers").
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "distopt/optim/quant.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt::cuda {

// Whether `rule` (a RuleInfo::name) has a CUDA kernel.
bool has_kernel(std::string_view rule);
// The rules that do, comma-separated, for error messages.
std::string_view kernel_rules();
// One step of a pointwise rule over whole slices on the device: slice k is
// updated with coefficients coeffs[k] (RuleInfo::prepare's output), all of
// them in as few launches as the rule's compile-time flags allow. `flush`
// picks the kernels built with -ftz=true (the caller's CPU flushes
// denormals: DenormalMode::flush), so the bits match the CPU's in either
// mode.
// `stream`: none, the calling thread's own stream, and the step is complete
// when this returns (as on the CPU); or a caller's stream (a cudaStream_t as
// an integer, 0 the legacy default stream: torch's current stream), on
// which the step is enqueued without waiting for it. `skip`: null, or a
// float in device memory which, when not 0 as the kernels run, makes them
// change nothing (GradScaler's found_inf).
void pointwise_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    bool flush, std::optional<std::uintptr_t> stream, const float* skip = nullptr);

// A pointwise rule's step over slices whose state is kept quantized
// (include/distopt/optim/quant.hpp: bf16, int8 or int4, one storage for all
// of them): state tensor k of slice j is codes[j].codes[k] and its block
// scales codes[j].absmax[k] (null for bf16) where codes[j].codes[k] is not
// null, else Slice::state[k] as in pointwise_step. A block of threads per
// block of the storage: the codes read to fp32, the rule's element() (the
// CPU's source), each block's scale reduced exactly (max |x| on the bits)
// and the codes picked by quant_code.hpp's search, so the codes and scales
// are the CPU's. Slices start on blocks of their tensors (the Optimizer's
// rule); stream and skip as in pointwise_step.
struct QuantizedSlice {
  std::uint8_t* codes[kMaxStateTensors] = {};
  float* absmax[kMaxStateTensors] = {};
  bool is_signed[kMaxStateTensors] = {};
};
void quantized_step(std::string_view rule, quant::StateDType storage, std::span<const RuleBlob* const> coeffs,
                    std::span<const Slice> slices, std::span<const QuantizedSlice> codes, bool flush,
                    std::optional<std::uintptr_t> stream, const float* skip = nullptr);

// The tensor_stats rules with kernels (rules/stats.hpp: LAMB, LARS,
// Adafactor) step in passes, as on the CPU (Optimizer::run_stat_passes):
// stats_pass runs pass `pass` over whole slices -- the rule's transform,
// then its statistics of slice k over ranges[k] (empty: the whole slice),
// added to out[k] (host; null: none) as the rule's partial lays them out --
// and waits for them; the caller finishes the pass on the host
// (finish_pass). Slice::work is device memory; aux[k] is slice k's small
// state in host memory (empty: none), copied to the device with the pass's
// metadata. stats_update applies the step, enqueued on `stream` as in
// pointwise_step (no skip flag: the caller reads it first, as it waits for
// the statistics anyway).
struct StatRange {
  std::size_t begin = 0, end = 0;
};
bool has_stats_kernel(std::string_view rule);
void stats_pass(std::string_view rule, int pass, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                std::span<const StatRange> ranges, std::span<const std::span<const float>> aux,
                std::span<double* const> out, bool flush, std::optional<std::uintptr_t> stream);
void stats_update(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                  bool flush, std::optional<std::uintptr_t> stream);

// The whole_tensor rules with a device path (muon: src/cuda/muon.cu): one
// step over whole slices, the rule's transform into Slice::work (device
// memory), the step on the whole tensor, and the update, on `stream` as in
// pointwise_step after one wait for the tensors' norms. Refused in one line
// (nothing changed) where the options or the device cannot run it.
bool has_whole_kernel(std::string_view rule);
// Throws that refusal for `rule` under its complete `options`: the
// Optimizer calls it before a step changes anything.
void check_whole_step(std::string_view rule, const OptionMap& options);
void whole_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                std::optional<std::uintptr_t> stream);

// Clipping's device half (optim/clip.cpp; src/cuda/clip.cu), on the calling
// thread's stream, complete when they return: the norm's partial statistic
// of device gradients (as clip.hpp's grad_norm_partial), and the in-place
// scale by coef and clamp into [-limit, limit] (NaN stays NaN).
double grad_norm_partial(std::span<const TensorView> grads, double norm_type);
void scale_grads(std::span<const TensorView> grads, float coef);
void clamp_grads(std::span<const TensorView> grads, float limit);

// A skip flag's value, copied to pinned host memory after the step on the
// same stream without waiting: flag_value waits for that copy (usually long
// done). One FlagCopy is made once and reused (making pinned memory would
// synchronise the device); a copy must be read before the next is enqueued.
struct FlagCopy;
FlagCopy* new_flag_copy();
void copy_flag(FlagCopy* copy, const float* flag, std::optional<std::uintptr_t> stream);
float flag_value(FlagCopy* copy);
void free_flag(FlagCopy* copy) noexcept;

}  // namespace distopt::cuda
