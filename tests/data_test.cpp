// Datasets and sampling: the IDX reader on files the test writes, the
// Fashion-MNIST loader's errors, synthetic data and the distributed sampler.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "distopt/core/error.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"

using namespace distopt;
using namespace distopt::data;

namespace {

class TempDir {
 public:
  TempDir() : path_(std::filesystem::temp_directory_path() / ("distopt_data_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

std::vector<unsigned char> idx_bytes(std::vector<std::uint32_t> dims, const std::vector<unsigned char>& data,
                                     unsigned char type = 0x08) {
  std::vector<unsigned char> b{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims)
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(d >> s));
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
}

void write_raw(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A tiny Fashion-MNIST-shaped folder: n images of 28×28 and n labels.
void write_fake_fmnist(const TempDir& dir, std::size_t n_train, std::size_t n_test) {
  for (auto [prefix, n] : {std::pair{"train", n_train}, std::pair{"t10k", n_test}}) {
    std::vector<unsigned char> pixels(n * 784), labels(n);
    for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<unsigned char>(i * 7);
    for (std::size_t i = 0; i < n; ++i) labels[i] = static_cast<unsigned char>(i % 10);
    write_gz(dir.file(std::string(prefix) + "-images-idx3-ubyte.gz"),
             idx_bytes({static_cast<std::uint32_t>(n), 28, 28}, pixels));
    write_gz(dir.file(std::string(prefix) + "-labels-idx1-ubyte.gz"), idx_bytes({static_cast<std::uint32_t>(n)}, labels));
  }
}

}  // namespace

TEST(Idx, ReadsGzippedAndPlainFiles) {
  TempDir dir;
  const std::vector<unsigned char> data{1, 2, 3, 4, 5, 6};
  write_gz(dir.file("a.gz"), idx_bytes({2, 3}, data));
  write_raw(dir.file("a.idx"), idx_bytes({2, 3}, data));
  for (const auto* name : {"a.gz", "a.idx"}) {
    const IdxArray a = read_idx(dir.file(name));
    EXPECT_EQ(a.dims, (std::vector<std::uint32_t>{2, 3})) << name;
    EXPECT_EQ(a.data, data) << name;
  }
}

TEST(Idx, MalformedFilesGetErrorsNamingTheProblem) {
  TempDir dir;
  write_gz(dir.file("magic.gz"), {1, 2, 8, 1, 0, 0, 0, 1, 9});
  EXPECT_NE(error_of([&] { read_idx(dir.file("magic.gz")); }).find("wrong IDX magic"), std::string::npos);
  write_gz(dir.file("type.gz"), idx_bytes({1}, {9}, 0x0d));
  EXPECT_NE(error_of([&] { read_idx(dir.file("type.gz")); }).find("element type"), std::string::npos);
  auto truncated = idx_bytes({10, 28, 28}, std::vector<unsigned char>(7839));
  write_gz(dir.file("short.gz"), truncated);
  EXPECT_NE(error_of([&] { read_idx(dir.file("short.gz")); }).find("truncated: header promises 7840 bytes"),
            std::string::npos);
  write_gz(dir.file("long.gz"), idx_bytes({2}, {1, 2, 3}));
  EXPECT_NE(error_of([&] { read_idx(dir.file("long.gz")); }).find("beyond"), std::string::npos);
  write_gz(dir.file("header.gz"), {0, 0, 8});
  EXPECT_NE(error_of([&] { read_idx(dir.file("header.gz")); }).find("truncated IDX header"), std::string::npos);
  // A gzip stream cut in the middle.
  write_gz(dir.file("whole.gz"), idx_bytes({4096}, std::vector<unsigned char>(4096, 3)));
  std::filesystem::resize_file(dir.file("whole.gz"), std::filesystem::file_size(dir.file("whole.gz")) / 2);
  const std::string cut = error_of([&] { read_idx(dir.file("whole.gz")); });
  EXPECT_TRUE(cut.find("truncated") != std::string::npos || cut.find("gzip") != std::string::npos) << cut;
  EXPECT_NE(error_of([&] { read_idx(dir.file("absent.gz")); }).find("cannot open"), std::string::npos);
}

TEST(FashionMnist, LoadsScaledPixelsAndLabels) {
  TempDir dir;
  write_fake_fmnist(dir, 20, 5);
  const Split s = load_fashion_mnist(dir.file(""));
  EXPECT_EQ(s.train.size(), 20u);
  EXPECT_EQ(s.test.size(), 5u);
  EXPECT_EQ(s.train.features, 784u);
  EXPECT_EQ(s.train.classes, 10u);
  EXPECT_FLOAT_EQ(s.train.x[1], 7.0f / 255.0f);
  EXPECT_EQ(s.train.y[13], 3.0f);
}

TEST(FashionMnist, MissingFilesNameTheDebianPackage) {
  TempDir dir;
  const std::string e = error_of([&] { load_fashion_mnist(dir.file("nothing-here")); });
  EXPECT_NE(e.find("apt-get install dataset-fashion-mnist"), std::string::npos) << e;
}

TEST(FashionMnist, MismatchedCountsAndBadLabelsAreRejected) {
  TempDir dir;
  write_fake_fmnist(dir, 20, 5);
  write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_bytes({19}, std::vector<unsigned char>(19, 1)));
  EXPECT_NE(error_of([&] { load_fashion_mnist(dir.file("")); }).find("19 labels for 20 images"), std::string::npos);
  std::vector<unsigned char> labels(20, 1);
  labels[4] = 10;
  write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_bytes({20}, labels));
  EXPECT_NE(error_of([&] { load_fashion_mnist(dir.file("")); }).find("label 10 at index 4"), std::string::npos);
}

// The real files, when Debian's package is installed (CI installs it).
TEST(FashionMnist, RealFilesHaveTheDocumentedShape) {
  const std::string dir = default_fashion_mnist_dir();
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  const Split s = load_fashion_mnist(dir);
  EXPECT_EQ(s.train.size(), 60000u);
  EXPECT_EQ(s.test.size(), 10000u);
  std::vector<int> per_class(10);
  for (float y : s.test.y) ++per_class[static_cast<int>(y)];
  for (int c : per_class) EXPECT_EQ(c, 1000);  // the test set is balanced
}

TEST(Synthetic, DeterministicBySeedAndUsesEveryClass) {
  const Split a = make_synthetic_classification(20, 4, 500, 100, 7), b = make_synthetic_classification(20, 4, 500, 100, 7);
  const Split c = make_synthetic_classification(20, 4, 500, 100, 8);
  EXPECT_EQ(a.train.x, b.train.x);
  EXPECT_EQ(a.train.y, b.train.y);
  EXPECT_NE(a.train.x, c.train.x);
  std::set<float> classes(a.train.y.begin(), a.train.y.end());
  EXPECT_EQ(classes.size(), 4u);
  const Split r = make_synthetic_regression(5, 300, 50, 0.0, 3);
  EXPECT_EQ(r.train.classes, 0u);
  EXPECT_EQ(r.train.size(), 300u);
}

TEST(Sampler, RanksGetDisjointPiecesCoveringEveryBatch) {
  for (int world : {1, 2, 3, 4, 7}) {
    BatchSampler s(1000, 64, 5);
    s.set_epoch(2);
    std::multiset<std::uint32_t> seen;
    for (std::size_t k = 0; k < s.batches_per_epoch(); ++k) {
      std::multiset<std::uint32_t> batch;
      for (int r = 0; r < world; ++r)
        for (auto i : s.local_batch(k, r, world)) batch.insert(i);
      const auto g = s.global_batch(k);
      EXPECT_EQ(batch, std::multiset<std::uint32_t>(g.begin(), g.end())) << "world " << world << " batch " << k;
      seen.insert(batch.begin(), batch.end());
    }
    EXPECT_EQ(seen.size(), 1000u);
    EXPECT_EQ(std::set<std::uint32_t>(seen.begin(), seen.end()).size(), 1000u) << "every sample exactly once";
  }
}

TEST(Sampler, ShufflingDependsOnSeedAndEpochOnly) {
  BatchSampler a(500, 32, 11), b(500, 100, 11), c(500, 32, 12);
  a.set_epoch(3);
  b.set_epoch(3);
  c.set_epoch(3);
  // The epoch's order is the same whatever the batch size (and so the world size).
  std::vector<std::uint32_t> oa, ob;
  for (std::size_t k = 0; k < a.batches_per_epoch(); ++k) oa.insert(oa.end(), a.global_batch(k).begin(), a.global_batch(k).end());
  for (std::size_t k = 0; k < b.batches_per_epoch(); ++k) ob.insert(ob.end(), b.global_batch(k).begin(), b.global_batch(k).end());
  EXPECT_EQ(oa, ob);
  const auto a0 = a.global_batch(0);
  const auto c0 = c.global_batch(0);
  EXPECT_FALSE(std::equal(a0.begin(), a0.end(), c0.begin()));
  std::vector<std::uint32_t> e3(a0.begin(), a0.end());
  a.set_epoch(4);
  EXPECT_FALSE(std::equal(e3.begin(), e3.end(), a.global_batch(0).begin()));
  a.set_epoch(3);
  EXPECT_TRUE(std::equal(e3.begin(), e3.end(), a.global_batch(0).begin()));
}

TEST(Sampler, LastPartialBatchIsKeptOrDropped) {
  BatchSampler keep(10, 4, 1), drop(10, 4, 1, /*drop_last=*/true);
  EXPECT_EQ(keep.batches_per_epoch(), 3u);
  EXPECT_EQ(keep.global_batch(2).size(), 2u);
  EXPECT_EQ(drop.batches_per_epoch(), 2u);
  // The partial batch of 2 over 3 ranks: one rank gets nothing.
  EXPECT_EQ(keep.local_batch(2, 0, 3).size(), 1u);
  EXPECT_EQ(keep.local_batch(2, 2, 3).size(), 0u);
}
