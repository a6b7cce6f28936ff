// core/cuda_backend.hpp for a build without CUDA: nothing is visible and
// every use of device memory is refused in one line.
#include "cuda_backend.hpp"

#include "distopt/core/error.hpp"

namespace distopt::cuda {
namespace {

[[noreturn]] void refuse() {
  throw InvalidInput("this build has no CUDA (configure with -DDISTOPT_CUDA=ON on a machine with nvcc)");
}

}  // namespace

bool built() { return false; }
int device_count(std::string* why) {
  if (why) *why = "this build has no CUDA (configure with -DDISTOPT_CUDA=ON on a machine with nvcc)";
  return 0;
}
void* alloc(std::size_t, std::string_view) { refuse(); }
void free(void*) noexcept {}
void release_cached() {}
std::size_t pool_bytes() { return 0; }
void copy(void*, const void*, std::size_t, CopyKind) { refuse(); }
void fill(float*, std::size_t, float) { refuse(); }
void widen(float*, const void*, DType, std::size_t) { refuse(); }
void zero(void*, std::size_t) { refuse(); }
void synchronize() {}
void synchronize_stream(std::uintptr_t) {}
int current_device() { return 0; }
void synchronize_device(int) {}

}  // namespace distopt::cuda
