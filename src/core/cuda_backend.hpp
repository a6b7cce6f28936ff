// The CUDA side of core/device.hpp: implemented in src/cuda/runtime.cu when
// the build has CUDA, and by src/core/cuda_none.cpp (every call refused in
// one line) when it has not. An internal interface of core for optim and
// src/cuda/ (docs/architecture.md, "Layers"); the Optimizer's device step is
// optim's (src/optim/cuda_step.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distopt/core/dtype.hpp"

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
// Waits for a caller's stream (a cudaStream_t as an integer; 0 is the legacy default stream).
void synchronize_stream(std::uintptr_t stream);
// The calling thread's current device; waiting for all work on a device.
int current_device();
void synchronize_device(int device);

}  // namespace distopt::cuda
