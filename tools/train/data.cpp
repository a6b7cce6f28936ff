// `distopt train`'s data: the data set a run asks for, its dimensions, and
// the --warmup-steps schedule that needs the run's length (args.hpp).
#include <algorithm>

#include "args.hpp"
#include "distopt/core/error.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"

namespace distopt::cli {

bool is_text(const std::string& data) {
  return data == "fortunes" || data == "text";
}

DataDims dims_of(const TrainArgs& a) {
  if (a.data == "synthetic-regression") return {32, 1};
  if (is_text(a.data)) return {a.config.gpt.context + 1, 256};
  return {784, 10};
}

data::Split load_data(const TrainArgs& a) {
  const DataDims dims = dims_of(a);
  if (a.data == "fashion-mnist")
    return data::load_fashion_mnist(a.data_dir.empty() ? data::default_fashion_mnist_dir() : a.data_dir);
  if (a.data == "fortunes")
    return data::text_split(data::load_fortunes(a.data_dir.empty() ? data::default_fortunes_dir() : a.data_dir),
                            a.config.gpt.context, a.config.seed, a.test_size);
  if (a.data == "text")
    return data::text_split(data::load_text_file(a.data_file), a.config.gpt.context, a.config.seed, a.test_size);
  if (a.data == "synthetic")
    return data::make_synthetic_classification(dims.features, dims.outputs, a.train_size, a.test_size, a.config.seed);
  if (a.data == "synthetic-regression")
    return data::make_synthetic_regression(dims.features, a.train_size, a.test_size, 0.1, a.config.seed);
  throw InvalidInput(
      str("unknown data set '", a.data, "' (known: fashion-mnist, synthetic, synthetic-regression, fortunes, text)"));
}

// --warmup-steps W: lr * (t + 1) / W for the first W steps (LinearLR from
// 1/W over W - 1 steps), then cosine decay to 0 over the rest of the run
// (CosineAnnealingLR), as SequentialLR -- what nanoGPT and most transformer
// recipes run. The run's length is known once the data is.
void warmup_cosine(TrainArgs& a, const data::Split& d) {
  if (a.warmup_steps == 0) return;
  const std::size_t per_epoch =
      data::BatchSampler(d.train.size(), a.config.batch_size, a.config.seed, a.config.drop_last).batches_per_epoch();
  std::size_t total = static_cast<std::size_t>(a.config.epochs) * per_epoch;
  if (a.config.max_steps > 0) total = std::min<std::size_t>(total, a.config.max_steps);
  if (a.warmup_steps >= total)
    throw InvalidInput(
        str("--warmup-steps ", a.warmup_steps, " leaves nothing of the run's ", total, " steps to decay over"));
  const auto w = static_cast<double>(a.warmup_steps);
  SchedulerSpec warm{
      "linearlr", {{"start_factor", 1.0 / w}, {"end_factor", 1.0}, {"total_iters", std::max(w - 1, 1.0)}}, {}};
  SchedulerSpec cosine{
      "cosineannealinglr", {{"T_max", static_cast<double>(total - a.warmup_steps)}, {"eta_min", 0.0}}, {}};
  a.config.scheduler = SchedulerSpec{"sequentiallr", {{"milestones", std::vector<double>{w}}}, {warm, cosine}};
  a.config.scheduler_per_epoch = false;
}

}  // namespace distopt::cli
