// The built-in datasets: Fashion-MNIST (read from Debian's
// dataset-fashion-mnist package) and deterministic synthetic ones.
#pragma once

#include <cstddef>
#include <cstdint>
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
  std::size_t size() const { return y.size(); }
  const float* sample(std::size_t i) const { return x.data() + i * features; }
};

struct Split {
  std::string name;
  Dataset train, test;
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

// Linear regression: y = w·x + b + noise·N(0, 1), x ~ N(0, 1).
Split make_synthetic_regression(std::size_t features, std::size_t train_size, std::size_t test_size,
                                double noise, std::uint64_t seed);

}  // namespace distopt::data
