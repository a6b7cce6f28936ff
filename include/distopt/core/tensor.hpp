// Tensor views: a pointer, an element type, a shape and a memory space. Views never own
// memory; flat buffers (core/buffer.hpp) do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/core/device.hpp"
#include "distopt/core/dtype.hpp"

namespace distopt {

using Shape = std::vector<std::int64_t>;

// Number of elements of a shape; 1 for a scalar (empty shape).
std::int64_t numel(const Shape& shape);
std::string to_string(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  Device device = Device::cpu;  // where `data` lives

  std::int64_t numel() const { return distopt::numel(shape); }
  std::size_t size_bytes() const { return static_cast<std::size_t>(numel()) * size_of(dtype); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// InvalidInput unless `t` lives in host memory: for code that reads
// tensors on the CPU (`what` names it: "clipping", "the loss scaler").
void require_on_cpu(const TensorView& t, std::string_view what);

}  // namespace distopt
