// Tensors to load from, in memory or in a checkpoint's rank files
// (include/distopt/checkpoint/source.hpp).
#include "distopt/checkpoint/source.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/core/error.hpp"

namespace distopt::checkpoint {
namespace {

// A map's keys, in its (sorted) order: a source's names().
template <class Map>
std::vector<std::string> keys_of(const Map& map) {
  std::vector<std::string> out;
  for (const auto& entry : map) out.push_back(entry.first);
  return out;
}

}  // namespace

std::vector<float> TensorSource::whole(const std::string& name) const {
  const Shape* s = shape(name);
  DISTOPT_CHECK(s != nullptr, "no tensor ", name);
  const std::uint64_t n = elements_of(*s);
  if (n > kMaxElements) throw InvalidInput(str("tensor ", name, ": shape ", to_string(*s), " is too large"));
  std::vector<float> out(static_cast<std::size_t>(n));
  read(name, 0, out);
  return out;
}

std::vector<std::string> TensorSource::names_under(const std::string& prefix) const {
  std::vector<std::string> out;
  for (std::string& n : names())
    if (n.rfind(prefix, 0) == 0) out.push_back(std::move(n));
  return out;
}

std::vector<std::string> WholeTensors::names() const {
  return keys_of(wholes_);
}

const Shape* WholeTensors::shape(const std::string& name) const {
  const auto it = wholes_.find(name);
  return it == wholes_.end() ? nullptr : &it->second.shape;
}

void WholeTensors::read(const std::string& name, std::uint64_t begin, std::span<float> out) const {
  const auto it = wholes_.find(name);
  DISTOPT_CHECK(it != wholes_.end(), "no tensor ", name);
  const std::vector<float>& v = it->second.values;
  DISTOPT_CHECK(begin <= v.size() && out.size() <= v.size() - begin, name, ": elements ", begin, " + ", out.size(),
                " of ", v.size());
  std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(begin), out.size(), out.begin());
}

PieceFiles::PieceFiles(const std::filesystem::path& dir, const Manifest& manifest)
    : PieceFiles([&] {
        std::vector<std::string> paths;
        for (const FileEntry& f : manifest.files) paths.push_back((dir / f.name).string());
        return paths;
      }()) {}

PieceFiles::PieceFiles(std::vector<std::string> paths) : paths_(std::move(paths)) {
  for (std::size_t f = 0; f < paths_.size(); ++f) {
    const std::string& path = paths_[f];
    const SafetensorsHeader header = read_safetensors_header(path);
    for (const ParamSlot& slot : header.slots) {
      Place place = place_of(header.metadata, slot, path);
      auto [it, added] = tensors_.try_emplace(slot.name, Tensor{place.shape, {}});
      if (!added && it->second.shape != place.shape)
        throw InvalidInput(str("tensor ", slot.name, ": the files disagree on its shape (", to_string(it->second.shape),
                               " and ", to_string(place.shape), ")"));
      it->second.pieces.push_back({f, place.begin, slot.numel(), header.data_start + slot.offset * sizeof(float)});
    }
  }
  // Every element in some file: in order of their first element, each
  // piece extends what is covered, [0, covered).
  for (auto& [name, t] : tensors_) {
    std::stable_sort(t.pieces.begin(), t.pieces.end(), [](const Ref& a, const Ref& b) { return a.begin < b.begin; });
    std::uint64_t covered = 0;
    for (const Ref& r : t.pieces) {
      if (r.count == 0) continue;
      if (r.begin > covered)
        throw InvalidInput(
            str("tensor ", name, ": elements [", covered, ", ", r.begin, ") are in no file (a missing rank?)"));
      covered = std::max(covered, r.begin + r.count);
    }
    const std::uint64_t n = elements_of(t.shape);
    if (covered < n)
      throw InvalidInput(str("tensor ", name, ": elements [", covered, ", ", n, ") are in no file (a missing rank?)"));
  }
  for (const std::string& path : paths_) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      for (int open : fds_) ::close(open);
      throw IoError(str(path, ": cannot open: ", std::strerror(e)));
    }
    fds_.push_back(fd);
  }
}

PieceFiles::~PieceFiles() {
  for (int fd : fds_) ::close(fd);
}

std::vector<std::string> PieceFiles::names() const {
  return keys_of(tensors_);
}

const Shape* PieceFiles::shape(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second.shape;
}

void PieceFiles::read_piece(const Ref& ref, std::uint64_t begin, std::span<float> out) const {
  auto* at = reinterpret_cast<char*>(out.data());
  std::size_t left = out.size_bytes();
  auto offset = static_cast<off_t>(ref.at + (begin - ref.begin) * sizeof(float));
  while (left > 0) {
    const ssize_t n = ::pread(fds_[ref.file], at, left, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw IoError(
          str(paths_[ref.file], ": read failed", n < 0 ? str(": ", std::strerror(errno)) : " (the file shrank)"));
    at += n;
    left -= static_cast<std::size_t>(n);
    offset += n;
  }
}

void PieceFiles::read(const std::string& name, std::uint64_t begin, std::span<float> out) const {
  const auto it = tensors_.find(name);
  DISTOPT_CHECK(it != tensors_.end(), "no tensor ", name);
  const Tensor& t = it->second;
  const std::uint64_t n = elements_of(t.shape), end = begin + out.size();
  DISTOPT_CHECK(begin <= n && out.size() <= n - begin, name, ": elements ", begin, " + ", out.size(), " of ", n);
  // Pieces in order of their first element: each fills what follows
  // [begin, covered); what it shares with the earlier ones must agree.
  std::uint64_t covered = begin;
  std::vector<float> copy;
  for (const Ref& r : t.pieces) {
    const std::uint64_t lo = std::max(r.begin, begin), hi = std::min(r.begin + r.count, end);
    if (lo >= hi) continue;
    DISTOPT_CHECK(lo <= covered, name, ": elements [", covered, ", ", lo, ") in no file");  // (checked when made)
    if (lo < covered) {
      const std::uint64_t shared = std::min(hi, covered) - lo;
      copy.resize(static_cast<std::size_t>(shared));
      read_piece(r, lo, copy);
      const float* have = out.data() + (lo - begin);
      if (std::memcmp(have, copy.data(), copy.size() * sizeof(float)) != 0) {
        std::size_t k = 0;
        while (std::memcmp(have + k, copy.data() + k, sizeof(float)) == 0) ++k;
        throw InvalidInput(str("tensor ", name, ": two files hold different values for element ", lo + k, " (", have[k],
                               " and ", copy[k], ")"));
      }
    }
    if (hi > covered) {
      read_piece(r, covered,
                 out.subspan(static_cast<std::size_t>(covered - begin), static_cast<std::size_t>(hi - covered)));
      covered = hi;
    }
  }
  DISTOPT_CHECK(covered == end, name, ": elements [", covered, ", ", end, ") in no file");  // (checked when made)
}

}  // namespace distopt::checkpoint
