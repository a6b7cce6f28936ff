// What the resume tests share (tests/resume_test.cpp, the strategies'
// checkpoints; tests/gossip_resume_test.cpp, the gossip strategies' and
// their survivors'): a small data set, the run's batches, and runs from a
// checkpoint's tensors.
#pragma once

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"

namespace distopt::resume_support {

using namespace distopt::checkpoint;

inline const data::Split& data_set() {
  static const data::Split d = data::make_synthetic_classification(20, 5, 200, 40, 3);
  return d;
}

// Steps from..from+steps-1 of the run's batches.
inline void train_steps(Communicator& comm, models::Model& model, parallel::Strategy& s, std::size_t from,
                        std::size_t steps) {
  const data::Split& d = data_set();
  data::BatchSampler sampler(d.train.size(), 32, 5, false);
  const std::size_t per_epoch = sampler.batches_per_epoch();
  std::vector<float> x, y;
  for (std::size_t k = from; k < from + steps; ++k) {
    sampler.set_epoch(k / per_epoch);
    const auto global = sampler.global_batch(k % per_epoch);
    const auto local = sampler.local_batch(k % per_epoch, comm.rank(), comm.size());
    x.clear();
    y.clear();
    for (std::uint32_t i : local) {
      x.insert(x.end(), d.train.sample(i), d.train.sample(i) + d.train.features);
      y.push_back(d.train.y[i]);
    }
    model.forward_backward(s.access(), x.data(), y.data(), local.size(), 1.0f / float(global.size()));
    s.step();
  }
}

struct RunResult {
  std::vector<float> params;              // gathered, slot order
  std::vector<checkpoint::Piece> pieces;  // every rank's, at the end
};

// The unsharded parameters of a checkpoint's tensors.
inline std::vector<float> initial_of(const parallel::FlatLayout& flat, const TensorSource& saved) {
  const parallel::InitialParams initial = initial_params(flat, saved);
  std::vector<float> out(initial.size());
  initial.read(0, out);
  return out;
}

// `steps` steps from global step `from` at `world` ranks, from a
// checkpoint's tensors or from the model's initialization.
inline RunResult run_from(int world, const std::string& strategy, const parallel::OptimizerSpec& spec, std::size_t from,
                          std::size_t steps, const TensorSource* resume, DType dtype = DType::f32,
                          const std::vector<std::size_t>& hidden = {24, 40, 8}) {
  const data::Split& d = data_set();
  RunResult out;
  std::mutex m;
  spawn(world, [&](Communicator& comm) {
    auto model = models::make_model("mlp", d.train.features, d.train.classes, hidden);
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    std::vector<float> initial(flat.elements);
    if (resume == nullptr) model->init(initial, 5);
    parallel::StrategyOptions options;
    options.bucket_elements = 300;
    options.param_dtype = dtype;
    auto s = resume != nullptr
                 ? parallel::make_strategy(strategy, comm, flat, initial_params(flat, *resume), spec, options)
                 : parallel::make_strategy(strategy, comm, flat, initial, spec, options);
    if (resume != nullptr) load_optimizer_state(*s, *resume);
    train_steps(comm, *model, *s, from, steps);
    std::vector<float> params = s->gather_params();
    std::vector<checkpoint::Piece> mine = strategy_pieces(*s, comm.rank()).copies();
    std::lock_guard lock(m);
    if (comm.rank() == 0) out.params = std::move(params);
    out.pieces.insert(out.pieces.end(), mine.begin(), mine.end());
  });
  return out;
}

inline RunResult run(int world, const std::string& strategy, const parallel::OptimizerSpec& spec, std::size_t from,
                     std::size_t steps, const std::map<std::string, Whole>* resume, DType dtype = DType::f32,
                     const std::vector<std::size_t>& hidden = {24, 40, 8}) {
  if (resume == nullptr) return run_from(world, strategy, spec, from, steps, nullptr, dtype, hidden);
  const WholeTensors saved(*resume);
  return run_from(world, strategy, spec, from, steps, &saved, dtype, hidden);
}

inline parallel::OptimizerSpec spec_of(const std::string& rule) {
  parallel::OptimizerSpec spec{rule, {}};
  if (rule == "lamb") spec.options = {{"lr", 3e-3}};
  if (rule == "muon") spec.options = {{"lr", 0.02}};
  if (rule == "shampoo") spec.options = {{"lr", 0.02}, {"momentum", 0.9}, {"update_freq", 3}};
  if (rule == "sgd") spec.options = {{"lr", 0.05}, {"momentum", 0.9}};
  spec.fallback = std::string(find_rule(rule)->companion);
  return spec;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace distopt::resume_support
