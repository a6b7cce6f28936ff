// Crash-safe checkpoint directories: the storage layer under distopt's
// checkpoints (docs/formats.md, "Checkpoint directories").
//
// A checkpoint is a directory ROOT/step-<12 digits>/ holding the ranks'
// files and manifest.json. Every file is written to a temporary name,
// fsynced, renamed into place, and the directory fsynced; the manifest --
// listing every file with its size and xxh64 checksum -- is written last,
// so a directory without a valid manifest is an interrupted write and is
// ignored. Readers verify sizes and checksums before using anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace distopt::checkpoint {

inline constexpr int kFormatVersion = 1;

struct FileEntry {
  std::string name;  // relative to the checkpoint directory, no '/'
  std::uint64_t bytes = 0;
  std::uint64_t xxh64 = 0;
};

struct Manifest {
  int version = kFormatVersion;
  std::uint64_t step = 0;
  std::string body = "{}";  // the caller's JSON object (layout, run configuration, ...)
  std::vector<FileEntry> files;
};

// The directory of the checkpoint at `step` under `root`.
std::filesystem::path checkpoint_dir(const std::filesystem::path& root, std::uint64_t step);

// xxh64 (seed 0) of bytes, and of a file's contents.
std::uint64_t xxh64(std::span<const std::byte> bytes);
std::uint64_t xxh64_of_file(const std::filesystem::path& path);

// A file of a checkpoint written piece by piece, durably and atomically
// (see above): under a temporary name, hashed as it goes, put in place by
// commit(). A writer destroyed uncommitted removes its temporary file.
// IoError names the file (disk full, permissions).
class FileWriter {
 public:
  FileWriter(const std::filesystem::path& dir, const std::string& name);
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  ~FileWriter();
  void write(std::span<const std::byte> bytes);
  // Syncs the file, renames it into place, syncs the directory.
  FileEntry commit();

 private:
  void write_all(std::span<const std::byte> bytes);
  void flush();
  [[noreturn]] void fail(const std::string& why);
  std::filesystem::path dir_, target_, tmp_;
  std::string name_;
  int fd_ = -1;
  void* hash_ = nullptr;  // XXH64_state_t
  std::vector<std::byte> staged_;  // small writes, gathered into larger ones
  std::uint64_t written_ = 0;      // on disk (staged_ follows)
};

// Writes `bytes` to dir/name (a FileWriter's one write) and returns its entry.
FileEntry write_file(const std::filesystem::path& dir, const std::string& name, std::span<const std::byte> bytes);

// Writes dir/manifest.json, last: the checkpoint is complete once it exists.
void write_manifest(const std::filesystem::path& dir, const Manifest& manifest);

// A manifest's text (`where` prefixes the errors): format, version, step and
// the file entries, not yet checked against the files.
Manifest parse_manifest(const std::string& text, const std::string& where);

// Reads dir/manifest.json and checks every file it lists (present, of its
// size, of its checksum). InvalidInput names the file and what is wrong: a
// missing or malformed manifest, a newer format version, a missing,
// truncated or corrupted file.
Manifest verify(const std::filesystem::path& dir);

// The newest complete checkpoint under root (by step), skipping directories
// without a manifest (interrupted writes); nullopt when there is none. It
// is not verified here: a corrupted file is an error when it is loaded
// (verify), not a reason to fall back silently to an older checkpoint.
std::optional<std::filesystem::path> latest_complete(const std::filesystem::path& root);

// Keeps the newest `keep` complete checkpoints under root and removes the
// older ones, and interrupted writes older than the newest complete one.
// With `written` (the step a run has just written), every checkpoint of a
// later step goes first: another run's in the same directory, or one from
// before survivors went back; the newest is then always the run's last.
// Returns the directories removed.
std::vector<std::filesystem::path> prune(const std::filesystem::path& root, std::size_t keep,
                                         std::optional<std::uint64_t> written = std::nullopt);

}  // namespace distopt::checkpoint
