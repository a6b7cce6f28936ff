// Replay cases (include/distopt/replay/replay.hpp; docs/formats.md,
// "distopt replay"): reading and checking a case, running it, comparing
// with its expected result, and writing a result as JSON.
#include "distopt/replay/replay.hpp"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "../core/json_reader.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"

namespace distopt::replay {

using nlohmann::json;

namespace {

// The case format's reader: JsonReader's members and numbers (shared with
// the optim library's scheduler specs), and the case's arrays, indices and
// optimizer options.
class Reader : public JsonReader {
 public:
  using JsonReader::JsonReader;

  std::vector<float> floats(const json& v, const std::string& where) const {
    if (!v.is_array()) fail(where, "must be an array of numbers");
    std::vector<float> out;
    out.reserve(v.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      out.push_back(static_cast<float>(number(v[i], str(where, "[", i, "]"))));
    return out;
  }

  std::size_t index(const json& v, const std::string& where) const {
    if (!v.is_number_integer() || v.get<long long>() < 0) fail(where, "must be a non-negative integer");
    return v.get<std::size_t>();
  }

  OptionMap options(const json& v, const std::string& where) const {
    if (!v.is_object()) fail(where, "must be an object");
    OptionMap out;
    for (const auto& [name, value] : v.items()) {
      const std::string at = str(where, ".", name);
      if (value.is_null()) continue;  // torch's None: the default
      if (value.is_boolean()) out[name] = OptionValue(value.get<bool>());
      else if (value.is_number()) out[name] = OptionValue(value.get<double>());
      else if (value.is_array() && value.size() == 2)
        out[name] = OptionValue(number(value[0], at + "[0]"), number(value[1], at + "[1]"));
      else if (value.is_array() && value.size() == 3)
        out[name] = OptionValue(number(value[0], at + "[0]"), number(value[1], at + "[1]"),
                                number(value[2], at + "[2]"));
      else if (value.is_string() && OptionValue::word_fits(value.get_ref<const std::string&>()))
        out[name] = OptionValue(std::string_view(value.get_ref<const std::string&>()));
      else fail(at, str("must be a number, a boolean, two or three numbers or a word, got ", value.dump()));
    }
    return out;
  }
};

}  // namespace

Case parse_case(const std::string& text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {  // parse errors, and numbers beyond double's range (1e999)
    std::string what = e.what();
    if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    throw InvalidInput(str(source, ": malformed JSON: ", what));
  }
  Reader r(source);
  Case c;
  c.source = source;
  const json& format = r.member(doc, "format", "case");
  if (!format.is_string() || format.get<std::string>() != "distopt-replay/1")
    r.fail("format", str("expected \"distopt-replay/1\", got ", format.dump()));

  const json& opt = r.member(doc, "optimizer", "case");
  const json& name = r.member(opt, "name", "optimizer");
  if (!name.is_string()) r.fail("optimizer.name", "must be a string");
  c.optimizer = name.get<std::string>();
  if (opt.contains("options")) c.options = r.options(opt["options"], "optimizer.options");

  const json& params = r.member(doc, "params", "case");
  if (!params.is_array() || params.empty()) r.fail("params", "must be a non-empty array");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string at = str("params[", i, "]");
    const json& shape = r.member(params[i], "shape", at);
    if (!shape.is_array()) r.fail(at + ".shape", "must be an array of sizes");
    Shape s;
    std::uint64_t product = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const std::size_t dim = r.index(shape[d], str(at, ".shape[", d, "]"));
      // A shape whose product overflows would pass the size check below.
      if (dim > (std::uint64_t{1} << 40) || __builtin_mul_overflow(product, dim, &product) ||
          product > (std::uint64_t{1} << 40))
        r.fail(at + ".shape", "has more elements than any tensor can (the product of its sizes overflows)");
      s.push_back(static_cast<std::int64_t>(dim));
    }
    std::vector<float> data = r.floats(r.member(params[i], "data", at), at + ".data");
    if (static_cast<std::int64_t>(data.size()) != numel(s))
      r.fail(at + ".data", str("has ", data.size(), " values, shape ", to_string(s), " needs ", numel(s)));
    c.shapes.push_back(std::move(s));
    c.params.push_back(std::move(data));
  }

  std::vector<int> owner(c.params.size(), -1);
  if (doc.contains("param_groups")) {
    const json& groups = doc["param_groups"];
    if (!groups.is_array() || groups.empty()) r.fail("param_groups", "must be a non-empty array");
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const std::string at = str("param_groups[", g, "]");
      GroupCase gc;
      const json& ids = r.member(groups[g], "params", at);
      if (!ids.is_array()) r.fail(at + ".params", "must be an array of parameter indices");
      for (std::size_t k = 0; k < ids.size(); ++k) {
        const std::size_t i = r.index(ids[k], str(at, ".params[", k, "]"));
        if (i >= c.params.size())
          r.fail(str(at, ".params[", k, "]"), str("parameter ", i, " does not exist (", c.params.size(), " parameters)"));
        if (owner[i] >= 0) r.fail(str(at, ".params[", k, "]"), str("parameter ", i, " is already in group ", owner[i]));
        owner[i] = static_cast<int>(g);
        gc.params.push_back(i);
      }
      if (groups[g].contains("options")) gc.options = r.options(groups[g]["options"], at + ".options");
      c.groups.push_back(std::move(gc));
    }
    for (std::size_t i = 0; i < owner.size(); ++i)
      if (owner[i] < 0) r.fail("param_groups", str("parameter ", i, " is in no group"));
  } else {
    GroupCase gc;
    for (std::size_t i = 0; i < c.params.size(); ++i) gc.params.push_back(i);
    c.groups.push_back(std::move(gc));
  }

  const json& steps = r.member(doc, "steps", "case");
  if (!steps.is_array()) r.fail("steps", "must be an array");
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const std::string at = str("steps[", k, "]");
    StepCase sc;
    const json& grads = r.member(steps[k], "grads", at);
    if (!grads.is_array() || grads.size() != c.params.size())
      r.fail(at + ".grads", str("must list one gradient (or null) per parameter: ", c.params.size()));
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].is_null()) {
        sc.grads.emplace_back();
        continue;
      }
      std::vector<float> g = r.floats(grads[i], str(at, ".grads[", i, "]"));
      if (g.size() != c.params[i].size())
        r.fail(str(at, ".grads[", i, "]"), str("has ", g.size(), " values, parameter ", i, " has ", c.params[i].size()));
      sc.grads.emplace_back(std::move(g));
    }
    if (steps[k].contains("metric")) sc.metric = r.number(steps[k]["metric"], at + ".metric");
    c.steps.push_back(std::move(sc));
  }

  if (doc.contains("scheduler") && !doc["scheduler"].is_null()) {
    c.scheduler = parse_scheduler_spec(doc["scheduler"].dump(), source);
    if (c.scheduler->name == "reducelronplateau")
      for (std::size_t k = 0; k < c.steps.size(); ++k)
        if (!c.steps[k].metric) r.fail(str("steps[", k, "]"), "needs a 'metric' for scheduler reducelronplateau");
  }

  if (doc.contains("expected")) {
    const json& e = doc["expected"];
    Result res;
    const json& ep = r.member(e, "params", "expected");
    if (!ep.is_array() || ep.size() != c.params.size())
      r.fail("expected.params", str("must hold ", c.params.size(), " parameters"));
    for (std::size_t i = 0; i < ep.size(); ++i) {
      res.params.push_back(r.floats(ep[i], str("expected.params[", i, "]")));
      if (res.params.back().size() != c.params[i].size())
        r.fail(str("expected.params[", i, "]"), str("has ", res.params.back().size(), " values, parameter ", i,
                                                     " has ", c.params[i].size()));
    }
    if (e.contains("lr")) {
      const json& lr = e["lr"];
      if (!lr.is_array() || lr.size() != c.groups.size())
        r.fail("expected.lr", str("must hold one list per group: ", c.groups.size()));
      for (std::size_t g = 0; g < lr.size(); ++g) {
        if (!lr[g].is_array() || lr[g].size() != c.steps.size())
          r.fail(str("expected.lr[", g, "]"), str("must hold one lr per step: ", c.steps.size()));
        std::vector<double> v;
        for (std::size_t k = 0; k < lr[g].size(); ++k) v.push_back(r.number(lr[g][k], str("expected.lr[", g, "][", k, "]")));
        res.lr.push_back(std::move(v));
      }
    }
    c.expected = std::move(res);
  }
  return c;
}

Case load_case(const std::string& path) {
  if (std::filesystem::is_directory(path)) throw InvalidInput(str(path, ": is a folder: give one case file, or --check to compare every case in it"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open file"));
  // Read at most kMaxCaseBytes (+1 to notice more): /dev/zero or a huge
  // file must not fill the memory.
  constexpr std::size_t kMaxCaseBytes = std::size_t{256} << 20;
  std::string text;
  char block[1 << 16];
  while (in && text.size() <= kMaxCaseBytes) {
    in.read(block, sizeof block);
    text.append(block, static_cast<std::size_t>(in.gcount()));
  }
  if (in.bad()) throw IoError(str(path, ": read error"));
  if (text.size() > kMaxCaseBytes) throw InvalidInput(str(path, ": larger than 256 MiB, too large for a replay case"));
  return parse_case(text, path);
}

Result run(const Case& c, ThreadPool* pool, const SchedulerFactory& make, Device device) {
  // Parameters and gradients live in buffers the replay owns, as a model's
  // would: on the CPU, or on the device (copied there and back).
  std::vector<Buffer> values, grads;
  std::vector<ParamGroupSpec> groups(c.groups.size());
  std::vector<std::size_t> position(c.params.size());  // param index -> optimizer index
  std::size_t next = 0;
  values.reserve(c.params.size());
  grads.reserve(c.params.size());
  for (std::size_t i = 0; i < c.params.size(); ++i) {
    values.emplace_back(c.params[i].size() * sizeof(float), 0, device, str("params[", i, "]"));
    grads.emplace_back(c.params[i].size() * sizeof(float), 1, device, str("the gradient of params[", i, "]"));
    copy_bytes(values[i].data(), device, c.params[i].data(), Device::cpu, c.params[i].size() * sizeof(float));
  }
  for (std::size_t g = 0; g < c.groups.size(); ++g) {
    groups[g].options = c.groups[g].options;
    for (std::size_t i : c.groups[g].params) {
      Param p;
      p.name = str("params[", i, "]");
      p.value = {values[i].data(), DType::f32, c.shapes[i], device};
      p.grad = {grads[i].data(), DType::f32, c.shapes[i], device};
      groups[g].params.push_back(std::move(p));
      position[i] = next++;
    }
  }
  OptimizerConfig config;
  config.pool = pool;
  Optimizer opt(c.optimizer, std::move(groups), c.options, config);
  std::unique_ptr<Scheduler> scheduler;
  if (c.scheduler) {
    try {
      scheduler = make ? make(opt, *c.scheduler) : make_scheduler(opt, *c.scheduler);
    } catch (const InvalidInput& e) {
      throw InvalidInput(str(c.source, ": scheduler: ", e.what()));
    }
  }
  Result r;
  r.lr.resize(c.groups.size());
  for (const StepCase& s : c.steps) {
    for (std::size_t i = 0; i < c.params.size(); ++i) {
      Param& p = opt.param(position[i]);
      p.has_grad = s.grads[i].has_value();
      if (p.has_grad)
        copy_bytes(grads[i].data(), device, s.grads[i]->data(), Device::cpu, s.grads[i]->size() * sizeof(float));
    }
    opt.step();
    if (scheduler) {
      if (scheduler->needs_metric())
        scheduler->step(*s.metric);
      else
        scheduler->step();
    }
    for (std::size_t g = 0; g < c.groups.size(); ++g) r.lr[g].push_back(opt.lr(g));
  }
  for (std::size_t i = 0; i < c.params.size(); ++i) {
    r.params.emplace_back(c.params[i].size());
    copy_bytes(r.params.back().data(), Device::cpu, values[i].data(), device, c.params[i].size() * sizeof(float));
  }
  return r;
}

Comparison compare(const Result& ours, const Result& expected, Tolerance tol) {
  Comparison cmp;
  auto check = [&](double a, double e, const std::string& where) {
    ++cmp.compared;
    const double err = std::fabs(a - e);
    const bool same_nan = std::isnan(a) && std::isnan(e);
    if (!same_nan && !(a == e)) cmp.max_abs_error = std::max(cmp.max_abs_error, std::isnan(err) ? INFINITY : err);
    if (same_nan || a == e || err <= tol.atol + tol.rtol * std::fabs(e)) return;
    if (cmp.mismatches++ == 0)
      cmp.first_mismatch = str(where, ": ours ", a, ", expected ", e, " (|diff| ", err, " > ",
                               tol.atol + tol.rtol * std::fabs(e), ")");
  };
  DISTOPT_CHECK(ours.params.size() == expected.params.size(), ours.params.size(), " vs ", expected.params.size());
  for (std::size_t i = 0; i < ours.params.size(); ++i) {
    DISTOPT_CHECK(ours.params[i].size() == expected.params[i].size());
    for (std::size_t e = 0; e < ours.params[i].size(); ++e)
      check(ours.params[i][e], expected.params[i][e], str("params[", i, "][", e, "]"));
  }
  for (std::size_t g = 0; g < expected.lr.size() && g < ours.lr.size(); ++g)
    for (std::size_t k = 0; k < expected.lr[g].size() && k < ours.lr[g].size(); ++k)
      check(ours.lr[g][k], expected.lr[g][k], str("lr[", g, "][", k, "]"));
  return cmp;
}

namespace {
template <class T>
void append_number(std::string& out, T v) {
  if (std::isnan(v)) {
    out += "\"NaN\"";
    return;
  }
  if (std::isinf(v)) {
    out += v > 0 ? "\"Infinity\"" : "\"-Infinity\"";
    return;
  }
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, res.ptr);
}
template <class T>
void append_lists(std::string& out, const std::vector<std::vector<T>>& lists) {
  out += '[';
  for (std::size_t i = 0; i < lists.size(); ++i) {
    out += i ? ", [" : "[";
    for (std::size_t k = 0; k < lists[i].size(); ++k) {
      if (k) out += ", ";
      append_number(out, lists[i][k]);
    }
    out += ']';
  }
  out += ']';
}
}  // namespace

std::string to_json(const Result& r) {
  std::string out = "{\"params\": ";
  append_lists(out, r.params);
  out += ", \"lr\": ";
  append_lists(out, r.lr);
  out += '}';
  return out;
}

}  // namespace distopt::replay
