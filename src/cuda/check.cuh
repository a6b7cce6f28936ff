// CUDA error handling inside src/cuda/: every failure is one line
// (DeviceError) naming what was being done.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distopt/core/error.hpp"

namespace distopt::cuda {

inline void check(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear a sticky-free error so the next call starts clean
    throw DeviceError(str("CUDA error in ", what, ": ", cudaGetErrorString(e)));
  }
}

// "1.50 GiB", "96 MiB", "512 B".
std::string human_bytes(std::size_t bytes);

// A pinned host staging area of the calling thread for kernel metadata, and
// a device area it is copied to, each at least `bytes` (grown on demand),
// free to overwrite: the next slot of a small per-thread ring, whose last
// use has finished (waited for, on the host). After enqueueing the copy and
// the launches that read it, call staging_used with their stream.
struct Staging {
  unsigned char* host = nullptr;
  unsigned char* device = nullptr;
};
Staging staging(std::size_t bytes);
void staging_used(cudaStream_t stream);
// Runs enqueue() -- the copy and launches that read the area staging()
// handed out last -- then marks it used by `stream`, also when enqueue
// throws (work already enqueued may read it).
template <class F>
void enqueue_staged(cudaStream_t stream, F&& enqueue) {
  try {
    enqueue();
  } catch (...) {
    try {
      staging_used(stream);
    } catch (...) {
    }
    throw;
  }
  staging_used(stream);
}

// A caller's stream from its handle (core/cuda_backend.hpp): 0 is the
// legacy default stream (torch's default), not this thread's own.
cudaStream_t as_stream(std::uintptr_t handle);

}  // namespace distopt::cuda
