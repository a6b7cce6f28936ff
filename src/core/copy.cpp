#include "distopt/core/copy.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace distopt {

void stream_fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

#if defined(__AVX__)
namespace {

// 128 bytes from s to d: unaligned loads, non-temporal stores (d is
// 32-byte aligned).
inline void stream_128(unsigned char* d, const unsigned char* s) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
}

constexpr std::size_t kLane = 4096, kLanes = 4, kUnit = kLane * kLanes;

}  // namespace
#endif

void stream_bytes(void* dst, const void* src, std::size_t bytes, bool fence) {
  stream_bytes_to({&dst, 1}, src, bytes, fence);
}

void stream_bytes_to(std::span<void* const> dsts, const void* src, std::size_t bytes, bool fence) {
  if (dsts.empty()) return;
#if defined(__AVX__)
  const auto misalign = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 32; };
  for (void* d : dsts)
    if (misalign(d) != misalign(dsts[0])) {
      // Destinations aligned differently: one pass each.
      for (void* e : dsts) stream_bytes(e, src, bytes, false);
      if (fence) _mm_sfence();
      return;
    }
  const auto* s = static_cast<const unsigned char*>(src);
  // Head: plain copy up to 32-byte aligned destinations.
  const std::size_t head = std::min<std::size_t>(bytes, (32 - misalign(dsts[0])) % 32);
  for (void* d : dsts) std::memcpy(d, s, head);
  s += head;
  bytes -= head;
  auto out = [&](std::size_t i) {
    for (void* d : dsts) stream_128(static_cast<unsigned char*>(d) + head + i, s + i);
  };
  // Units of four 4 KiB lanes copied in turn, 128 bytes of each, with the
  // loads prefetched two units ahead: four concurrent streams keep more
  // memory requests in flight than one (measured: 1.1-1.3x on a 2-thread
  // copy of 64-256 MiB; docs/performance.md). Each 128 bytes read go to
  // every destination, so the source is read once.
  const std::size_t units = bytes / kUnit * kUnit;
  for (std::size_t u = 0; u < units; u += kUnit) {
    const bool ahead = u + 3 * kUnit <= bytes;  // prefetch only inside the source
    for (std::size_t o = 0; o < kLane; o += 128)
      for (std::size_t lane = 0; lane < kLanes; ++lane) {
        const std::size_t i = u + lane * kLane + o;
        if (ahead) {
          _mm_prefetch(reinterpret_cast<const char*>(s + i + 2 * kUnit), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(s + i + 2 * kUnit + 64), _MM_HINT_T0);
        }
        out(i);
      }
  }
  const std::size_t body = units + (bytes - units) / 128 * 128;
  for (std::size_t i = units; i < body; i += 128) out(i);
  for (void* d : dsts) std::memcpy(static_cast<unsigned char*>(d) + head + body, s + body, bytes - body);
  if (fence) _mm_sfence();  // make the streamed data visible before any later release
#else
  for (void* d : dsts) std::memcpy(d, src, bytes);
  (void)fence;
#endif
}

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes >= kStreamBytes) stream_bytes(dst, src, bytes);
  else if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace distopt
