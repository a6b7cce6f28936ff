// Bulk copies for data the copying thread will not read again soon
// (collectives' outputs). Above kStreamBytes the stores are non-temporal:
// they bypass the caches and skip the read-for-ownership of the
// destination, so a copy moves 2 bytes of memory traffic per byte instead
// of 3. Below it, plain memcpy (the data may still be in cache).
// docs/performance.md has the measurement that chose the threshold.
#pragma once

#include <cstddef>
#include <span>

namespace distopt {

inline constexpr std::size_t kStreamBytes = std::size_t{4} << 20;

// memcpy semantics (no overlap); values are never changed.
void copy_bytes(void* dst, const void* src, std::size_t bytes);
// Copy with non-temporal stores regardless of size (falls back to memcpy
// where the CPU has no streaming stores). Streamed stores become visible to
// other threads only after a fence: pass fence=false for a series of pieces
// and call stream_fence() once after the last.
void stream_bytes(void* dst, const void* src, std::size_t bytes, bool fence = true);
void stream_fence();
// stream_bytes to several destinations at once, reading the source once.
void stream_bytes_to(std::span<void* const> dsts, const void* src, std::size_t bytes, bool fence = true);

}  // namespace distopt
