// The communicator over a torch.distributed process group (distopt._core's
// torch_comm; python/distopt/torch/comm.py's _TorchOps is its transport;
// docs/python.md): distopt's collectives built from the group's
// point-to-point messages. torch_group_comm.cpp has it.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "bindings.hpp"
#include "distopt/comm/communicator.hpp"

namespace distopt::python {

// A communicator of `size` ranks, this one `rank`, over the Python
// transport `ops` (its isend, irecv and wait).
std::shared_ptr<Communicator> make_torch_comm(int rank, int size, py::object ops);

}  // namespace distopt::python
