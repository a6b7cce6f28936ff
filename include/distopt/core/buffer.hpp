// Owning, aligned, zero-initialised memory for parameters, gradients and
// optimizer state.
//
// Small buffers are 64-byte aligned (one cache line, one AVX-512 vector).
// Large buffers (>= kLargeBuffer bytes) are mapped separately and shifted
// by `stagger_slot` times kStaggerStep from the mapping's start; those of
// at least kHugeBuffer bytes start from a 2 MiB boundary (a transparent
// huge page), smaller ones are kept off huge pages: a huge page faults in
// 2 MiB at once, and a 1 MiB buffer on one would hold twice its size
// resident (docs/performance.md, "Memory"). A kernel that streams several arrays at once (Adam reads
// param, grad, exp_avg, exp_avg_sq) otherwise finds all its streams at the
// same offset modulo the page/cache geometry; their accesses then compete for
// the same L1/L2 sets and 4 KiB-aliasing stalls loads behind stores. Give each
// array a kernel reads together a different slot (docs/performance.md has the
// measurement that chose kStaggerStep).
//
// A buffer on Device::cuda holds device memory from the caching pool
// (core/device.hpp), zeroed; stagger slots do not apply there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "distopt/core/device.hpp"

namespace distopt {

inline constexpr std::size_t kCacheLine = 64;
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;
inline constexpr std::size_t kLargeBuffer = std::size_t{1} << 20;
inline constexpr std::size_t kHugeBuffer = std::size_t{16} << 20;
inline constexpr std::size_t kStaggerStep = std::size_t{68} << 10;  // 64 KiB + 4 KiB
inline constexpr int kStaggerSlots = 16;

class Buffer {
 public:
  Buffer() = default;
  // `bytes` of zeroed memory. `stagger_slot` (any int, taken modulo
  // kStaggerSlots) matters only for large buffers.
  explicit Buffer(std::size_t bytes, int stagger_slot = 0);
  // `bytes` of zeroed memory on `device`; `what` names it in the one-line
  // error of a failed device allocation.
  Buffer(std::size_t bytes, int stagger_slot, Device device, std::string_view what = "a buffer");
  ~Buffer();
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <class T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }
  std::size_t size_bytes() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  Device device() const { return device_; }

 private:
  void swap(Buffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(map_base_, o.map_base_);
    std::swap(map_bytes_, o.map_bytes_);
    std::swap(device_, o.device_);
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  void* map_base_ = nullptr;  // non-null when the buffer is an mmap
  std::size_t map_bytes_ = 0;
  Device device_ = Device::cpu;
};

}  // namespace distopt
