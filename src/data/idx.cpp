// IDX reader (the MNIST file format), through zlib so that gzipped and plain
// files read alike. Layout: 0x00 0x00, a type byte (0x08: unsigned byte), the
// number of dimensions, then each dimension as a big-endian uint32, then the
// data in row-major order.
#include <zlib.h>

#include <algorithm>
#include <memory>

#include "distopt/core/error.hpp"
#include "distopt/data/dataset.hpp"

namespace distopt::data {

namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

// Reads up to `bytes`; returns how many were read. Throws on a zlib error
// (a corrupt gzip stream), naming the file.
std::size_t read_some(gzFile f, void* out, std::size_t bytes, const std::string& path) {
  std::size_t done = 0;
  while (done < bytes) {
    const unsigned ask = static_cast<unsigned>(std::min<std::size_t>(bytes - done, 1u << 30));
    const int got = gzread(f, static_cast<char*>(out) + done, ask);
    if (got < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      throw InvalidInput(str(path, ": not a valid gzip/IDX file (", msg, ")"));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  GzFile f(gzopen(path.c_str(), "rb"));
  if (!f) throw IoError(str(path, ": cannot open"));
  unsigned char magic[4];
  if (read_some(f.get(), magic, 4, path) != 4) throw InvalidInput(str(path, ": truncated IDX header"));
  if (magic[0] != 0 || magic[1] != 0)
    throw InvalidInput(str(path, ": wrong IDX magic number (first bytes ", int(magic[0]), " ", int(magic[1]),
                           ", expected 0 0)"));
  if (magic[2] != 0x08)
    throw InvalidInput(str(path, ": IDX element type 0x", std::hex, int(magic[2]), " is not 0x08 (unsigned byte)"));
  const int ndims = magic[3];
  if (ndims < 1 || ndims > 4) throw InvalidInput(str(path, ": IDX header has ", ndims, " dimensions (expected 1-4)"));
  IdxArray a;
  std::size_t total = 1;
  for (int d = 0; d < ndims; ++d) {
    unsigned char b[4];
    if (read_some(f.get(), b, 4, path) != 4) throw InvalidInput(str(path, ": truncated IDX header"));
    const std::uint32_t dim = (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | b[3];
    a.dims.push_back(dim);
    total *= dim;
    if (total > (std::size_t{1} << 34)) throw InvalidInput(str(path, ": IDX dimensions are implausibly large"));
  }
  // Grow with what the file really holds: a short file whose header claims
  // gigabytes allocates no more than it has (gzip hides the real length).
  std::size_t got = 0;
  while (got < total) {
    const std::size_t want = std::min(total - got, std::max<std::size_t>(got, std::size_t{1} << 20));
    a.data.resize(got + want);
    const std::size_t n = read_some(f.get(), a.data.data() + got, want, path);
    got += n;
    if (n < want) break;
  }
  a.data.resize(got);
  if (got != total)
    throw InvalidInput(str(path, ": truncated: header promises ", total, " bytes of data, file has ", got));
  unsigned char extra;
  if (read_some(f.get(), &extra, 1, path) != 0)
    throw InvalidInput(str(path, ": has data beyond the ", total, " bytes its header promises"));
  return a;
}

}  // namespace distopt::data
