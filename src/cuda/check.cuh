// CUDA error handling inside src/cuda/: every failure is one line
// (DeviceError) naming what was being done.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
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
// a device area it is copied to, each at least `bytes` (grown on demand).
struct Staging {
  unsigned char* host = nullptr;
  unsigned char* device = nullptr;
};
Staging staging(std::size_t bytes);

}  // namespace distopt::cuda
