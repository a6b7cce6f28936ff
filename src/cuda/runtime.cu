// The CUDA runtime side of core/device.hpp: device discovery, the caching
// memory pool, copies and small element kernels (docs/gpu.md).
//
// Everything runs on the calling thread's own stream: this file is built
// with --default-stream per-thread, so stream 0 below is per thread and
// threads-as-ranks sharing one GPU do not serialize on one another.
#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../core/cuda_backend.hpp"
#include "check.cuh"
#include "distopt/core/dtype.hpp"

namespace distopt::cuda {

std::string human_bytes(std::size_t bytes) {
  char text[32];
  const double b = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) std::snprintf(text, sizeof text, "%.2f GiB", b / (1u << 30));
  else if (bytes >= (std::size_t{1} << 20)) std::snprintf(text, sizeof text, "%.1f MiB", b / (1u << 20));
  else if (bytes >= (std::size_t{1} << 10)) std::snprintf(text, sizeof text, "%.1f KiB", b / (1u << 10));
  else std::snprintf(text, sizeof text, "%zu B", bytes);
  return text;
}

bool built() { return true; }

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = str("no CUDA device (", cudaGetErrorString(e), ")");
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

namespace {

// Blocks are rounded up so that freed ones fit later requests of about the
// same size: to 512 B below 1 MiB, to 2 MiB above. A request takes the
// smallest cached block that fits and is at most twice its size.
constexpr std::size_t kSmallRound = 512;
constexpr std::size_t kLargeRound = std::size_t{2} << 20;

std::size_t rounded(std::size_t bytes) {
  const std::size_t r = bytes < (std::size_t{1} << 20) ? kSmallRound : kLargeRound;
  return (bytes + r - 1) / r * r;
}

// Blocks are kept per device: a process may step parameters on several
// (one optimizer per device), and a block serves only the device it is on.
struct Key {
  int device;
  std::size_t size;
  bool operator<(const Key& o) const { return device != o.device ? device < o.device : size < o.size; }
};

struct Pool {
  std::mutex mu;
  std::multimap<Key, void*> cached;     // (device, size) -> block
  std::unordered_map<void*, Key> used;  // block -> (device, size)
  std::size_t held = 0;                 // bytes cudaMalloc'd and not yet freed
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: blocks may be freed during static destruction
  return *p;
}

void release_cached_locked(Pool& p) {
  int current = 0;
  (void)cudaGetDevice(&current);
  for (auto& [key, block] : p.cached) {
    (void)cudaSetDevice(key.device);
    cudaFree(block);
    p.held -= key.size;
  }
  (void)cudaSetDevice(current);
  p.cached.clear();
}

}  // namespace

void* alloc(std::size_t bytes, std::string_view what) {
  const std::size_t size = rounded(bytes == 0 ? 1 : bytes);
  int device = 0;
  check(cudaGetDevice(&device), str("allocating ", human_bytes(bytes), " for ", what));
  Pool& p = pool();
  void* block = nullptr;
  {
    std::lock_guard lock(p.mu);
    const auto it = p.cached.lower_bound({device, size});
    if (it != p.cached.end() && it->first.device == device && it->first.size <= 2 * size) {
      block = it->second;
      p.used[block] = it->first;
      p.cached.erase(it);
    } else {
      cudaError_t e = cudaMalloc(&block, size);
      if (e == cudaErrorMemoryAllocation && !p.cached.empty()) {
        (void)cudaGetLastError();
        release_cached_locked(p);
        e = cudaMalloc(&block, size);
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        std::size_t free_bytes = 0, total = 0;
        (void)cudaMemGetInfo(&free_bytes, &total);
        if (e == cudaErrorMemoryAllocation)
          throw DeviceError(str("out of CUDA memory allocating ", human_bytes(bytes), " for ", what, " (",
                                human_bytes(free_bytes), " free of ", human_bytes(total), ")"));
        check(e, str("cudaMalloc of ", human_bytes(bytes), " for ", what));
      }
      p.used[block] = {device, size};
      p.held += size;
    }
  }
  check(cudaMemsetAsync(block, 0, bytes, 0), str("zeroing ", human_bytes(bytes), " for ", what));
  check(cudaStreamSynchronize(0), str("zeroing ", human_bytes(bytes), " for ", what));
  return block;
}

void free(void* block) noexcept {
  if (block == nullptr) return;
  // Work queued on this thread's stream may still use the block; another
  // thread may take it from the pool next.
  (void)cudaStreamSynchronize(0);
  Pool& p = pool();
  std::lock_guard lock(p.mu);
  const auto it = p.used.find(block);
  if (it == p.used.end()) return;
  p.cached.emplace(it->second, block);
  p.used.erase(it);
}

void release_cached() {
  Pool& p = pool();
  std::lock_guard lock(p.mu);
  release_cached_locked(p);
}

std::size_t pool_bytes() {
  Pool& p = pool();
  std::lock_guard lock(p.mu);
  return p.held;
}

void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind) {
  const cudaMemcpyKind k = kind == CopyKind::host_to_device   ? cudaMemcpyHostToDevice
                           : kind == CopyKind::device_to_host ? cudaMemcpyDeviceToHost
                                                              : cudaMemcpyDeviceToDevice;
  check(cudaMemcpyAsync(dst, src, bytes, k, 0), str("copying ", human_bytes(bytes)));
  check(cudaStreamSynchronize(0), str("copying ", human_bytes(bytes)));
}

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::size_t n) {
  const std::size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);
}

__global__ void fill_kernel(float* dst, std::size_t n, float value) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x)
    dst[i] = value;
}

template <class T>
__global__ void widen_kernel(float* dst, const T* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x)
    dst[i] = to_float(src[i]);
}

void finish(std::string_view what, std::size_t n) {
  check(cudaGetLastError(), str(what, " of ", n, " elements"));
  check(cudaStreamSynchronize(0), str(what, " of ", n, " elements"));
}

}  // namespace

void fill(float* dst, std::size_t n, float value) {
  if (n == 0) return;
  fill_kernel<<<blocks_for(n), kThreads>>>(dst, n, value);
  finish("fill", n);
}

void widen(float* dst, const void* src, DType t, std::size_t n) {
  if (n == 0) return;
  dispatch_dtype(t, [&]<class T>() { widen_kernel<T><<<blocks_for(n), kThreads>>>(dst, static_cast<const T*>(src), n); });
  finish("widen to f32", n);
}

void zero(void* p, std::size_t bytes) {
  check(cudaMemsetAsync(p, 0, bytes, 0), str("zeroing ", human_bytes(bytes)));
  check(cudaStreamSynchronize(0), str("zeroing ", human_bytes(bytes)));
}

void synchronize() { check(cudaStreamSynchronize(0), "synchronize"); }

cudaStream_t as_stream(std::uintptr_t handle) {
  return handle == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(handle);
}

void synchronize_stream(std::uintptr_t handle) {
  check(cudaStreamSynchronize(as_stream(handle)), "waiting for the caller's stream");
}

namespace {

// One slot of a staging ring: pinned host memory, the device memory it is
// copied to, and an event recorded after the last launch that read them.
struct Slot {
  unsigned char* host = nullptr;
  unsigned char* device = nullptr;
  std::size_t size = 0;
  cudaEvent_t used{};
  bool recorded = false;
  ~Slot() {
    if (recorded) (void)cudaEventSynchronize(used);
    if (used) (void)cudaEventDestroy(used);
    if (host) cudaFreeHost(host);
    if (device) cuda::free(device);
  }
};

// A thread's ring on one device (its slots' events and memory belong to
// that device). A launch takes the next slot; when that slot's last launches
// have not finished (the host is ahead of the device by more launches than
// the ring has slots: many groups, a deep queue), the ring grows by a slot
// instead of waiting, up to kMaxSlots, past which it waits.
constexpr std::size_t kMaxSlots = 64;

struct Ring {
  std::vector<std::unique_ptr<Slot>> slots;
  std::size_t next = 0;
};

thread_local std::map<int, Ring> rings;  // by device ordinal
thread_local Ring* taken = nullptr;      // the ring whose slot `next` staging() handed out

}  // namespace

Staging staging(std::size_t bytes) {
  int device = 0;
  check(cudaGetDevice(&device), "staging kernel metadata");
  Ring& ring = rings[device];
  if (ring.slots.empty()) ring.slots.push_back(std::make_unique<Slot>());
  Slot* slot = ring.slots[ring.next].get();
  if (slot->recorded) {
    const cudaError_t q = cudaEventQuery(slot->used);
    if (q == cudaErrorNotReady) (void)cudaGetLastError();  // not an error: keep it from later checks
    if (q == cudaSuccess) {
      slot->recorded = false;
    } else if (q == cudaErrorNotReady && ring.slots.size() < kMaxSlots) {
      ring.slots.insert(ring.slots.begin() + static_cast<std::ptrdiff_t>(ring.next), std::make_unique<Slot>());
      slot = ring.slots[ring.next].get();
    } else {
      if (q != cudaErrorNotReady) check(q, "a staging area's event");
      check(cudaEventSynchronize(slot->used), "waiting for a staging area");
      slot->recorded = false;
    }
  }
  if (!slot->used) check(cudaEventCreateWithFlags(&slot->used, cudaEventDisableTiming), "creating an event");
  if (slot->size < bytes) {
    const std::size_t size = bytes < 4096 ? 4096 : bytes * 2;
    if (slot->host) cudaFreeHost(slot->host);
    if (slot->device) cuda::free(slot->device);
    slot->host = nullptr;
    slot->device = nullptr;
    slot->size = 0;
    void* h = nullptr;
    check(cudaMallocHost(&h, size), str("pinned staging of ", human_bytes(size)));
    slot->host = static_cast<unsigned char*>(h);
    slot->device = static_cast<unsigned char*>(alloc(size, "kernel metadata"));
    slot->size = size;
  }
  taken = &ring;
  return {slot->host, slot->device};
}

void staging_used(cudaStream_t stream) {
  Ring& ring = *taken;
  Slot& slot = *ring.slots[ring.next];
  ring.next = (ring.next + 1) % ring.slots.size();
  check(cudaEventRecord(slot.used, stream), "recording a staging area's use");
  slot.recorded = true;
}

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "which device is current");
  return device;
}

void synchronize_device(int device) {
  int current = 0;
  check(cudaGetDevice(&current), "which device is current");
  check(cudaSetDevice(device), "selecting a device");
  const cudaError_t e = cudaDeviceSynchronize();
  (void)cudaSetDevice(current);
  check(e, "waiting for a device");
}

}  // namespace distopt::cuda
