// Where memory lives and kernels run: the CPU or a CUDA device.
//
// CUDA is an optional part of the build (DISTOPT_CUDA=AUTO|ON|OFF,
// docs/gpu.md). Without it, or without a device, everything here still
// links: cuda_device_count() is 0 and require_device(Device::cuda) throws
// one line saying which of the two is missing.
//
// Device memory comes from a caching pool (cudaMalloc'd blocks kept for
// reuse; no managed memory). Kernels and copies run on the calling thread's
// own stream (CUDA's per-thread default stream), so ranks that are threads
// of one process do not serialize on one another; copy_bytes and
// synchronize() wait for that stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distopt/core/dtype.hpp"

namespace distopt {

enum class Device : unsigned char { cpu, cuda };

std::string_view name_of(Device d);
// "cpu" or "cuda"; false for anything else.
bool parse_device(std::string_view text, Device* out);

// Whether this build has the CUDA kernels.
bool cuda_built();
// CUDA devices visible to this process (0 when none, or not cuda_built()).
int cuda_device_count();
// Why Device::cuda cannot be used here (empty when it can): "this build has
// no CUDA ..." or "no CUDA device (...)".
std::string cuda_unavailable_reason();
// Throws InvalidInput "<what>: <reason>" when `d` cannot be used.
void require_device(Device d, std::string_view what = "--device cuda");

// Device memory from the caching pool, zeroed. `what` names the memory in
// the one-line error an allocation failure throws (DeviceError: "out of
// CUDA memory allocating 1.5 GiB for <what> (... free of ...)").
void* device_alloc(std::size_t bytes, std::string_view what);
// Returns a block to the pool (nullptr: nothing).
void device_free(void* p) noexcept;
// Gives the pool's unused blocks back to the driver.
void device_release_cached();
// Bytes the pool holds (in use and cached), for reports.
std::size_t device_pool_bytes();

// Copies `bytes` from src (on `from`) to dst (on `to`) and waits for it.
void copy_bytes(void* dst, Device to, const void* src, Device from, std::size_t bytes);
// dst[0..n) = value, on `d`.
void fill_floats(float* dst, std::size_t n, float value, Device d);
// dst[0..n) = the n elements of src (dtype `t`) widened to float, on `d`.
void widen_to_floats(float* dst, const void* src, DType t, std::size_t n, Device d);
// Zeroes `bytes` at p, on `d`.
void zero_bytes(void* p, std::size_t bytes, Device d);
// Waits for the calling thread's stream (no-op on the CPU).
void synchronize(Device d);
// Waits for a caller's CUDA stream: a cudaStream_t as an integer, 0 being
// the legacy default stream (torch's default stream; no-op without CUDA).
void synchronize_stream(std::uintptr_t stream);
// The calling thread's current CUDA device (0 without CUDA), and waiting for
// every stream of a device (nothing without CUDA).
int cuda_current_device();
void synchronize_cuda_device(int device);

}  // namespace distopt
