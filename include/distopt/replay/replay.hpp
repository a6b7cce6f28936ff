// Replay cases (format distopt-replay/1, docs/formats.md): an optimizer
// trajectory -- initial parameters, per-step gradients (or none) -- and,
// for golden files produced by PyTorch, the expected result. `distopt
// replay` runs them; `distopt replay --check` compares with `expected`.
#pragma once

#include "distopt/core/device.hpp"
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distopt/core/tensor.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/optim/options.hpp"
#include "distopt/optim/scheduler.hpp"

namespace distopt::replay {

struct GroupCase {
  std::vector<std::size_t> params;
  OptionMap options;
};

struct StepCase {
  std::vector<std::optional<std::vector<float>>> grads;  // nullopt: no gradient
  std::optional<double> metric;
};

struct Result {
  std::vector<std::vector<float>> params;
  std::vector<std::vector<double>> lr;  // lr[group][step]
};

struct Case {
  std::string source;  // file name, for messages
  std::string optimizer;
  OptionMap options;
  std::vector<GroupCase> groups;
  std::vector<Shape> shapes;
  std::vector<std::vector<float>> params;
  std::vector<StepCase> steps;
  std::optional<SchedulerSpec> scheduler;  // stepped after every optimizer step
  std::optional<Result> expected;
};

// Parses and validates a case; every inconsistency throws InvalidInput with
// a one-line message naming the file and the JSON member. Its "scheduler"
// is read as parse_scheduler_spec (distopt/optim/scheduler.hpp) reads one.
Case parse_case(const std::string& json_text, const std::string& source);
Case load_case(const std::string& path);

// Builds a case's scheduler (make_scheduler by default; tests pass their own
// to provide lambdalr/multiplicativelr with C++ callables).
using SchedulerFactory = std::function<std::unique_ptr<Scheduler>(Optimizer&, const SchedulerSpec&)>;

// Runs the optimizer (and the scheduler, if any) over the case's steps, with
// the parameters on `device` (docs/gpu.md).
Result run(const Case& c, ThreadPool* pool = nullptr, const SchedulerFactory& make = {}, Device device = Device::cpu);

struct Tolerance {
  double atol = 1e-6;
  double rtol = 1e-5;
};

struct Comparison {
  std::size_t compared = 0;
  std::size_t mismatches = 0;
  double max_abs_error = 0;
  std::string first_mismatch;  // empty when none
  bool ok() const { return mismatches == 0; }
};

// |ours - expected| <= atol + rtol*|expected| for every parameter element
// and every recorded lr.
Comparison compare(const Result& ours, const Result& expected, Tolerance tol = {});

// {"params": [[...]], "lr": [[...]]}, floats in shortest round-trip form.
std::string to_json(const Result& r);

}  // namespace distopt::replay
