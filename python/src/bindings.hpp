// What the files of distopt._core share (python/src/; docs/python.md).
#pragma once

#include <pybind11/pybind11.h>

#include <string_view>

#include "distopt/optim/options.hpp"

namespace distopt::python {

namespace py = pybind11;

// A Python value as an option: bool, number (None: NaN, the rules'
// "unset"), a pair or triple of numbers, or a word; and back.
OptionValue to_option(std::string_view key, py::handle v);
py::object from_option(const OptionValue& v);
OptionMap to_options(const py::dict& d);

// The communicators and the sharded optimizer (sharded_bindings.cpp).
void bind_sharded(py::module_& m);

}  // namespace distopt::python
