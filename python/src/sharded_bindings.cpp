// distopt._core's communicators and sharded optimizer (python/distopt/torch/
// comm.py and distributed.py; docs/python.md, "The sharded optimizer"): their
// bindings (bind_sharded), with what only the bindings use: the MPI
// environment, the collectives on addresses and push-sum gossip.
//
// Communicators: distopt's MPI one (mpirun), a one-rank one, and one over
// torch.distributed (torch_group_comm.cpp). Every C++ call that
// communicates releases the GIL first, so that the torch communicator's
// progress thread can post. The sharded optimizer is PySharded
// (sharded.hpp, sharded.cpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../src/parallel/int8_wire.hpp"  // the engine's packets, for the DDP hook
#include "bindings.hpp"
#include "distopt/comm/communicator.hpp"
#include "distopt/comm/launch_env.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/push_sum.hpp"
#include "distopt/gossip/topology.hpp"
#include "sharded.hpp"
#include "torch_group_comm.hpp"
#ifdef DISTOPT_PYTHON_MPI
#include "distopt/comm/mpi.hpp"
#endif

namespace distopt::python {
namespace {

// ---- the MPI environment (one per process) --------------------------------

#ifdef DISTOPT_PYTHON_MPI
std::unique_ptr<MpiEnvironment>& mpi_environment() {
  static std::unique_ptr<MpiEnvironment> env;
  return env;
}
#endif

std::shared_ptr<Communicator> mpi_world() {
#ifdef DISTOPT_PYTHON_MPI
  auto& env = mpi_environment();
  if (!env) env = std::make_unique<MpiEnvironment>(nullptr, nullptr);
  return make_mpi_world();
#else
  throw InvalidInput("this build of distopt has no MPI (configure with Open MPI installed: libopenmpi-dev)");
#endif
}

void mpi_finalize() {
#ifdef DISTOPT_PYTHON_MPI
  mpi_environment().reset();
#endif
}

// ---- collectives on addresses (comm.py checks the tensors) ----------------

ElemType to_elem(const std::string& s) {
  ElemType t;
  if (!parse_elem_type(s, &t)) throw InvalidInput(str("unsupported element type '", s, "'"));
  return t;
}

ReduceOp to_op(const std::string& s) {
  if (s == "sum") return ReduceOp::sum;
  if (s == "avg") return ReduceOp::avg;
  if (s == "max") return ReduceOp::max;
  if (s == "min") return ReduceOp::min;
  throw InvalidInput(str("unknown reduction '", s, "' (sum, avg, max or min)"));
}

void* at(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

// ---- push-sum gossip ------------------------------------------------------

// Push-sum gossip averaging of one vector (docs/gossip.md): each mix()
// sends shares of (x, w) to the topology's peers and adds what arrives.
class PyPushSum {
 public:
  PyPushSum(std::shared_ptr<Communicator> comm, const std::string& topology, std::size_t dim, int peers)
      : comm_(std::move(comm)), topology_(topology, comm_->size(), peers) {
    push_.emplace(*comm_, topology_, dim);
  }
  ~PyPushSum() {
    py::gil_scoped_release release;
    push_.reset();
  }
  double mix(std::uintptr_t x, std::size_t count, double w) {
    py::gil_scoped_release release;
    push_->mix({static_cast<float*>(at(x)), count}, w);
    return w;
  }

 private:
  std::shared_ptr<Communicator> comm_;
  gossip::Topology topology_;
  std::optional<gossip::PushSum> push_;
};

}  // namespace

void bind_sharded(py::module_& m) {
  m.def("sharded_strategies", &sharded_strategies,
        "the strategies ShardedOptimizer runs, as the library's registry says (StrategyInfo)");
  m.def(
      "grad_compressions",
      [] {
        std::vector<std::string> names;
        for (parallel::GradCompression c : parallel::kGradCompressions) names.emplace_back(parallel::name_of(c));
        return names;
      },
      "ShardedOptimizer's compression= names (StrategyOptions::grad_compression)");
  m.def("retire_sharded", &retire_all_sharded,
        "ends every sharded optimizer's strategy (at exit, before the communicators end)");
  m.def(
      "unit_offsets",
      [](const std::vector<ParamSpec>& params, const std::vector<UnitSpec>& units) {
        UnitOffsets o = unit_offsets(params, units);
        return py::make_tuple(std::move(o.offsets), std::move(o.lengths));
      },
      py::arg("params"), py::arg("units"),
      "(each parameter's offset in its unit, each unit's length): FullyShardedDataParallel's flat tensors");
  m.def("gathering_strategies", &gathering_strategies,
        "the strategies FullyShardedDataParallel runs (StrategyInfo::sharded_params)");
  m.def(
      "strategy_memory",
      [](const std::string& name, int world) {
        if (world < 1) throw InvalidInput(str("world must be at least 1 (got ", world, ")"));
        const parallel::MemoryPerRank r = parallel::memory_per_rank(parallel::strategy_or_throw(name), world);
        return py::dict(py::arg("floats_per_param") = r.floats_per_param, py::arg("largest_units") = r.largest_units);
      },
      py::arg("strategy"), py::arg("world"),
      "a strategy's memory model at a world size, as its registry entry says (what the CLI's preflight reads): "
      "floats per parameter on each rank, and how many of the largest unit it holds at once");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CommTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const CommError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Comm")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend", [](const Communicator& c) { return std::string(c.backend()); })
      .def_property_readonly("bytes_sent", &Communicator::bytes_sent)
      .def("set_timeout",
           [](Communicator& c, double s) {
             if (!(s > 0 && s <= 365.0 * 86400)) throw InvalidInput(str("timeout: ", s, " s is not in (0, a year]"));
             c.set_timeout(std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(s)));
           })
      .def("all_reduce",
           [](Communicator& c, std::uintptr_t buf, std::size_t n, const std::string& t, const std::string& op) {
             const ElemType e = to_elem(t);
             const ReduceOp o = to_op(op);
             py::gil_scoped_release release;
             c.all_reduce(at(buf), at(buf), n, e, o);
           })
      .def("reduce_scatter",
           [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t n, const std::string& t,
              const std::string& op) {
             const ElemType e = to_elem(t);
             const ReduceOp o = to_op(op);
             py::gil_scoped_release release;
             c.reduce_scatter(at(send), at(recv), n, e, o);
           })
      .def("all_gather",
           [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t n, const std::string& t) {
             const ElemType e = to_elem(t);
             py::gil_scoped_release release;
             c.all_gather(at(send), at(recv), n, e);
           })
      .def("broadcast",
           [](Communicator& c, std::uintptr_t buf, std::size_t n, const std::string& t, int root) {
             const ElemType e = to_elem(t);
             if (root < 0 || root >= c.size()) throw InvalidInput(str("broadcast: no rank ", root));
             py::gil_scoped_release release;
             c.broadcast(at(buf), n, e, root);
           })
      .def("barrier", [](Communicator& c) {
        py::gil_scoped_release release;
        c.barrier();
      });
  // int8 packets with error feedback (src/parallel/int8_wire.hpp), for
  // distopt.torch.ddp_comm_hooks: pointers to contiguous CPU tensors the
  // caller has checked (fp32 values, uint8 packets of int8_packet_bytes(n)).
  m.def("int8_packet_bytes", &parallel::detail::int8_packet_bytes, py::arg("n"));
  m.def(
      "int8_pack",
      [](std::uintptr_t g, std::uintptr_t e, std::size_t n, std::uintptr_t out) {
        py::gil_scoped_release release;
        parallel::detail::int8_pack(static_cast<const float*>(at(g)), static_cast<float*>(at(e)), n,
                                    static_cast<char*>(at(out)));
      },
      py::arg("values"), py::arg("residual"), py::arg("n"), py::arg("packet"),
      "n values (+ the residual, 0: none) into a packet; the residual becomes what it lost");
  m.def(
      "int8_unpack",
      [](std::uintptr_t in, std::size_t n, std::uintptr_t acc, bool add) {
        py::gil_scoped_release release;
        parallel::detail::int8_unpack(static_cast<const char*>(at(in)), n, static_cast<float*>(at(acc)), add);
      },
      py::arg("packet"), py::arg("n"), py::arg("to"), py::arg("add"));
  m.def("mpi_world", &mpi_world, "distopt's MPI communicator over MPI_COMM_WORLD (under mpirun)");
  m.def("mpi_finalize", &mpi_finalize, "finalizes MPI (atexit)");
  m.def("mpi_built", [] {
#ifdef DISTOPT_PYTHON_MPI
    return true;
#else
    return false;
#endif
  });
  m.def("launched_by_mpirun", [] {
#ifdef DISTOPT_PYTHON_MPI
    return launched_by_mpirun();
#else
    return false;
#endif
  });
  m.def(
      "launch_env",
      []() -> py::object {
        const std::optional<LaunchEnv> e = launch_env();
        if (!e) return py::none();
        py::dict d;
        d["launcher"] = e->launcher;
        d["rank"] = e->rank;
        d["world"] = e->world;
        d["local_rank"] = e->local_rank;
        d["one_machine"] = e->one_machine;
        d["job"] = e->job;
        d["master_addr"] = e->master_addr;
        d["master_port"] = e->master_port;
        return d;
      },
      "the launcher's environment (srun's or torchrun's; include/distopt/comm/launch_env.hpp) as a dict, or None");
  m.def(
      "slurm_port", [](const std::string& job) { return slurm_port(job); }, py::arg("job"),
      "the port a SLURM job step's rank 0 serves its store on without MASTER_PORT (launch_env.hpp)");
  m.def("single", [] { return std::shared_ptr<Communicator>(std::move(make_threads_world(1)[0])); },
        "a communicator of one rank");
  m.def(
      "torch_comm",
      [](int rank, int size, py::object ops) { return make_torch_comm(rank, size, std::move(ops)); },
      "a communicator over a Python transport (distopt.torch.comm's torch.distributed one)");

  py::class_<PySharded>(m, "Sharded")
      .def(py::init<std::shared_ptr<Communicator>, const std::string&, const std::string&,
                    const std::vector<ParamSpec>&, py::array_t<float, py::array::c_style | py::array::forcecast>,
                    const py::dict&, std::size_t, const py::dict&, const std::vector<UnitSpec>&, const py::dict&>(),
           py::arg("comm"), py::arg("strategy"), py::arg("rule"), py::arg("params"), py::arg("initial"),
           py::arg("options"), py::arg("bucket_elements"), py::arg("gossip") = py::dict(),
           py::arg("units") = std::vector<UnitSpec>{}, py::arg("strategy_options") = py::dict())
      .def_property_readonly("gathers", &PySharded::gathers)
      .def("unit_padded", &PySharded::unit_padded, py::arg("unit"))
      .def("gather_start", &PySharded::gather_start, py::arg("unit"), py::arg("address"))
      .def("gather_wait", &PySharded::gather_wait, py::arg("unit"))
      .def("deliver_parts", &PySharded::deliver_parts, py::arg("unit"), py::arg("grads"))
      .def_property_readonly("num_units", [](const PySharded& s) { return s.num_units(); })
      .def("param", [](py::object self, std::size_t i) { return self.cast<PySharded&>().param(self, i); })
      .def("grad", [](py::object self, std::size_t i) { return self.cast<PySharded&>().grad(self, i); })
      .def("zero_grads", &PySharded::zero_grads)
      .def("deliver", &PySharded::deliver, py::arg("unit"), py::arg("grad"))
      .def_property_readonly("hooked", &PySharded::hooked)
      .def_property_readonly("next_unit", &PySharded::next_unit)
      .def("step", &PySharded::step, py::arg("max_norm") = 0.0, py::arg("norm_type") = 2.0)
      .def("set_option", &PySharded::set_option)
      .def("group_options", &PySharded::group_options)
      .def("consolidated", &PySharded::consolidated)
      .def("load_consolidated", &PySharded::load_consolidated)
      .def("save", &PySharded::save, py::arg("root"), py::arg("step"), py::arg("keep") = 3)
      .def("load", &PySharded::load)
      .def("memory", &PySharded::memory)
      .def("consensus_distance", &PySharded::consensus_distance)
      .def("averaged", &PySharded::averaged)
      .def_property_readonly("steps", &PySharded::steps)
      .def_property_readonly("load_warning", &PySharded::load_warning)
      .def_property_readonly("bytes_sent", &PySharded::bytes_sent)
      .def_property_readonly("rank", &PySharded::rank)
      .def_property_readonly("world", &PySharded::world)
      .def_property_readonly("strategy", &PySharded::strategy)
      .def_property_readonly("num_params", &PySharded::num_params);

  m.def("gossip_strategies", &gossip_strategies, "the strategies GossipOptimizer runs (per_rank_models)");
  m.def("gossip_option_names", &gossip_option_names,
        "the gossip strategies' keyword options (the command line's flags with underscores)");
  m.def(
      "gossip_options",
      [](const std::string& strategy, const py::dict& options) {
        (void)gossip_options(strategy, options);  // the check alone
      },
      py::arg("strategy"), py::arg("options"),
      "checks gossip options for a strategy (ValueError naming an unknown or misfit one)");
  m.def(
      "replay_strategy",
      [](const std::string& strategy, const std::string& rule, const std::vector<ParamSpec>& params,
         py::array_t<float, py::array::c_style | py::array::forcecast> initial, const py::dict& options,
         const py::dict& gossip, const std::vector<std::vector<std::vector<float>>>& grads) {
        const parallel::GossipOptions g = parallel::strategy_or_throw(strategy).per_rank_models
                                              ? gossip_options(strategy, gossip)
                                              : parallel::GossipOptions{};
        const OptionMap o = to_options(options);
        const std::vector<float> init(initial.data(), initial.data() + initial.size());
        py::gil_scoped_release release;
        return replay_strategy(strategy, rule, params, init, o, g, grads);
      },
      py::arg("strategy"), py::arg("rule"), py::arg("params"), py::arg("initial"), py::arg("options"),
      py::arg("gossip"), py::arg("grads"),
      "the C++ strategy over the threads backend stepped with grads[step][rank] (each rank's flat gradient, "
      "as torch computed it): each rank's parameters after the last step (the Python optimizers' reference)");

  py::class_<PyPushSum>(m, "PushSum")
      .def(py::init<std::shared_ptr<Communicator>, const std::string&, std::size_t, int>(), py::arg("comm"),
           py::arg("topology"), py::arg("dim"), py::arg("peers_per_iteration") = 1)
      .def("mix", &PyPushSum::mix);
}

}  // namespace distopt::python
