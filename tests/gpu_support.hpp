// The GPU tests' parameters and their comparison with the CPU
// (gpu_test.cpp, gpu_lowbit_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/quant.hpp"

namespace distopt::gpu_testing {

#define NEED_DEVICE()                                                                       \
  do {                                                                                      \
    if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason(); \
  } while (0)

// Deterministic values in about [-2, 2], with exact zeros, tiny ones
// (denormal after a few steps' products) and denormals among them. The
// denormals are made from bits, not by arithmetic, so that they exist under
// the flush-denormals mode too (a product would be flushed to zero).
inline float value_at(std::uint64_t seed, std::size_t i) {
  std::uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  const float u = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 4.0f - 2.0f;
  if (x % 17 == 0) return 0.0f;
  if (x % 23 == 0) return u * 1e-30f;
  if (x % 29 == 0)
    return std::bit_cast<float>(static_cast<std::uint32_t>((x >> 8) & 0x807FFFFFull) | 1u);  // denormal, either sign
  return u;
}

// A set of parameters with gradients, on one device. Each parameter and
// gradient is a view that starts `offset` elements into its buffer (1: not
// aligned for the kernel's vector accesses).
struct Tensors {
  Device device;
  DType dtype;
  std::vector<std::size_t> sizes;
  std::size_t offset;
  std::vector<Buffer> values, grads;
  std::vector<Shape> shapes;  // empty: 1-D of `sizes`

  Tensors(Device d, DType t, std::vector<std::size_t> n, std::size_t off = 0)
      : device(d), dtype(t), sizes(std::move(n)), offset(off) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      values.emplace_back((sizes[k] + offset) * size_of(t), 0, d, "test parameter");
      grads.emplace_back((sizes[k] + offset) * size_of(t), 1, d, "test gradient");
      set(values[k], k, 1000);
    }
  }
  Tensors(Device d, DType t, const std::vector<Shape>& s) : Tensors(d, t, numels(s)) { shapes = s; }
  static std::vector<std::size_t> numels(const std::vector<Shape>& s) {
    std::vector<std::size_t> n;
    for (const Shape& x : s) n.push_back(static_cast<std::size_t>(numel(x)));
    return n;
  }
  // Fills b with element type `dtype` from value_at(seed + k, i), i counted from the view's start.
  void set(Buffer& b, std::size_t k, std::uint64_t seed) {
    std::vector<unsigned char> host((sizes[k] + offset) * size_of(dtype));
    dispatch_dtype(dtype, [&]<class T>() {
      T* h = reinterpret_cast<T*>(host.data());
      for (std::size_t i = 0; i < sizes[k] + offset; ++i) h[i] = from_float<T>(value_at(seed + k, i - offset));
    });
    copy_bytes(b.data(), device, host.data(), Device::cpu, host.size());
  }
  std::vector<Param> params() {
    std::vector<Param> ps;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const Shape shape = shapes.empty() ? Shape{static_cast<std::int64_t>(sizes[k])} : shapes[k];
      const std::size_t skip = offset * size_of(dtype);
      ps.push_back({str("p", k),
                    {static_cast<char*>(values[k].data()) + skip, dtype, shape, device},
                    {static_cast<char*>(grads[k].data()) + skip, dtype, shape, device},
                    true});
    }
    return ps;
  }
  // Element i of the view of buffer b (values or grads) as a float.
  float at(const Buffer& b, std::size_t i) const {
    std::vector<unsigned char> host(size_of(dtype));
    copy_bytes(host.data(), Device::cpu, static_cast<const char*>(b.data()) + (i + offset) * size_of(dtype), device,
               host.size());
    return dispatch_dtype(dtype, [&]<class T>() { return to_float(*reinterpret_cast<const T*>(host.data())); });
  }
  std::vector<unsigned char> bytes(std::size_t k) const {
    std::vector<unsigned char> host(values[k].size_bytes());
    copy_bytes(host.data(), Device::cpu, values[k].data(), device, host.size());
    return host;
  }
};

struct Case {
  std::string rule;
  OptionMap options;
};

// Runs `steps` steps of the case on the CPU and on the device, with new
// gradients each step (and one parameter without a gradient at step 2),
// and compares parameters and state bit for bit after every step.
// The sizes of expect_same_bits: around the pointwise launcher's chunk
// (16384) and block (512), and an empty tensor.
inline const std::vector<std::size_t> kSizes{1, 511, 16384, 16385, 70001, 0, 3};

// A quantized state's codes and scales, compared byte for byte (int4 with
// an odd count: the last byte's low nibble, the other is no element's).
inline void expect_same_codes(Optimizer& a, Optimizer& b, std::size_t k) {
  const std::vector<Optimizer::QuantizedView> qa = a.quantized_views(k), qb = b.quantized_views(k);
  ASSERT_EQ(qa.size(), qb.size()) << "parameter " << k;
  for (std::size_t j = 0; j < qa.size(); ++j) {
    const Optimizer::HostQuantized ha(qa[j], true), hb(qb[j], true);
    const Optimizer::QuantizedView &x = ha.view(), &y = hb.view();
    std::vector<std::uint8_t> cx(x.codes, x.codes + quant::code_bytes(x.dtype, x.elements)),
        cy(y.codes, y.codes + quant::code_bytes(y.dtype, y.elements));
    if (x.dtype == quant::StateDType::int4 && x.elements % 2 == 1 && !cx.empty()) cx.back() &= 0x0F, cy.back() &= 0x0F;
    EXPECT_EQ(cx, cy) << "codes of '" << x.key << "' of parameter " << k;
    const std::size_t blocks = quant::num_blocks(x.dtype, x.elements);
    if (blocks > 0) {
      EXPECT_EQ(0, std::memcmp(x.absmax, y.absmax, blocks * sizeof(float))) << "scales of '" << x.key << "' of " << k;
    }
  }
}

// shape_grads(tensors), where given, changes the gradients after each
// step's are set, on both sides.
inline void expect_same_bits(const Case& c, DType dtype, bool flush, std::size_t offset = 0, int steps = 6,
                             const std::vector<std::size_t>& sizes = kSizes,
                             const std::function<void(Tensors&)>& shape_grads = {}) {
  SCOPED_TRACE(c.rule + " " + std::string(name_of(dtype)) + (flush ? " flush" : " ieee") + " offset " +
               std::to_string(offset));
  const DenormalMode mode(flush ? DenormalMode::flush : DenormalMode::ieee);
  Tensors cpu(Device::cpu, dtype, sizes, offset), gpu(Device::cuda, dtype, sizes, offset);
  Optimizer a(c.rule, cpu.params(), c.options), b(c.rule, gpu.params(), c.options);
  for (int step = 0; step < steps; ++step) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      cpu.set(cpu.grads[k], k, 7 * step + 1);
      gpu.set(gpu.grads[k], k, 7 * step + 1);
      const bool has = !(step == 2 && k == 1);
      a.param(k).has_grad = has;
      b.param(k).has_grad = has;
    }
    if (shape_grads) shape_grads(cpu), shape_grads(gpu);
    a.step();
    b.step();
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      if (cpu.bytes(k) != gpu.bytes(k)) {
        // The first elements that differ, with what went into them.
        std::string detail;
        const std::size_t es = size_of(dtype);
        const auto x = cpu.bytes(k), y = gpu.bytes(k);
        for (std::size_t i = 0, shown = 0; i < sizes[k] && shown < 3; ++i) {
          if (std::memcmp(&x[(i + offset) * es], &y[(i + offset) * es], es) == 0) continue;
          ++shown;
          auto hex = [](float v) { return str(std::hex, std::bit_cast<std::uint32_t>(v), std::dec); };
          const float before = value_at(1000 + k, i);
          detail += str("; [", i, "] cpu ", hex(cpu.at(cpu.values[k], i)), " gpu ", hex(gpu.at(gpu.values[k], i)),
                        " grad ", hex(cpu.at(cpu.grads[k], i)), " initially ", hex(before), " as dtype ",
                        dispatch_dtype(dtype, [&]<class T>() { return hex(to_float(from_float<T>(before))); }));
          for (const char* key : {"prev", "step_size", "exp_avg", "exp_avg_sq", "momentum_buffer", "master_param"}) {
            try {
              detail += str(" ", key, " ", a.state_tensor(k, key)[i], "/", b.state_tensor(k, key)[i]);
            } catch (const InvalidInput&) {
            }
          }
        }
        FAIL() << "parameter " << k << " after step " << step << detail;
      }
      ASSERT_EQ(a.has_state(k), b.has_state(k));
      expect_same_codes(a, b, k);
    }
  }
  const StateDict da = a.state_dict(), db = b.state_dict();
  ASSERT_EQ(da.state.size(), db.state.size());
  for (const auto& [i, entry] : da.state)
    for (const auto& [key, value] : entry) {
      const auto& other = db.state.at(i).at(key);
      if (std::holds_alternative<double>(value)) {
        EXPECT_EQ(std::get<double>(value), std::get<double>(other)) << key;
      } else {
        const auto& x = std::get<StateTensor>(value).data;
        const auto& y = std::get<StateTensor>(other).data;
        ASSERT_EQ(x.size(), y.size());
        EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << "state '" << key << "' of " << i;
      }
    }
}

}  // namespace distopt::gpu_testing
