// Quantized optimizer state on a CUDA device (src/cuda/quantized.cuh):
// every rule with quantizable state gives the CPU's bits -- parameters,
// values and block scales -- under bf16, int8 and int4, in IEEE and in
// flush-denormals mode, for f32 and bf16 parameters; the state loads onto
// the device and back and continues as on the CPU; a skipped step changes
// nothing. Label `gpu`: "skipped: no CUDA device" where there is none.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "distopt/core/device.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/optim/quant.hpp"
#include "gpu_support.hpp"

namespace distopt {
namespace {

using namespace gpu_testing;

std::vector<Case> quantized_cases(std::string_view storage) {
  std::vector<Case> out = {
      {"adam", {}},
      {"adam", {{"amsgrad", true}, {"weight_decay", 0.1}, {"maximize", true}}},
      {"adamw", {{"lr", 1e-2}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.1}, {"weight_decay", 0.01}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}}},
      {"lion", {{"weight_decay", 0.1}}},
  };
  for (Case& c : out) c.options[std::string(kStateDTypeOption)] = storage;
  return out;
}

// Tensors below quant::kMinElements (fp32 state beside the quantized, in
// the same step), at it, one over (a block of one element; int4: an odd
// count, whose last byte holds one code), several blocks with a partial
// last one, an empty tensor.
const std::vector<std::size_t> kQuantizedSizes{1, 4095, 4096, 4097, 70001, 0, 33000};

// Tensor 3's first 256 gradients are 0 at every step (blocks whose state
// stays 0: scale 0, the zero code) and its next 256 denormal (blocks whose
// scale is denormal, or 0 where denormals flush).
void zero_and_denormal(Tensors& t) {
  const std::size_t k = 3, es = size_of(t.dtype);
  ASSERT_GE(t.sizes[k], 512u);
  std::vector<unsigned char> host(512 * es, 0);
  for (std::size_t i = 256; i < 512; ++i) {
    const std::uint32_t f32 = 0x00000100u + static_cast<std::uint32_t>(i);
    const auto b16 = static_cast<std::uint16_t>(1 + i % 0x7F);  // a bf16 or f16 denormal
    std::memcpy(&host[i * es], es == 4 ? static_cast<const void*>(&f32) : &b16, es);
  }
  copy_bytes(static_cast<char*>(t.grads[k].data()) + t.offset * es, t.device, host.data(), Device::cpu, host.size());
}

TEST(GpuLowbit, QuantizedStateHasTheCpuBits) {
  NEED_DEVICE();
  for (std::string_view storage : {"int8", "int4", "bf16"})
    for (const Case& c : quantized_cases(storage))
      for (DType t : {DType::f32, DType::bf16})
        for (bool flush : {false, true}) {
          SCOPED_TRACE(std::string(storage));
          expect_same_bits(c, t, flush, 0, 6, kQuantizedSizes, zero_and_denormal);
        }
}

// The CPU's state_dict (values and scales) loaded onto the device, stepped
// there, and its state_dict loaded back into a CPU optimizer: every step
// gives the bits of the CPU optimizer that never moved.
TEST(GpuLowbit, QuantizedStateMovesToTheDeviceAndBack) {
  NEED_DEVICE();
  for (std::string_view storage : {"int8", "int4", "bf16"}) {
    SCOPED_TRACE(std::string(storage));
    const OptionMap options{{std::string(kStateDTypeOption), storage}, {"weight_decay", 0.05}};
    const std::vector<std::size_t> sizes{5001, 100};
    Tensors cpu(Device::cpu, DType::f32, sizes), gpu(Device::cuda, DType::f32, sizes),
        back(Device::cpu, DType::f32, sizes);
    Optimizer a("adamw", cpu.params(), options), b("adamw", gpu.params(), options), c("adamw", back.params(), options);
    auto grads = [&](std::uint64_t seed) {
      for (std::size_t k = 0; k < sizes.size(); ++k)
        cpu.set(cpu.grads[k], k, seed), gpu.set(gpu.grads[k], k, seed), back.set(back.grads[k], k, seed);
    };
    auto same_params = [&](Tensors& to) {  // the parameters are the caller's: the CPU's copied over
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const auto host = cpu.bytes(k);
        copy_bytes(to.values[k].data(), to.device, host.data(), Device::cpu, host.size());
      }
    };
    grads(3);
    a.step();
    a.step();
    b.load_state_dict(a.state_dict());
    same_params(gpu);
    for (std::uint64_t seed : {4, 5}) {
      grads(seed);
      a.step();
      b.step();
      for (std::size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(cpu.bytes(k), gpu.bytes(k)) << "seed " << seed;
    }
    c.load_state_dict(b.state_dict());
    same_params(back);
    grads(6);
    a.step();
    c.step();
    for (std::size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(cpu.bytes(k), back.bytes(k));
    const StateDict da = a.state_dict(), dc = c.state_dict();
    for (const auto& [i, entry] : da.state)
      for (const auto& [key, value] : entry)
        if (const auto* t = std::get_if<StateTensor>(&value)) {
          EXPECT_EQ(t->data, std::get<StateTensor>(dc.state.at(i).at(key)).data) << key;
        }
  }
}

// GradScaler's protocol: a step whose device flag is set changes no code
// and no scale.
TEST(GpuLowbit, AQuantizedStepWhoseSkipFlagIsSetChangesNothing) {
  NEED_DEVICE();
  const std::vector<std::size_t> sizes{4097, 3};
  for (std::string_view storage : {"int8", "int4", "bf16"}) {
    SCOPED_TRACE(std::string(storage));
    const OptionMap options{{std::string(kStateDTypeOption), storage}};
    Tensors flagged(Device::cuda, DType::f32, sizes), plain(Device::cuda, DType::f32, sizes);
    Optimizer a("adam", flagged.params(), options), b("adam", plain.params(), options);
    a.set_cuda_stream(std::uintptr_t{0});
    Buffer zero(sizeof(float), 0, Device::cuda, "flag 0"), one(sizeof(float), 0, Device::cuda, "flag 1");
    const float value = 1.0f, none = 0.0f;
    copy_bytes(one.data(), Device::cuda, &value, Device::cpu, sizeof value);
    copy_bytes(zero.data(), Device::cuda, &none, Device::cpu, sizeof none);
    for (int step = 0; step < 5; ++step) {
      const bool skip = step == 2;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        flagged.set(flagged.grads[k], k, 30 + step), plain.set(plain.grads[k], k, 30 + step);
      a.skip_next_step_if(static_cast<const float*>(skip ? one.data() : zero.data()));
      a.step();
      if (!skip) b.step();
    }
    a.settle_skipped_step();
    for (std::size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(flagged.bytes(k), plain.bytes(k)) << "parameter " << k;
    const StateDict da = a.state_dict(), db = b.state_dict();
    ASSERT_EQ(da.state.size(), db.state.size());
    for (const auto& [i, entry] : db.state)
      for (const auto& [key, value] : entry)
        if (const auto* t = std::get_if<StateTensor>(&value)) {
          EXPECT_EQ(std::get<StateTensor>(da.state.at(i).at(key)).data, t->data) << key << " of " << i;
        }
  }
}

}  // namespace
}  // namespace distopt
