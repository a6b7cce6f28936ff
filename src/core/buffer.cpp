#include "distopt/core/buffer.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "distopt/core/error.hpp"

namespace distopt {

Buffer::Buffer(std::size_t bytes, int stagger_slot) : bytes_(bytes) {
  if (bytes == 0) return;
  if (bytes < kLargeBuffer) {
    const std::size_t rounded = (bytes + kCacheLine - 1) / kCacheLine * kCacheLine;
    data_ = std::aligned_alloc(kCacheLine, rounded);
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_, 0, rounded);
    return;
  }
  const int slot = ((stagger_slot % kStaggerSlots) + kStaggerSlots) % kStaggerSlots;
  const std::size_t shift = static_cast<std::size_t>(slot) * kStaggerStep;
  const bool huge = bytes >= kHugeBuffer;
  map_bytes_ = bytes + shift + (huge ? kHugePage : 0);
  map_base_ = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map_base_ == MAP_FAILED) {
    map_base_ = nullptr;
    throw std::bad_alloc();
  }
  const auto base = reinterpret_cast<std::uintptr_t>(map_base_);
  if (!huge) {
    data_ = reinterpret_cast<void*>(base + shift);
#ifdef MADV_NOHUGEPAGE
    ::madvise(map_base_, map_bytes_, MADV_NOHUGEPAGE);
#endif
    return;
  }
  const std::uintptr_t aligned = (base + kHugePage - 1) & ~(std::uintptr_t{kHugePage} - 1);
  data_ = reinterpret_cast<void*>(aligned + shift);
#ifdef MADV_HUGEPAGE
  ::madvise(reinterpret_cast<void*>(aligned), map_bytes_ - (aligned - base), MADV_HUGEPAGE);
#endif
}

Buffer::Buffer(std::size_t bytes, int stagger_slot, Device device, std::string_view what) {
  if (device == Device::cpu) {
    Buffer host(bytes, stagger_slot);
    swap(host);
    return;
  }
  if (bytes == 0) return;
  data_ = device_alloc(bytes, what);
  bytes_ = bytes;
  device_ = device;
}

Buffer::~Buffer() {
  if (device_ == Device::cuda) device_free(data_);
  else if (map_base_ != nullptr) ::munmap(map_base_, map_bytes_);
  else std::free(data_);
}

}  // namespace distopt
