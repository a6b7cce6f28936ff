// The gossip strategies' options from Python's keywords (sharded.hpp):
// GossipOptimizer's and GossipDataParallel's options by the command line's
// flag names, each checked for its type and for the strategy it fits.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "distopt/core/error.hpp"
#include "distopt/parallel/strategy.hpp"
#include "sharded.hpp"

namespace distopt::python {

namespace {

// ---- gossip options ---------------------------------------------------------

// A Python keyword of GossipOptions and the member it sets.
struct GossipKey {
  const char* name;
  std::variant<std::string parallel::GossipOptions::*, int parallel::GossipOptions::*,
               double parallel::GossipOptions::*, bool parallel::GossipOptions::*>
      member;
};

using G = parallel::GossipOptions;
const GossipKey kGossipKeys[] = {
    {"topology", &G::topology},
    {"peers_per_iteration", &G::peers_per_iteration},
    {"synch_freq", &G::synch_freq},
    {"slowmo_base", &G::slowmo_base},
    {"localsgd_frequency", &G::localsgd_frequency},
    {"slowmo_frequency", &G::slowmo_frequency},
    {"slowmo_momentum", &G::slowmo_momentum},
    {"slowmo_lr", &G::slowmo_lr},
    {"sync_every", &G::sync_every},
    {"outer_optimizer", &G::outer_optimizer},
    {"outer_lr", &G::outer_lr},
    {"outer_momentum", &G::outer_momentum},
    {"fragments", &G::fragments},
    {"sync_delay", &G::sync_delay},
    {"fragment_alpha", &G::fragment_alpha},
    {"fragment_carry", &G::fragment_carry},
    {"outer_dtype", &G::outer_dtype},
    {"outer_error_feedback", &G::outer_error_feedback},
};

// `v` as the member's type: a word, a whole number, a number or a bool
// (an int is no bool, a bool no number: both are mistakes in Python).
void set_gossip(G& g, const GossipKey& key, py::handle v) {
  const std::string name = key.name;
  std::visit(
      [&](auto member) {
        using T = std::remove_reference_t<decltype(g.*member)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!py::isinstance<py::str>(v)) throw InvalidInput(str(name, " must be a string"));
          g.*member = v.cast<std::string>();
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!py::isinstance<py::bool_>(v)) throw InvalidInput(str(name, " must be True or False"));
          g.*member = v.cast<bool>();
        } else if constexpr (std::is_same_v<T, int>) {
          // Python's int and numpy's integers (anything with __index__).
          PyObject* i = py::isinstance<py::bool_>(v) ? nullptr : PyNumber_Index(v.ptr());
          if (i == nullptr) {
            PyErr_Clear();
            throw InvalidInput(str(name, " must be a whole number"));
          }
          int overflow = 0;
          const long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
          Py_DECREF(i);
          if (overflow != 0 || x < INT32_MIN || x > INT32_MAX) throw InvalidInput(str(name, " is out of range"));
          g.*member = static_cast<int>(x);
        } else {
          // Python's numbers and numpy's (not bools, not strings).
          if (py::isinstance<py::bool_>(v) || py::isinstance<py::str>(v) || !PyNumber_Check(v.ptr()))
            throw InvalidInput(str(name, " must be a number"));
          const double x = PyFloat_AsDouble(v.ptr());
          if (x == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            throw InvalidInput(str(name, " must be a number"));
          }
          g.*member = x;
        }
      },
      key.member);
}

}  // namespace

std::vector<std::string> gossip_option_names() {
  std::vector<std::string> out;
  for (const GossipKey& k : kGossipKeys) out.emplace_back(k.name);
  return out;
}

parallel::GossipOptions gossip_options(const std::string& strategy, const py::dict& options) {
  const parallel::StrategyInfo& info = parallel::strategy_or_throw(strategy);
  G g;
  std::vector<std::string> given;
  for (auto [k, v] : options) {
    const std::string name = py::str(k);
    const GossipKey* key = nullptr;
    for (const GossipKey& c : kGossipKeys)
      if (name == c.name) key = &c;
    if (key == nullptr) {
      std::string known;
      for (const std::string& n : gossip_option_names()) known += (known.empty() ? "" : ", ") + n;
      throw InvalidInput(str("no gossip option '", name, "' (there are ", known, ")"));
    }
    set_gossip(g, *key, v);
    given.push_back(name);
  }
  for (const std::string& name : given) {
    std::string flag = name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    const std::string why = info.option_misfit ? info.option_misfit(info, flag, g)
                                               : str(name, " applies to the gossip strategies, not ", strategy);
    if (!why.empty()) throw InvalidInput(str(name, ": ", why));
  }
  return g;
}

}  // namespace distopt::python
