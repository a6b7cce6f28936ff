// Named tensors a run loads from, read a range at a time: whole tensors in
// memory (a state kept in memory, a dict from Python), or the pieces of a
// checkpoint's rank files, read from disk only where a rank needs them --
// a resume never holds a whole copy of what was saved.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/store.hpp"

namespace distopt::checkpoint {

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // Every tensor's name, sorted.
  virtual std::vector<std::string> names() const = 0;
  // A tensor's shape; null when there is no such tensor.
  virtual const Shape* shape(const std::string& name) const = 0;
  // Elements [begin, begin + out.size()) of tensor `name` (row-major).
  // PreconditionError for a range outside it or a tensor there is not.
  virtual void read(const std::string& name, std::uint64_t begin, std::span<float> out) const = 0;
  // The whole tensor.
  std::vector<float> whole(const std::string& name) const;
  // The names that start with `prefix`, sorted.
  std::vector<std::string> names_under(const std::string& prefix) const;
};

// Whole tensors in memory, viewed: `wholes` must outlive the view.
class WholeTensors final : public TensorSource {
 public:
  explicit WholeTensors(const std::map<std::string, Whole>& wholes) : wholes_(wholes) {}
  std::vector<std::string> names() const override;
  const Shape* shape(const std::string& name) const override;
  void read(const std::string& name, std::uint64_t begin, std::span<float> out) const override;

 private:
  const std::map<std::string, Whole>& wholes_;
};

// The pieces in the rank files of a checkpoint. Made from the files'
// headers alone: each tensor's pieces must agree on its shape and cover
// every element (InvalidInput names the tensor and the gap), with sizes
// checked against the files. Values are read when asked for, with pread
// (safe from several threads at once); where files hold an element twice
// (small state every rank saves whole), each copy read must have the same
// bits (InvalidInput). IoError when a file cannot be opened or read.
class PieceFiles final : public TensorSource {
 public:
  explicit PieceFiles(std::vector<std::string> paths);
  // The files a manifest of `dir` lists (verify the manifest first: their
  // sizes and checksums are not checked here).
  PieceFiles(const std::filesystem::path& dir, const Manifest& manifest);
  PieceFiles(const PieceFiles&) = delete;
  PieceFiles& operator=(const PieceFiles&) = delete;
  ~PieceFiles() override;
  std::vector<std::string> names() const override;
  const Shape* shape(const std::string& name) const override;
  void read(const std::string& name, std::uint64_t begin, std::span<float> out) const override;

 private:
  struct Ref {
    std::size_t file;
    std::uint64_t begin, count;  // elements of the whole tensor
    std::uint64_t at;            // the first byte of its values in the file
  };
  struct Tensor {
    Shape shape;
    std::vector<Ref> pieces;  // by their first element
  };
  void read_piece(const Ref& ref, std::uint64_t begin, std::span<float> out) const;
  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::map<std::string, Tensor> tensors_;
};

}  // namespace distopt::checkpoint
