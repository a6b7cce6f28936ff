#include "distopt/checkpoint/store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "distopt/core/error.hpp"
#include "json_read.hpp"

namespace distopt::checkpoint {
namespace fs = std::filesystem;
namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kFormat = "distopt-checkpoint";
constexpr std::uint64_t kMaxManifestBytes = 64u << 20;

std::string hex(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Closes a descriptor on every path out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void fsync_dir(const fs::path& dir) {
  Fd d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY)};
  if (d.fd < 0 || ::fsync(d.fd) != 0) throw IoError(str(dir.string(), ": cannot sync the directory: ", std::strerror(errno)));
}

// The step of a directory named step-<digits>, or nullopt.
std::optional<std::uint64_t> step_of(const fs::path& p) {
  const std::string name = p.filename().string();
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  std::uint64_t step = 0;
  const char* end = name.data() + name.size();
  const auto [ptr, ec] = std::from_chars(name.data() + 5, end, step);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return step;
}

// (step, directory) of every checkpoint directory under root, oldest first.
std::vector<std::pair<std::uint64_t, fs::path>> checkpoints(const fs::path& root) {
  std::vector<std::pair<std::uint64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (const auto step = step_of(e.path()); step && e.is_directory(ec)) out.emplace_back(*step, e.path());
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw IoError(str(root.string(), ": cannot list the checkpoint directory: ", ec.message()));
  std::sort(out.begin(), out.end());
  return out;
}

bool complete(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kManifest, ec);
}

// A file name a manifest may list: one plain component.
bool plain_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos && n.find('\0') == std::string::npos;
}

}  // namespace

fs::path checkpoint_dir(const fs::path& root, std::uint64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%012llu", static_cast<unsigned long long>(step));
  return root / name;
}

std::uint64_t xxh64(std::span<const std::byte> bytes) { return XXH64(bytes.data(), bytes.size(), 0); }

std::uint64_t xxh64_of_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path.string(), ": cannot open"));
  XXH64_state_t* state = XXH64_createState();
  if (state == nullptr) throw std::bad_alloc();
  XXH64_reset(state, 0);
  std::vector<char> buffer(1 << 20);
  while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0)
    XXH64_update(state, buffer.data(), static_cast<std::size_t>(in.gcount()));
  const std::uint64_t h = XXH64_digest(state);
  XXH64_freeState(state);
  if (in.bad()) throw IoError(str(path.string(), ": read failed"));
  return h;
}

namespace {
constexpr std::size_t kStaged = std::size_t{1} << 20;  // writes below this are gathered
}  // namespace

FileWriter::FileWriter(const fs::path& dir, const std::string& name)
    : dir_(dir), target_(dir / name), tmp_(dir / (name + ".tmp." + std::to_string(::getpid()))), name_(name) {
  if (!plain_name(name)) throw PreconditionError(str("checkpoint file name '", name, "' is not one plain component"));
  // Everything that can fail without a file first: once the file exists,
  // only the destructor (or commit) ends it.
  staged_.reserve(kStaged);
  XXH64_state_t* h = XXH64_createState();
  if (h == nullptr) throw std::bad_alloc();
  XXH64_reset(h, 0);
  hash_ = h;
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const std::string why = std::strerror(errno);
    XXH64_freeState(h);
    throw IoError(str(target_.string(), ": cannot create ", tmp_.string(), ": ", why));
  }
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    std::error_code ec;
    fs::remove(tmp_, ec);
  }
  XXH64_freeState(static_cast<XXH64_state_t*>(hash_));
}

void FileWriter::fail(const std::string& why) {
  ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  fs::remove(tmp_, ec);
  throw IoError(str(target_.string(), ": ", why));
}

void FileWriter::write_all(std::span<const std::byte> bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(str("write failed after ", written_ + done, " bytes: ", std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
  written_ += bytes.size();
}

void FileWriter::flush() {
  write_all(staged_);
  staged_.clear();
}

void FileWriter::write(std::span<const std::byte> bytes) {
  DISTOPT_CHECK(fd_ >= 0, target_.string(), ": written after commit");
  XXH64_update(static_cast<XXH64_state_t*>(hash_), bytes.data(), bytes.size());
  // Large writes go straight from the caller's memory; small ones are gathered.
  if (staged_.size() + bytes.size() > kStaged) flush();
  if (bytes.size() >= kStaged) write_all(bytes);
  else staged_.insert(staged_.end(), bytes.begin(), bytes.end());
}

FileEntry FileWriter::commit() {
  DISTOPT_CHECK(fd_ >= 0, target_.string(), ": committed twice");
  flush();
  if (::fsync(fd_) != 0) fail(str("fsync failed: ", std::strerror(errno)));
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), target_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::error_code ec;
    fs::remove(tmp_, ec);
    throw IoError(str(target_.string(), ": cannot rename ", tmp_.string(), " into place: ", why));
  }
  fsync_dir(dir_);
  return {name_, written_, XXH64_digest(static_cast<XXH64_state_t*>(hash_))};
}

FileEntry write_file(const fs::path& dir, const std::string& name, std::span<const std::byte> bytes) {
  FileWriter w(dir, name);
  w.write(bytes);
  return w.commit();
}

void write_manifest(const fs::path& dir, const Manifest& m) {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = m.version;
  j["step"] = m.step;
  j["files"] = nlohmann::ordered_json::array();
  for (const FileEntry& f : m.files) j["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh64", hex(f.xxh64)}});
  j["run"] = nlohmann::ordered_json::parse(m.body);
  const std::string text = j.dump(1) + "\n";
  (void)write_file(dir, kManifest, std::as_bytes(std::span(text.data(), text.size())));
}

Manifest parse_manifest(const std::string& text, const std::string& where) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw InvalidInput(str(where, kManifest, " is not a JSON object"));
  if (!j.contains("format") || j["format"] != kFormat)
    throw InvalidInput(str(where, kManifest, " is not a distopt checkpoint manifest (format is not \"", kFormat, "\")"));
  Manifest m;
  const auto& version = j["version"];
  if (!version.is_number_integer()) throw InvalidInput(str(where, kManifest, ": version is not an integer"));
  m.version = version.get<int>();
  if (m.version > kFormatVersion)
    throw InvalidInput(str(where, kManifest, " is of format version ", m.version, "; this distopt reads version ",
                           kFormatVersion, " (a newer distopt wrote it)"));
  if (m.version < 1) throw InvalidInput(str(where, kManifest, ": version ", m.version, " is not a format version"));
  if (!j["step"].is_number_unsigned()) throw InvalidInput(str(where, kManifest, ": step is not a count"));
  m.step = j["step"].get<std::uint64_t>();
  if (!j["files"].is_array()) throw InvalidInput(str(where, kManifest, ": files is not a list"));
  for (const auto& f : j["files"]) {
    const nlohmann::json &name = detail::member(f, "name"), &bytes = detail::member(f, "bytes"),
                         &hash = detail::member(f, "xxh64");
    if (!name.is_string() || !bytes.is_number_unsigned() || !hash.is_string())
      throw InvalidInput(str(where, kManifest, ": a file entry lacks name, bytes or xxh64"));
    FileEntry e{name.get<std::string>(), bytes.get<std::uint64_t>(), 0};
    const std::string h = hash.get<std::string>();
    const auto [ptr, perr] = std::from_chars(h.data(), h.data() + h.size(), e.xxh64, 16);
    if (!plain_name(e.name) || h.size() != 16 || perr != std::errc() || ptr != h.data() + h.size())
      throw InvalidInput(str(where, kManifest, ": bad file entry '", e.name, "'"));
    m.files.push_back(std::move(e));
  }
  m.body = j.contains("run") ? j["run"].dump() : "{}";
  return m;
}

Manifest verify(const fs::path& dir) {
  const fs::path mpath = dir / kManifest;
  const std::string where = str("checkpoint ", dir.string(), ": ");
  std::error_code ec;
  if (!fs::is_regular_file(mpath, ec))
    throw InvalidInput(str(where, kManifest, " is missing (an interrupted write, or not a checkpoint)"));
  const auto size = fs::file_size(mpath, ec);
  if (ec || size > kMaxManifestBytes) throw InvalidInput(str(where, kManifest, " is unreadable or larger than 64 MiB"));
  std::string text(size, '\0');
  {
    std::ifstream in(mpath, std::ios::binary);
    if (!in.read(text.data(), static_cast<std::streamsize>(size))) throw IoError(str(where, "cannot read ", kManifest));
  }
  Manifest m = parse_manifest(text, where);
  for (const FileEntry& e : m.files) {
    const fs::path p = dir / e.name;
    if (!fs::is_regular_file(p, ec)) throw InvalidInput(str(where, e.name, " is missing"));
    const auto bytes = fs::file_size(p, ec);
    if (ec) throw IoError(str(where, "cannot stat ", e.name));
    if (bytes != e.bytes)
      throw InvalidInput(str(where, e.name, " has ", bytes, " bytes, the manifest says ", e.bytes,
                             bytes < e.bytes ? " (truncated)" : ""));
    const std::uint64_t actual = xxh64_of_file(p);
    if (actual != e.xxh64)
      throw InvalidInput(str(where, e.name, " is corrupted: its xxh64 is ", hex(actual), ", the manifest says ",
                             hex(e.xxh64)));
  }
  return m;
}

std::optional<fs::path> latest_complete(const fs::path& root) {
  const auto all = checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (complete(it->second)) return it->second;
  return std::nullopt;
}

std::vector<fs::path> prune(const fs::path& root, std::size_t keep, std::optional<std::uint64_t> written) {
  std::vector<fs::path> removed;
  const auto remove = [&](const fs::path& dir) {
    // The manifest first: a removal cut short leaves an interrupted write,
    // never a "complete" checkpoint with files missing.
    std::error_code ec;
    if (fs::remove(dir / kManifest, ec)) fsync_dir(dir);
    fs::remove_all(dir, ec);
    if (ec) throw IoError(str(dir.string(), ": cannot remove an old checkpoint: ", ec.message()));
    removed.push_back(dir);
  };
  auto all = checkpoints(root);
  if (written) {
    for (const auto& [step, dir] : all)
      if (step > *written) remove(dir);
    std::erase_if(all, [&](const auto& entry) { return entry.first > *written; });
  }
  std::vector<std::uint64_t> complete_steps;
  for (const auto& [step, dir] : all)
    if (complete(dir)) complete_steps.push_back(step);
  if (complete_steps.empty()) return removed;
  const std::uint64_t newest = complete_steps.back();
  const std::uint64_t oldest_kept =
      keep == 0 ? newest + 1 : complete_steps[complete_steps.size() - std::min(keep, complete_steps.size())];
  for (const auto& [step, dir] : all) {
    // Interrupted writes older than the newest complete checkpoint are
    // dead; one newer may be a write in progress.
    const bool stale = complete(dir) ? step < oldest_kept : step < newest;
    if (stale) remove(dir);
  }
  return removed;
}

}  // namespace distopt::checkpoint
