// Optimizer step throughput against a roofline measured in the same run.
//
// For each rule the roofline is a plain in-place streaming loop over as many
// arrays as the rule's step touches -- it reads the parameter, the gradient
// and every state tensor, and writes the parameter and every state tensor
// (Adam: 4 read, 3 written; SGD with momentum: 3 read, 2 written) -- over
// buffers allocated exactly like the optimizer's. Bytes moved are the same
// for both, so fraction = rule GB/s / roofline GB/s. Measurements alternate
// (roofline, rule, roofline, rule, ...) and report medians, which keeps slow
// drifts of a shared machine out of the ratio.
//
// On a CUDA device (--device cuda, docs/gpu.md) the roofline is a
// device-to-device copy measured in the same run (the figure torch's fused
// optimizers are compared with), and the cases are 256M, 100x10M and
// 1000x256K elements; --dtype bf16/f16 gives the parameters and gradients
// that type (fp32 master weights and state).
#include "distopt/bench/optim_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "distopt/core/buffer.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/optim/optimizer.hpp"

namespace distopt::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct RuleCase {
  std::string label;  // "adam", "sgd-momentum"
  std::string rule;
  OptionMap options;
};

const std::vector<RuleCase>& rule_cases() {
  static const std::vector<RuleCase> cases = {
      {"sgd-momentum", "sgd", {{"lr", 0.01}, {"momentum", 0.9}}},
      {"adam", "adam", {}},
      {"adamw", "adamw", {}},
      {"sgd", "sgd", {{"lr", 0.01}}},
      {"adamax", "adamax", {}},
      {"adadelta", "adadelta", {}},
      {"adagrad", "adagrad", {}},
      {"rmsprop", "rmsprop", {}},
      {"nadam", "nadam", {}},
      {"radam", "radam", {}},
      {"rprop", "rprop", {}},
      {"asgd", "asgd", {}},
      {"lion", "lion", {}},
  };
  return cases;
}

// Rules with quantized state (docs/optimizers.md, "Quantized state"), by
// name only: their GB/s count the fp32 state's bytes (what an fp32 step
// moves), so against the f32 rule of the same run the ratio is the speed-up.
const std::vector<RuleCase>& quantized_cases() {
  static const std::vector<RuleCase> cases = {
      {"adamw-bf16", "adamw", {{"state_dtype", "bf16"}}},
      {"adamw-int8", "adamw", {{"state_dtype", "int8"}}},
      {"adamw-int4", "adamw", {{"state_dtype", "int4"}}},
      {"sgd-momentum-int8", "sgd", {{"lr", 0.01}, {"momentum", 0.9}, {"state_dtype", "int8"}}},
      {"lion-int8", "lion", {{"state_dtype", "int8"}}},
  };
  return cases;
}

struct Shape2 {
  std::string label;
  std::size_t tensors, elements;
};

Shape2 parse_case(const std::string& s) {
  if (s == "16M") return {s, 1, std::size_t{16} << 20};
  if (s == "1000x16K") return {s, 1000, std::size_t{16} << 10};
  if (s == "256M") return {s, 1, std::size_t{256} << 20};
  if (s == "100x10M") return {s, 100, std::size_t{10} << 20};
  if (s == "1000x256K") return {s, 1000, std::size_t{256} << 10};
  throw InvalidInput(str("unknown benchmark case '", s, "' (known: 16M, 1000x16K; on cuda 256M, 100x10M, 1000x256K)"));
}

// The streaming roofline over R arrays: array 0 (the parameter) and arrays
// 2.. (state) are read and written, array 1 (the gradient) is only read.
template <int R>
void stream(float* const* a, std::size_t n) {
  float* __restrict a0 = a[0];
  const float* __restrict a1 = a[1];
  float* __restrict a2 = R > 2 ? a[2] : nullptr;
  float* __restrict a3 = R > 3 ? a[3] : nullptr;
  float* __restrict a4 = R > 4 ? a[4] : nullptr;
  float* __restrict a5 = R > 5 ? a[5] : nullptr;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = a1[i];
    if constexpr (R > 2) a2[i] = a2[i] * 0.5f + g;
    if constexpr (R > 3) a3[i] = a3[i] * 0.5f + g;
    if constexpr (R > 4) a4[i] = a4[i] * 0.5f + g;
    if constexpr (R > 5) a5[i] = a5[i] * 0.5f + g;
    a0[i] = a0[i] * 0.5f + g;
  }
}

void stream_any(int reads, float* const* a, std::size_t n) {
  switch (reads) {
    case 2: return stream<2>(a, n);
    case 3: return stream<3>(a, n);
    case 4: return stream<4>(a, n);
    case 5: return stream<5>(a, n);
    case 6: return stream<6>(a, n);
  }
  DISTOPT_CHECK(false, "unsupported stream width ", reads);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Fills with small values that keep every rule finite for many steps.
void fill(float* p, std::size_t n, float base) {
  for (std::size_t i = 0; i < n; ++i) p[i] = base + 1e-3f * static_cast<float>(i % 97);
}

struct Measurement {
  std::string rule, kase;
  int threads;
  double gbps, roofline_gbps;
  double step_s = 0;  // the rule's median step
};

Measurement measure(const RuleCase& rc, const Shape2& shape, int threads, int repeats) {
  ThreadPool pool(threads);
  const std::size_t total = shape.tensors * shape.elements;
  // Parameters and gradients: two flat buffers, as a model holds them.
  Buffer params(total * sizeof(float), 0), grads(total * sizeof(float), 1);
  fill(params.as<float>(), total, 0.5f);
  fill(grads.as<float>(), total, 0.01f);
  std::vector<Param> list(shape.tensors);
  for (std::size_t t = 0; t < shape.tensors; ++t) {
    list[t].value = {params.as<float>() + t * shape.elements, DType::f32, {static_cast<std::int64_t>(shape.elements)}};
    list[t].grad = {grads.as<float>() + t * shape.elements, DType::f32, {static_cast<std::int64_t>(shape.elements)}};
    list[t].has_grad = true;
  }
  OptimizerConfig config;
  config.pool = &pool;
  Optimizer opt(rc.rule, std::move(list), rc.options, config);
  opt.step();  // creates the state
  const StateLayout layout = opt.rule().layout(opt.group(0).options);
  const int state_arrays = static_cast<int>(layout.tensors.size());
  const int reads = 2 + state_arrays, writes = 1 + state_arrays;
  const double bytes = static_cast<double>(total) * sizeof(float) * (reads + writes);

  // Roofline arrays: the same parameter and gradient buffers, and state
  // buffers allocated as the optimizer allocates its own.
  std::vector<Buffer> extra;
  std::vector<std::vector<float*>> arrays(shape.tensors);
  for (std::size_t t = 0; t < shape.tensors; ++t) {
    arrays[t] = {params.as<float>() + t * shape.elements, grads.as<float>() + t * shape.elements};
    for (int k = 0; k < state_arrays; ++k) {
      extra.emplace_back(shape.elements * sizeof(float), 3 + k);
      fill(extra.back().as<float>(), shape.elements, 0.1f);
      arrays[t].push_back(extra.back().as<float>());
    }
  }
  const std::size_t chunk = config.chunk_elements;
  struct Item {
    std::size_t t, b, e;
  };
  std::vector<Item> items;
  for (std::size_t t = 0; t < shape.tensors; ++t)
    for (std::size_t b = 0; b < shape.elements; b += chunk) items.push_back({t, b, std::min(shape.elements, b + chunk)});
  auto roofline_step = [&] {
    pool.parallel_for(items.size(), [&](std::size_t k) {
      const Item& it = items[k];
      float* a[6];
      for (int j = 0; j < reads; ++j) a[j] = arrays[it.t][j] + it.b;
      stream_any(reads, a, it.e - it.b);
    });
  };
  roofline_step();
  std::vector<double> t_rule, t_roof;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = Clock::now();
    roofline_step();
    auto t1 = Clock::now();
    opt.step();
    auto t2 = Clock::now();
    t_roof.push_back(std::chrono::duration<double>(t1 - t0).count());
    t_rule.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  return {rc.label, shape.label, threads, bytes / median(t_rule) / 1e9, bytes / median(t_roof) / 1e9, median(t_rule)};
}

// One rule on the device against a device-to-device copy of the same
// number of bytes, alternating, medians of `repeats`.
Measurement measure_device(const RuleCase& rc, const Shape2& shape, DType dtype, int repeats) {
  const std::size_t total = shape.tensors * shape.elements;
  const std::size_t es = size_of(dtype);
  Buffer params(total * es, 0, Device::cuda, "benchmark parameters"), grads(total * es, 1, Device::cuda, "benchmark gradients");
  {
    // 0.5 and 0.01 in the parameters' type, widened on the device from f32 staging.
    Buffer staging(total * sizeof(float), 2, Device::cuda, "benchmark staging");
    std::vector<unsigned char> host(total * es);
    for (auto [buffer, value] : {std::pair{&params, 0.5f}, std::pair{&grads, 0.01f}}) {
      dispatch_dtype(dtype, [&]<class T>() {
        T* h = reinterpret_cast<T*>(host.data());
        for (std::size_t i = 0; i < total; ++i) h[i] = from_float<T>(value);
      });
      copy_bytes(buffer->data(), Device::cuda, host.data(), Device::cpu, host.size());
    }
  }
  std::vector<Param> list(shape.tensors);
  const Shape one{static_cast<std::int64_t>(shape.elements)};
  for (std::size_t t = 0; t < shape.tensors; ++t) {
    list[t].value = {static_cast<char*>(params.data()) + t * shape.elements * es, dtype, one, Device::cuda};
    list[t].grad = {static_cast<char*>(grads.data()) + t * shape.elements * es, dtype, one, Device::cuda};
    list[t].has_grad = true;
  }
  Optimizer opt(rc.rule, std::move(list), rc.options);
  opt.step();  // creates the state
  const StateLayout layout = opt.rule().layout(opt.group(0).options);
  const double k = static_cast<double>(layout.tensors.size());
  // Per element: the gradient and the fp32 value (parameter or master) and
  // state read; the fp32 value and state written, and a bf16/f16 parameter.
  const double per_element = static_cast<double>(es) + 4.0 + 4.0 * k + 4.0 + 4.0 * k + (dtype == DType::f32 ? 0.0 : es);
  const double bytes = per_element * static_cast<double>(total);
  // The copy moves the same bytes: half read, half written.
  const std::size_t copy_bytes_each = static_cast<std::size_t>(bytes / 2);
  Buffer from(copy_bytes_each, 0, Device::cuda, "roofline source"), to(copy_bytes_each, 0, Device::cuda, "roofline target");
  copy_bytes(to.data(), Device::cuda, from.data(), Device::cuda, copy_bytes_each);
  std::vector<double> t_rule, t_roof;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = Clock::now();
    copy_bytes(to.data(), Device::cuda, from.data(), Device::cuda, copy_bytes_each);
    auto t1 = Clock::now();
    opt.step();
    auto t2 = Clock::now();
    t_roof.push_back(std::chrono::duration<double>(t1 - t0).count());
    t_rule.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  const std::string label = dtype == DType::f32 ? rc.label : str(rc.label, "-", name_of(dtype));
  return {label, shape.label, 0,
          bytes / median(t_rule) / 1e9, bytes / median(t_roof) / 1e9};
}

// Adam's kernel at 16M elements, 1 thread, over four placements of its
// arrays: what chose the allocator's staggering (docs/performance.md).
void placement_study(int repeats) {
  const std::size_t n = std::size_t{16} << 20, bytes = n * sizeof(float);
  const RuleInfo& adam = rule_or_throw("adam");
  RuleBlob parsed, coeffs;
  adam.parse(resolve_options(adam, {}), parsed);
  float scalars[kMaxStateScalars] = {};
  auto run = [&](const char* label, float* p, float* g, float* m, float* v) {
    fill(p, n, 0.5f);
    fill(g, n, 0.01f);
    std::memset(m, 0, bytes);
    std::memset(v, 0, bytes);
    Slice s;
    s.param = p;
    s.grad = g;
    s.state[0] = m;
    s.state[1] = v;
    s.n = n;
    std::vector<double> times;
    for (int r = 0; r < repeats + 1; ++r) {
      adam.prepare(parsed, scalars, r == 0, coeffs);
      auto t0 = Clock::now();
      adam.apply(coeffs, s);
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    times.erase(times.begin());
    const double gbps = 7.0 * bytes / median(times) / 1e9;
    std::fprintf(stderr, "  %-44s %7.2f GB/s   (addresses mod 1 MiB: %05lx %05lx %05lx %05lx)\n", label, gbps,
                 reinterpret_cast<unsigned long>(p) & 0xfffff, reinterpret_cast<unsigned long>(g) & 0xfffff,
                 reinterpret_cast<unsigned long>(m) & 0xfffff, reinterpret_cast<unsigned long>(v) & 0xfffff);
    return gbps;
  };
  std::fprintf(stderr, "placement study: adam kernel, 16M elements, 1 thread\n");
  {
    float* a[4];
    for (auto& x : a) x = static_cast<float*>(std::malloc(bytes));
    run("glibc malloc (64 MiB + 4 KiB apart)", a[0], a[1], a[2], a[3]);
    for (auto& x : a) std::free(x);
  }
  {
    Buffer a(bytes, 0), b(bytes, 0), c(bytes, 0), d(bytes, 0);
    run("2 MiB aligned, not staggered", a.as<float>(), b.as<float>(), c.as<float>(), d.as<float>());
  }
  {
    Buffer a(bytes, 0), b(bytes, 1), c(bytes, 3), d(bytes, 4);
    run("2 MiB aligned, staggered (distopt default)", a.as<float>(), b.as<float>(), c.as<float>(), d.as<float>());
  }
}

}  // namespace

int run_optim_bench(const OptimBenchOptions& o) {
  std::vector<RuleCase> selected;
  if (o.rules.empty()) selected = rule_cases();
  std::vector<RuleCase> known = rule_cases();
  known.insert(known.end(), quantized_cases().begin(), quantized_cases().end());
  for (const std::string& name : o.rules) {
    auto it = std::find_if(known.begin(), known.end(), [&](const RuleCase& r) { return r.label == name; });
    if (it == known.end()) {
      std::string names;
      for (const auto& r : known) names += (names.empty() ? "" : ", ") + r.label;
      throw InvalidInput(str("unknown benchmark rule '", name, "' (known: ", names, ")"));
    }
    selected.push_back(*it);
  }
  Device device = Device::cpu;
  if (!parse_device(o.device, &device)) throw InvalidInput(str("--device: '", o.device, "' is not cpu or cuda"));
  DType dtype = DType::f32;
  if (!parse_dtype(o.dtype, &dtype)) throw InvalidInput(str("--dtype: '", o.dtype, "' is not f32, bf16 or f16"));
  if (device == Device::cpu && dtype != DType::f32) throw InvalidInput("--dtype other than f32 needs --device cuda");
  require_device(device);
  for (const RuleCase& rc : selected)
    if (std::string why = why_rule_cannot_run(rc.rule, device); !why.empty()) throw InvalidInput(why);
  std::vector<Shape2> shapes;
  const std::vector<std::string> defaults = device == Device::cuda
                                                ? std::vector<std::string>{"256M", "100x10M", "1000x256K"}
                                                : std::vector<std::string>{"16M", "1000x16K"};
  for (const std::string& c : o.cases.empty() ? defaults : o.cases) shapes.push_back(parse_case(c));
  if (o.placement && device == Device::cpu) placement_study(o.repeats);
  if (device == Device::cuda) {
    std::vector<Measurement> results;
    std::fprintf(stderr, "%-14s %-10s %10s %12s %9s   (roofline: device-to-device copy)\n", "rule", "case", "GB/s",
                 "roofline", "fraction");
    for (const Shape2& shape : shapes)
      for (const RuleCase& rc : selected) {
        Measurement m = measure_device(rc, shape, dtype, o.repeats);
        std::fprintf(stderr, "%-14s %-10s %10.1f %12.1f %9.3f\n", m.rule.c_str(), m.kase.c_str(), m.gbps,
                     m.roofline_gbps, m.gbps / m.roofline_gbps);
        results.push_back(std::move(m));
      }
    if (o.json) {
      std::string out = "{\"device\": \"cuda\", \"results\": [";
      for (std::size_t i = 0; i < results.size(); ++i) {
        const Measurement& m = results[i];
        out += str(i ? ", " : "", "{\"rule\": \"", m.rule, "\", \"case\": \"", m.kase, "\", \"gbps\": ", m.gbps,
                   ", \"roofline_gbps\": ", m.roofline_gbps, ", \"fraction\": ", m.gbps / m.roofline_gbps, "}");
      }
      std::printf("%s]}\n", out.c_str());
    }
    return 0;
  }

  std::vector<Measurement> results;
  std::fprintf(stderr, "%-18s %-9s %7s %10s %12s %9s %9s\n", "rule", "case", "threads", "GB/s", "roofline", "fraction",
               "step ms");
  for (const Shape2& shape : shapes)
    for (int threads : o.threads)
      for (const RuleCase& rc : selected) {
        Measurement m = measure(rc, shape, threads, o.repeats);
        std::fprintf(stderr, "%-18s %-9s %7d %10.2f %12.2f %9.3f %9.3f\n", m.rule.c_str(), m.kase.c_str(), m.threads,
                     m.gbps, m.roofline_gbps, m.gbps / m.roofline_gbps, m.step_s * 1e3);
        results.push_back(std::move(m));
      }
  if (o.json) {
    std::string out = "{\"results\": [";
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Measurement& m = results[i];
      char buf[256];
      std::snprintf(buf, sizeof(buf),
                    "%s{\"rule\": \"%s\", \"case\": \"%s\", \"threads\": %d, \"gbps\": %.3f, \"roofline_gbps\": %.3f, "
                    "\"fraction\": %.4f, \"step_s\": %.6g}",
                    i ? ", " : "", m.rule.c_str(), m.kase.c_str(), m.threads, m.gbps, m.roofline_gbps,
                    m.gbps / m.roofline_gbps, m.step_s);
      out += buf;
    }
    out += "]}";
    std::printf("%s\n", out.c_str());
  }
  return 0;
}

}  // namespace distopt::bench
