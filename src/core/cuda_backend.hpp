// The CUDA side of core/device.hpp and of the Optimizer's device step:
// implemented in src/cuda/ when the build has CUDA, and by
// src/core/cuda_none.cpp (every call refused in one line) when it has not.
// Internal to the library.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "distopt/core/dtype.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt::cuda {

bool built();
// Visible devices; *why says why there are none.
int device_count(std::string* why);
void* alloc(std::size_t bytes, std::string_view what);
void free(void* p) noexcept;
void release_cached();
std::size_t pool_bytes();
enum class CopyKind { host_to_device, device_to_host, device_to_device };
void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind);
void fill(float* dst, std::size_t n, float value);
void widen(float* dst, const void* src, DType t, std::size_t n);
void zero(void* p, std::size_t bytes);
void synchronize();

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
void pointwise_step(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    bool flush);

}  // namespace distopt::cuda
