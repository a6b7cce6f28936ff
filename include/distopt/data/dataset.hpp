// The built-in datasets: Fashion-MNIST (read from Debian's
// dataset-fashion-mnist package) and deterministic synthetic ones.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace distopt::data {

// Samples in memory: x is samples × features (row-major, float32), y holds
// one value per sample: the class index (classification) or the target
// (regression, classes == 0).
struct Dataset {
  std::size_t features = 0;
  std::size_t classes = 0;
  std::vector<float> x;
  std::vector<float> y;
  // Samples made on demand instead of stored in x (text windows drawn per
  // epoch): writes sample i of epoch `epoch` (features floats) to `out`.
  std::function<void(std::uint64_t epoch, std::size_t i, float* out)> make;
  std::size_t make_bytes = 0;  // what `make` holds (the text it draws from)
  std::size_t size() const { return y.size(); }
  // Memory the set holds: its arrays and what `make` holds.
  std::size_t bytes() const { return (x.capacity() + y.capacity()) * sizeof(float) + make_bytes; }
  const float* sample(std::size_t i) const { return x.data() + i * features; }
  // Sample i of an epoch, stored or made.
  void fill(std::uint64_t epoch, std::size_t i, float* out) const {
    if (make) make(epoch, i, out);
    else std::copy(sample(i), sample(i) + features, out);
  }
};

struct Split {
  std::string name;
  Dataset train, test;
  std::size_t bytes() const { return train.bytes() + test.bytes(); }
};

// An IDX array (the MNIST file format): big-endian dims and unsigned bytes.
struct IdxArray {
  std::vector<std::uint32_t> dims;
  std::vector<std::uint8_t> data;
};

// Reads an IDX file of unsigned bytes, gzipped or not. Throws IoError when
// the file is missing or unreadable and InvalidInput when it is malformed
// (wrong magic, wrong type, counts that disagree with its length).
IdxArray read_idx(const std::string& path);

// Where Fashion-MNIST is read from: $DISTOPT_FASHION_MNIST_DIR when set,
// else the folder Debian's dataset-fashion-mnist package installs.
std::string default_fashion_mnist_dir();

// The 60,000 training and 10,000 test images, pixels scaled to [0, 1]
// (as torchvision's ToTensor), labels 0..9. Validates that image and label
// files agree (counts, 28×28, labels < 10).
Split load_fashion_mnist(const std::string& dir);

// Classification with a teacher: inputs are uniform in [0, 1) and the label
// is the argmax of a fixed random 2-layer ReLU network of the input.
Split make_synthetic_classification(std::size_t features, std::size_t classes, std::size_t train_size,
                                    std::size_t test_size, std::uint64_t seed);

// Byte-level text for model "gpt": a corpus's bytes, the last 10% held out
// for validation.
struct Text {
  std::string source;  // what was read, for messages
  std::vector<std::uint8_t> train, val;
};
// Where --data fortunes is read from: $DISTOPT_FORTUNES_DIR when set, else
// the folder Debian's fortunes package installs.
std::string default_fortunes_dir();
// The plain-text fortune files of `dir` (no .dat index, no .u8 link),
// concatenated in sorted file order. Throws IoError naming the fortunes
// package when the folder is missing or holds none.
Text load_fortunes(const std::string& dir);
// A user's text file; IoError when unreadable, InvalidInput when empty.
Text load_text_file(const std::string& path);
// Samples of context + 1 tokens (as floats; classes 256): training sample
// i of epoch e is the window at a position drawn from (seed, e, i), and an
// epoch has train bytes / context of them; the validation windows are
// consecutive and disjoint, at most `max_val` of them (0: all).
// InvalidInput when a part holds fewer than context + 1 bytes.
Split text_split(Text text, std::size_t context, std::uint64_t seed, std::size_t max_val = 0);

// Linear regression: y = w·x + b + noise·N(0, 1), x ~ N(0, 1).
Split make_synthetic_regression(std::size_t features, std::size_t train_size, std::size_t test_size,
                                double noise, std::uint64_t seed);

}  // namespace distopt::data
