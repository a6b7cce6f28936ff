// distopt._core: the C++ optimizer for the Python front end
// (python/distopt/torch/optim.py; docs/python.md).
//
// Parameters and gradients are torch tensors' own memory, passed as
// addresses: the C++ rules update the parameters in place. The state lives
// in the C++ Optimizer and reaches Python as zero-copy numpy arrays whose
// base keeps the optimizer alive, which torch.from_numpy turns into the
// tensors of torch's `optimizer.state`.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/quant.hpp"
#include "distopt/version.hpp"

namespace py = pybind11;

namespace distopt::python {

// A Python value as an option: bool, number (None: NaN, the rules' "unset"),
// a pair or triple of numbers, or a word.
OptionValue to_option(std::string_view key, py::handle v) {
  if (v.is_none()) return std::nan("");
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>();
  if (py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v)) return v.cast<double>();
  if (py::isinstance<py::str>(v)) {
    const std::string w = v.cast<std::string>();
    if (w.size() > OptionValue::kMaxWord) throw InvalidInput(str("option ", key, ": '", w, "' is too long"));
    return OptionValue(std::string_view(w));
  }
  if (py::isinstance<py::tuple>(v) || py::isinstance<py::list>(v)) {
    const auto seq = v.cast<py::sequence>();
    std::vector<double> x;
    for (py::handle item : seq) {
      if (!(py::isinstance<py::int_>(item) || py::isinstance<py::float_>(item)) || py::isinstance<py::bool_>(item))
        throw InvalidInput(str("option ", key, ": expected numbers in the tuple"));
      x.push_back(item.cast<double>());
    }
    if (x.size() == 2) return OptionValue(x[0], x[1]);
    if (x.size() == 3) return OptionValue(x[0], x[1], x[2]);
    throw InvalidInput(str("option ", key, ": a tuple of ", x.size(), " numbers (2 or 3 expected)"));
  }
  throw InvalidInput(str("option ", key, ": unsupported value of type ", std::string(py::str(v.get_type().attr("__name__")))));
}

py::object from_option(const OptionValue& v) {
  switch (v.kind()) {
    case OptionValue::Kind::flag: return py::bool_(v.flag());
    case OptionValue::Kind::number: return std::isnan(v.number()) ? py::none() : py::object(py::float_(v.number()));
    case OptionValue::Kind::pair: return py::make_tuple(v.pair()[0], v.pair()[1]);
    case OptionValue::Kind::triple: return py::make_tuple(v.triple()[0], v.triple()[1], v.triple()[2]);
    case OptionValue::Kind::word: return py::str(std::string(v.word()));
  }
  return py::none();
}

OptionMap to_options(const py::dict& d) {
  OptionMap m;
  for (auto [k, v] : d) {
    const std::string key = k.cast<std::string>();
    m[key] = to_option(key, v);
  }
  return m;
}

namespace {

DType to_dtype(const std::string& s) {
  DType t;
  if (!parse_dtype(s, &t)) throw InvalidInput(str("unsupported dtype '", s, "'"));
  return t;
}

// One parameter as Python describes it: (name, address, dtype, shape,
// device: "cpu" or "cuda").
using ParamTuple = std::tuple<std::string, std::uintptr_t, std::string, std::vector<std::int64_t>, std::string>;

std::vector<Param> to_params(const std::vector<ParamTuple>& list) {
  std::vector<Param> ps;
  for (const auto& [name, address, dtype, shape, device_name] : list) {
    Device device;
    if (!parse_device(device_name, &device)) throw InvalidInput(str(name, ": unsupported device '", device_name, "'"));
    Param p;
    p.name = name;
    p.value = {reinterpret_cast<void*>(address), to_dtype(dtype), Shape(shape.begin(), shape.end()), device};
    p.grad = {nullptr, p.value.dtype, p.value.shape, device};
    ps.push_back(std::move(p));
  }
  return ps;
}

class PyOptimizer {
 public:
  PyOptimizer(const std::string& rule, const std::vector<ParamTuple>& params, const py::dict& options, int threads)
      : pool_(threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr),
        opt_(rule, to_params(params), to_options(options), OptimizerConfig{pool_.get()}) {}

  void add_group(const std::vector<ParamTuple>& params, const py::dict& options, const std::string& rule) {
    opt_.add_param_group({to_params(params), to_options(options), rule});
  }
  void set_option(std::size_t g, const std::string& key, py::handle value) {
    if (g >= opt_.num_groups()) throw InvalidInput(str("no parameter group ", g));
    if (key == "lr") opt_.set_lr(g, value.cast<double>());  // schedulers may take it anywhere, as torch's do
    else opt_.set_option(g, key, to_option(key, value));
  }
  py::dict group_options(std::size_t g) const {
    py::dict d;
    for (const auto& [k, v] : opt_.group(g).options) d[py::str(k)] = from_option(v);
    return d;
  }
  // One step: `params[i]` and `grads[i]` are parameter i's and its
  // gradient's addresses now (grad 0: no gradient this step).
  void step(const std::vector<std::uintptr_t>& params, const std::vector<std::uintptr_t>& grads) {
    if (params.size() != opt_.num_params() || grads.size() != opt_.num_params())
      throw InvalidInput(str("step: ", params.size(), " parameters and ", grads.size(), " gradients for an optimizer of ",
                             opt_.num_params()));
    for (std::size_t i = 0; i < grads.size(); ++i) {
      Param& p = opt_.param(i);
      p.value.data = reinterpret_cast<void*>(params[i]);
      p.has_grad = grads[i] != 0;
      p.grad.data = reinterpret_cast<void*>(grads[i]);
    }
    py::gil_scoped_release release;
    opt_.step();
  }
  // Parameter i's state as {key: view of the optimizer's memory}: a numpy
  // array for host memory, whose base keeps the optimizer alive; for device
  // memory, (address, shape, typestr), which python/distopt/torch/_dropin.py
  // hands to torch as a __cuda_array_interface__ holding the optimizer.
  py::dict state(py::object self, std::size_t i) {
    if (i >= opt_.num_params()) throw InvalidInput(str("no parameter ", i));
    py::dict d;
    auto put = [&]<class T>(const std::string& key, T* data, std::vector<py::ssize_t> shape, Device device,
                            const char* typestr) {
      if (device == Device::cpu) d[py::str(key)] = py::array_t<T>(shape, data, self);
      else
        d[py::str(key)] = py::make_tuple(reinterpret_cast<std::uintptr_t>(data), py::tuple(py::cast(shape)), typestr);
    };
    for (const auto& v : opt_.state_views(i))
      put(v.key, v.data, std::vector<py::ssize_t>(v.shape.begin(), v.shape.end()), v.device, "<f4");
    // Quantized state: its codes, as bytes, and its block scales; bf16
    // state as int16 of the parameter's shape (its bits, which
    // python/distopt/torch/_dropin.py views as torch.bfloat16).
    for (const auto& q : opt_.quantized_views(i)) {
      if (!quant::has_scales(q.dtype)) {
        const Shape& s = opt_.param(i).value.shape;
        put(q.key, reinterpret_cast<std::int16_t*>(q.codes), std::vector<py::ssize_t>(s.begin(), s.end()), q.device,
            "<i2");
        continue;
      }
      const auto bytes = static_cast<py::ssize_t>(quant::code_bytes(q.dtype, q.elements));
      const auto blocks = static_cast<py::ssize_t>(quant::num_blocks(q.dtype, q.elements));
      put(q.key + ".codes", q.codes, {bytes}, q.device, "|u1");
      put(q.key + std::string(quant::kAbsmaxSuffix), q.absmax, {blocks}, q.device, "<f4");
    }
    return d;
  }
  // Quantized state tensor `key` of parameter i from fp32 values: with
  // their scales (a distopt state_dict: the values must be exactly codes
  // times them), or quantized afresh (torch's fp32 state; scales = None).
  void quantize_state(std::size_t i, const std::string& key, py::array_t<float, py::array::c_style> values,
                      std::optional<py::array_t<float, py::array::c_style>> scales) {
    if (i >= opt_.num_params()) throw InvalidInput(str("no parameter ", i));
    for (const auto& q : opt_.quantized_views(i)) {
      if (q.key != key) continue;
      if (static_cast<std::size_t>(values.size()) != q.elements)
        throw InvalidInput(
            str("params[", i, "]: loaded '", key, "' has ", values.size(), " elements, it needs ", q.elements));
      // Scales of the other storage (int8's into int4 state) are dropped:
      // the values are quantized afresh, as in C++ loads and checkpoints.
      const auto kind = scales ? quant::classify_scales(q.dtype, q.elements, static_cast<std::size_t>(scales->size()))
                               : quant::SavedScales::other_storage;
      if (kind == quant::SavedScales::misfit)
        throw InvalidInput(str("params[", i, "]: loaded '", key, quant::kAbsmaxSuffix, "' has ", scales->size(),
                               " scales, it needs ", quant::num_blocks(q.dtype, q.elements), " (",
                               quant::name_of(q.dtype), " blocks of ", quant::block_of(q.dtype), ")"));
      const float* saved = kind == quant::SavedScales::this_storage ? scales->data() : nullptr;
      const Optimizer::HostQuantized host(q, false);  // device state: written from a copy
      if (const long b = quant::load(q.dtype, q.is_signed, values.data(), q.elements, saved, host.view().codes,
                                     host.view().absmax);
          b >= 0)
        throw InvalidInput(str("params[", i, "]: loaded '", key, "' is not ", quant::name_of(q.dtype),
                               " codes times its scales (block ", b, ")"));
      host.commit();
      return;
    }
    throw InvalidInput(str("params[", i, "] keeps no quantized state '", key, "'"));
  }
  // None: steps on this thread's own stream, complete on return; a handle
  // (torch.cuda.current_stream().cuda_stream): enqueued there.
  void set_cuda_stream(std::optional<std::uintptr_t> stream) { opt_.set_cuda_stream(stream); }
  // GradScaler's found_inf for the next step: the address of a float32 in
  // device memory (0: none).
  void skip_next_step_if(std::uintptr_t flag) { opt_.skip_next_step_if(reinterpret_cast<const float*>(flag)); }
  void settle_skipped_step() {
    py::gil_scoped_release release;  // may wait for the device
    opt_.settle_skipped_step();
  }
  void init_state(std::size_t i) {
    if (i >= opt_.num_params()) throw InvalidInput(str("no parameter ", i));
    opt_.init_state(i);
  }
  void reset_state(std::size_t i) {
    if (i >= opt_.num_params()) throw InvalidInput(str("no parameter ", i));
    opt_.reset_state(i);
  }
  void state_written() { opt_.state_written(); }
  bool has_state(std::size_t i) const { return opt_.has_state(i); }
  std::size_t num_params() const { return opt_.num_params(); }
  std::string rule_of_group(std::size_t g) const { return std::string(opt_.rule_of_group(g).name); }

 private:
  std::unique_ptr<ThreadPool> pool_;
  Optimizer opt_;
};

py::list rule_options(const std::string& rule) {
  py::list out;
  const RuleInfo& r = rule_or_throw(rule);
  for (const OptionSpec& o : r.options)
    out.append(py::make_tuple(std::string(o.name), from_option(o.default_value), std::string(o.help)));
  if (r.quantizable())  // every rule's group option, offered where it can be other than f32
    out.append(py::make_tuple(std::string(kStateDTypeOption), py::str("f32"),
                              str("storage of the state: ", quant::state_dtype_names(), " (docs/optimizers.md)")));
  return out;
}

// Fashion-MNIST as numpy arrays: images (n, 784) float32 in [0, 1], labels int64.
py::dict fashion_mnist(const std::string& dir) {
  const data::Split split = data::load_fashion_mnist(dir.empty() ? data::default_fashion_mnist_dir() : dir);
  py::dict out;
  for (const auto& [name, set] : {std::pair{"train", &split.train}, std::pair{"test", &split.test}}) {
    const auto n = static_cast<py::ssize_t>(set->size());
    py::array_t<float> x({n, static_cast<py::ssize_t>(set->features)});
    std::copy(set->x.begin(), set->x.end(), x.mutable_data());
    py::array_t<std::int64_t> y(n);
    for (py::ssize_t i = 0; i < n; ++i) y.mutable_data()[i] = static_cast<std::int64_t>(set->y[static_cast<std::size_t>(i)]);
    out[name] = py::make_tuple(x, y);
  }
  return out;
}

}  // namespace
}  // namespace distopt::python

PYBIND11_MODULE(_core, m) {
  using namespace distopt;
  using namespace distopt::python;
  m.doc() = "distopt's C++ optimizers (see distopt.torch.optim)";
  m.attr("__version__") = DISTOPT_VERSION_STRING;
  // distopt's one-line errors: bad input is a ValueError, the rest RuntimeError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidInput& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const NonFiniteError& e) {
      PyErr_SetString(PyExc_FloatingPointError, e.what());
    }
  });
  m.def("fashion_mnist", &fashion_mnist, py::arg("dir") = "",
        "Fashion-MNIST through distopt's reader: {'train': (x, y), 'test': (x, y)}");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    }
  });
  bind_sharded(m);
  m.def("rule_options", &rule_options, "(name, default, help) of every option of a rule");
  m.def("rules", [] {
    std::vector<std::string> names;
    for (const RuleInfo* r : all_rules()) names.emplace_back(r->name);
    return names;
  });
  m.def(
      "check_options",
      [](const std::string& rule, const py::dict& options) {
        const RuleInfo& r = rule_or_throw(rule);
        r.validate(resolve_options(r, to_options(options)));
      },
      py::arg("rule"), py::arg("options"),
      "the rule's checks of these options (its defaults fill the rest): ValueError naming the first bad one");
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason,
        "why this build cannot step CUDA tensors here ('' when it can: built with CUDA, a device visible)");
  m.def(
      "why_rule_cannot_run",
      [](const std::string& rule, const std::string& device_name) {
        Device device;
        if (!parse_device(device_name, &device)) throw InvalidInput(str("unsupported device '", device_name, "'"));
        return why_rule_cannot_run(rule, device);
      },
      "'' when the rule has a kernel for the device ('cpu' or 'cuda'), else the one-line reason");
  m.def("locality", [](const std::string& rule) { return std::string(name_of(rule_or_throw(rule).locality)); });
  py::class_<PyOptimizer>(m, "Optimizer")
      .def(py::init<const std::string&, const std::vector<ParamTuple>&, const py::dict&, int>(), py::arg("rule"),
           py::arg("params"), py::arg("options"), py::arg("threads") = 1)
      .def("add_group", &PyOptimizer::add_group, py::arg("params"), py::arg("options"), py::arg("rule") = "")
      .def("set_option", &PyOptimizer::set_option)
      .def("group_options", &PyOptimizer::group_options)
      .def("step", &PyOptimizer::step)
      .def("state", [](py::object self, std::size_t i) { return self.cast<PyOptimizer&>().state(self, i); })
      .def("quantize_state", &PyOptimizer::quantize_state, py::arg("i"), py::arg("key"), py::arg("values"),
           py::arg("scales") = py::none())
      .def("init_state", &PyOptimizer::init_state)
      .def("reset_state", &PyOptimizer::reset_state)
      .def("set_cuda_stream", &PyOptimizer::set_cuda_stream, py::arg("stream"))
      .def("skip_next_step_if", &PyOptimizer::skip_next_step_if, py::arg("flag"))
      .def("settle_skipped_step", &PyOptimizer::settle_skipped_step)
      .def("state_written", &PyOptimizer::state_written)
      .def("has_state", &PyOptimizer::has_state)
      .def("rule_of_group", &PyOptimizer::rule_of_group)
      .def_property_readonly("num_params", &PyOptimizer::num_params);
}
