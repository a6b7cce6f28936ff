// Byte-level text for model "gpt" (dataset.hpp; docs/models.md).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <utility>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/data/dataset.hpp"

namespace distopt::data {

namespace fs = std::filesystem;

namespace {

std::vector<std::uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path.string(), ": cannot read it"));
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw IoError(str(path.string(), ": read error"));
  return bytes;
}

Text split_tail(std::string source, const std::vector<std::uint8_t>& all) {
  Text t;
  t.source = std::move(source);
  const std::size_t val = all.size() / 10;
  const auto cut = all.end() - static_cast<std::ptrdiff_t>(val);
  t.val.assign(cut, all.end());
  t.train.assign(all.begin(), cut);
  return t;
}

}  // namespace

std::string default_fortunes_dir() {
  const char* env = std::getenv("DISTOPT_FORTUNES_DIR");
  return env != nullptr && *env != '\0' ? env : "/usr/share/games/fortunes";
}

Text load_fortunes(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw IoError(str(dir, ": no such folder; --data fortunes reads Debian's fortunes package "
                           "(apt-get install fortunes) or $DISTOPT_FORTUNES_DIR"));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string ext = e.path().extension().string();
    if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") files.push_back(e.path());
  }
  if (ec) throw IoError(str(dir, ": cannot list it: ", ec.message()));
  std::sort(files.begin(), files.end());
  if (files.empty())
    throw IoError(str(dir, ": no fortune files in it; --data fortunes reads Debian's fortunes package "
                           "(apt-get install fortunes)"));
  std::vector<std::uint8_t> all;
  for (const fs::path& f : files) {
    const std::vector<std::uint8_t> b = read_bytes(f);
    all.insert(all.end(), b.begin(), b.end());
  }
  return split_tail(str(dir, " (", files.size(), " files)"), all);
}

Text load_text_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw InvalidInput(str("--data-file ", path, ": is a folder, not a file"));
  if (!fs::exists(path, ec)) throw IoError(str("--data-file ", path, ": no such file"));
  const std::vector<std::uint8_t> all = read_bytes(path);
  if (all.empty()) throw InvalidInput(str("--data-file ", path, ": the file is empty"));
  return split_tail(path, all);
}

Split text_split(Text text, std::size_t context, std::uint64_t seed, std::size_t max_val) {
  if (context == 0) throw InvalidInput("--context must be at least 1 (got 0)");
  for (const auto* part : {&text.train, &text.val})
    if (part->size() < context + 1)
      throw InvalidInput(str("--context ", context, " needs windows of ", context + 1, " bytes; the ",
                             part == &text.train ? "training" : "validation", " part of ", text.source, " has ",
                             part->size(), " (the last 10% of the text is held out)"));
  Split s;
  s.name = "text";
  const std::size_t features = context + 1;
  // Training: train bytes / context windows an epoch, made on demand.
  s.train.features = features;
  s.train.classes = 256;
  s.train.y.assign(text.train.size() / context, 0.0f);
  auto bytes = std::make_shared<const std::vector<std::uint8_t>>(std::move(text.train));  // taken, not copied
  s.train.make_bytes = bytes->capacity();
  const std::uint64_t positions = bytes->size() - context;  // starts 0 .. size - context - 1
  s.train.make = [bytes, positions, features, seed](std::uint64_t epoch, std::size_t i, float* out) {
    Rng rng(seed ^ 0x7e47u, (epoch << 32) ^ i);
    const std::size_t at = rng.below(positions);
    for (std::size_t k = 0; k < features; ++k) out[k] = static_cast<float>((*bytes)[at + k]);
  };
  // Validation: consecutive disjoint windows.
  std::size_t windows = (text.val.size() - 1) / context;
  if (max_val > 0) windows = std::min(windows, max_val);
  s.test.features = features;
  s.test.classes = 256;
  s.test.y.assign(windows, 0.0f);
  s.test.x.resize(windows * features);
  for (std::size_t w = 0; w < windows; ++w)
    for (std::size_t k = 0; k < features; ++k) s.test.x[w * features + k] = static_cast<float>(text.val[w * context + k]);
  return s;
}

}  // namespace distopt::data
