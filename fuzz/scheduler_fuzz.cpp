// libFuzzer target: a --scheduler JSON spec, parsed and built on an
// optimizer of two groups, then stepped a few times (with a metric, for
// reducelronplateau). Only distopt::Error may escape as an answer.
#include <cstddef>
#include <cstdint>
#include <string>

#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/scheduler.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  float p[2] = {1, 2}, g[2] = {0.5f, -0.5f};
  try {
    const distopt::SchedulerSpec spec = distopt::parse_scheduler_spec(text, "--scheduler");
    std::vector<distopt::ParamGroupSpec> groups(2);
    groups[0].params.push_back({"a", {&p[0], distopt::DType::f32, {1}}, {&g[0], distopt::DType::f32, {1}}, true});
    groups[1].params.push_back({"b", {&p[1], distopt::DType::f32, {1}}, {&g[1], distopt::DType::f32, {1}}, true});
    distopt::Optimizer opt("sgd", std::move(groups), {{"lr", 0.1}, {"momentum", 0.9}});
    auto sched = distopt::make_scheduler(opt, spec);
    for (int k = 0; k < 8; ++k) {
      opt.step();
      if (sched->needs_metric())
        sched->step(1.0 / (k + 1));
      else
        sched->step();
    }
  } catch (const distopt::Error&) {
  }
  return 0;
}
