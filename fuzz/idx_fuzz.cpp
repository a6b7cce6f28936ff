// libFuzzer target: an IDX file (raw or gzipped), read through read_idx
// from an in-memory file. Only distopt::Error may escape as an answer.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "distopt/core/error.hpp"
#include "distopt/data/dataset.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const int fd = memfd_create("idx_fuzz", 0);
  if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) __builtin_trap();
  try {
    (void)distopt::data::read_idx("/proc/self/fd/" + std::to_string(fd));
  } catch (const distopt::Error&) {
  }
  return 0;
}
