#include "distopt/core/device.hpp"

#include <algorithm>
#include <cstring>

#include "cuda_backend.hpp"
#include "distopt/core/error.hpp"

namespace distopt {

std::string_view name_of(Device d) { return d == Device::cuda ? "cuda" : "cpu"; }

bool parse_device(std::string_view text, Device* out) {
  if (text == "cpu") *out = Device::cpu;
  else if (text == "cuda") *out = Device::cuda;
  else return false;
  return true;
}

bool cuda_built() { return cuda::built(); }

int cuda_device_count() { return cuda::device_count(nullptr); }

std::string cuda_unavailable_reason() {
  std::string why;
  return cuda::device_count(&why) > 0 ? std::string() : why;
}

void require_device(Device d, std::string_view what) {
  if (d == Device::cpu) return;
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) throw InvalidInput(str(what, ": ", why));
}

void* device_alloc(std::size_t bytes, std::string_view what) { return cuda::alloc(bytes, what); }
void device_free(void* p) noexcept { cuda::free(p); }
void device_release_cached() { cuda::release_cached(); }
std::size_t device_pool_bytes() { return cuda::pool_bytes(); }

void copy_bytes(void* dst, Device to, const void* src, Device from, std::size_t bytes) {
  if (bytes == 0) return;
  if (to == Device::cpu && from == Device::cpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const auto kind = to == Device::cpu     ? cuda::CopyKind::device_to_host
                    : from == Device::cpu ? cuda::CopyKind::host_to_device
                                          : cuda::CopyKind::device_to_device;
  cuda::copy(dst, src, bytes, kind);
}

void fill_floats(float* dst, std::size_t n, float value, Device d) {
  if (d == Device::cpu) std::fill(dst, dst + n, value);
  else cuda::fill(dst, n, value);
}

void widen_to_floats(float* dst, const void* src, DType t, std::size_t n, Device d) {
  if (d == Device::cuda) return cuda::widen(dst, src, t, n);
  dispatch_dtype(t, [&]<class T>() {
    const T* s = static_cast<const T*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(s[i]);
  });
}

void zero_bytes(void* p, std::size_t bytes, Device d) {
  if (bytes == 0) return;
  if (d == Device::cpu) std::memset(p, 0, bytes);
  else cuda::zero(p, bytes);
}

void synchronize(Device d) {
  if (d == Device::cuda) cuda::synchronize();
}

void synchronize_stream(std::uintptr_t stream) { cuda::synchronize_stream(stream); }
int cuda_current_device() { return cuda::current_device(); }
void synchronize_cuda_device(int device) { cuda::synchronize_device(device); }

}  // namespace distopt
