#include <cstdlib>
#include <filesystem>

#include "distopt/core/error.hpp"
#include "distopt/data/dataset.hpp"

namespace distopt::data {

std::string default_fashion_mnist_dir() {
  if (const char* env = std::getenv("DISTOPT_FASHION_MNIST_DIR"); env && *env) return env;
  return "/usr/share/datasets/fashion-mnist";
}

namespace {

Dataset load_part(const std::string& dir, const char* images_name, const char* labels_name) {
  const std::string images_path = dir + "/" + images_name, labels_path = dir + "/" + labels_name;
  for (const auto& p : {images_path, labels_path})
    if (!std::filesystem::exists(p))
      throw IoError(str("Fashion-MNIST file ", p,
                        " not found: install Debian's package (apt-get install dataset-fashion-mnist) or set "
                        "--data-dir / DISTOPT_FASHION_MNIST_DIR"));
  const IdxArray images = read_idx(images_path), labels = read_idx(labels_path);
  if (images.dims.size() != 3 || images.dims[1] != 28 || images.dims[2] != 28)
    throw InvalidInput(str(images_path, ": expected N×28×28 images"));
  if (labels.dims.size() != 1) throw InvalidInput(str(labels_path, ": expected a 1-dimensional label array"));
  if (labels.dims[0] != images.dims[0])
    throw InvalidInput(str(labels_path, ": ", labels.dims[0], " labels for ", images.dims[0], " images in ",
                           images_path));
  Dataset d;
  d.features = 28 * 28;
  d.classes = 10;
  d.x.resize(images.data.size());
  for (std::size_t i = 0; i < images.data.size(); ++i) d.x[i] = static_cast<float>(images.data[i]) / 255.0f;
  d.y.resize(labels.data.size());
  for (std::size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] >= 10) throw InvalidInput(str(labels_path, ": label ", int(labels.data[i]), " at index ", i, " is not in 0..9"));
    d.y[i] = static_cast<float>(labels.data[i]);
  }
  return d;
}

}  // namespace

Split load_fashion_mnist(const std::string& dir) {
  Split s;
  s.name = "fashion-mnist";
  s.train = load_part(dir, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz");
  s.test = load_part(dir, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz");
  return s;
}

}  // namespace distopt::data
