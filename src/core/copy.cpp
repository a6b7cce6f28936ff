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

void stream_bytes(void* dst, const void* src, std::size_t bytes, bool fence) {
#if defined(__AVX__)
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  // Head: plain copy up to a 32-byte aligned destination.
  const std::size_t head = std::min<std::size_t>(bytes, (32 - reinterpret_cast<std::uintptr_t>(d) % 32) % 32);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const std::size_t body = bytes / 128 * 128;
  for (std::size_t i = 0; i < body; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + body, s + body, bytes - body);
  if (fence) _mm_sfence();  // make the streamed data visible before any later release
#else
  std::memcpy(dst, src, bytes);
  (void)fence;
#endif
}

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes >= kStreamBytes) stream_bytes(dst, src, bytes);
  else if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace distopt
