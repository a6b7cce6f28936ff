// Trains distopt's MLP with ZeRO-3 on 4 ranks (threads of this process)
// through the C++ API, the way the README shows it: a model, a strategy per
// rank, and a loop of forward/backward and step. Synthetic data (a random
// teacher network labels uniform inputs), so it needs no data set.
//
// Prints one line: {"test_accuracy": ..., "param_hash": ..., "version": ...}
// and exits 0 when the model learned (accuracy well above chance).
#include <cstdio>
#include <mutex>
#include <vector>

#include "distopt/comm/threads.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/parallel/strategy.hpp"
#include "distopt/train/trainer.hpp"
#include "distopt/version.hpp"

int main() {
  constexpr int kWorld = 4;
  constexpr std::size_t kBatch = 64, kFeatures = 784, kClasses = 10;
  const distopt::data::Split data = distopt::data::make_synthetic_classification(kFeatures, kClasses, 8192, 1024, 7);

  double accuracy = 0;
  std::string hash;
  std::mutex m;
  distopt::spawn(kWorld, [&](distopt::Communicator& comm) {
    auto model = distopt::models::make_model("mlp", kFeatures, kClasses);
    const auto layout = distopt::parallel::flat_layout(*model);
    std::vector<float> init(layout.elements);
    model->init(init, /*seed=*/0);
    auto zero3 = distopt::parallel::make_strategy("zero3", comm, layout, init, {"adamw", {{"lr", 1e-3}}});

    distopt::data::BatchSampler sampler(data.train.size(), kBatch, /*seed=*/0, /*drop_last=*/true);
    std::vector<float> x(kBatch * kFeatures), y(kBatch);
    for (int epoch = 0; epoch < 3; ++epoch) {
      sampler.set_epoch(static_cast<std::uint64_t>(epoch));
      for (std::size_t k = 0; k < sampler.batches_per_epoch(); ++k) {
        // This rank's piece of global batch k, its loss scaled by 1 / global batch.
        const auto local = sampler.local_batch(k, comm.rank(), comm.size());
        for (std::size_t i = 0; i < local.size(); ++i) {
          const float* sample = data.train.sample(local[i]);
          std::copy(sample, sample + kFeatures, x.begin() + static_cast<std::ptrdiff_t>(i * kFeatures));
          y[i] = data.train.y[local[i]];
        }
        model->forward_backward(zero3->access(), x.data(), y.data(), local.size(), 1.0f / kBatch);
        zero3->step();  // reduce-scatter the gradient, step this rank's shard
      }
    }
    // Every rank evaluates its piece of the test set, unit by unit.
    const distopt::Piece piece = distopt::piece_of(data.test.size(), comm.size(), comm.rank());
    const auto s = model->evaluate(zero3->access(), data.test.sample(piece.offset), data.test.y.data() + piece.offset,
                                   piece.count);
    double sums[2] = {s.correct, s.count};
    comm.all_reduce(sums, sums, 2, distopt::ElemType::f64, distopt::ReduceOp::sum);
    const std::string h = distopt::train::hash_params(zero3->gather_params());  // unsharded parameters
    std::lock_guard lock(m);
    if (comm.rank() == 0) accuracy = sums[0] / sums[1], hash = h;
  });
  std::printf("{\"test_accuracy\": %.4f, \"param_hash\": \"%s\", \"version\": \"%s\"}\n", accuracy, hash.c_str(),
              DISTOPT_VERSION_STRING);
  return accuracy > 0.35 ? 0 : 1;  // chance is 0.1; about 0.45 after these 3 epochs
}
