// The optimizer on a CUDA device (docs/gpu.md): every pointwise rule gives
// the CPU's bits, in IEEE and in flush-denormals mode, for f32, bf16 and
// f16 parameters; device state reads back and reloads; failures are one
// line. Every test here needs a device and says "skipped: no CUDA device"
// where there is none (CTest label `gpu`).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "distopt/core/buffer.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/optim/optimizer.hpp"
#include "gpu_support.hpp"

namespace distopt {
namespace {

using namespace gpu_testing;

std::vector<Case> cases() {
  return {
      {"sgd", {{"lr", 0.1}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.1}, {"weight_decay", 0.01}}},
      {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}, {"maximize", true}}},
      {"adam", {}},
      {"adam", {{"amsgrad", true}, {"weight_decay", 0.1}, {"maximize", true}}},
      {"adamw", {{"lr", 1e-2}}},
      {"adamw", {{"amsgrad", true}}},
      {"adamax", {{"weight_decay", 0.01}}},
      {"adadelta", {{"weight_decay", 0.01}}},
      {"adagrad", {{"lr_decay", 0.01}, {"initial_accumulator_value", 0.1}}},
      {"rmsprop", {}},
      {"rmsprop", {{"centered", true}, {"momentum", 0.9}, {"weight_decay", 0.01}}},
      {"nadam", {{"weight_decay", 0.01}}},
      {"nadam", {{"decoupled_weight_decay", true}, {"weight_decay", 0.1}}},
      {"radam", {}},
      {"radam", {{"decoupled_weight_decay", true}, {"weight_decay", 0.1}}},
      {"rprop", {}},
      {"asgd", {{"t0", 2.0}, {"weight_decay", 0.01}}},
      {"lion", {{"weight_decay", 0.1}}},
  };
}

TEST(Gpu, EveryPointwiseRuleHasTheCpuBits) {
  NEED_DEVICE();
  for (const Case& c : cases())
    for (DType t : {DType::f32, DType::bf16, DType::f16})
      for (bool flush : {false, true}) expect_same_bits(c, t, flush);
}

// Views one element into their buffers are not aligned for the kernel's
// four-element accesses and take its one-element path.
TEST(Gpu, UnalignedViewsHaveTheCpuBits) {
  NEED_DEVICE();
  for (const Case& c : cases())
    for (DType t : {DType::f32, DType::bf16}) expect_same_bits(c, t, false, 1);
}

TEST(Gpu, StateLoadedOnTheDeviceContinuesAsOnTheCpu) {
  NEED_DEVICE();
  const std::vector<std::size_t> sizes{1000, 33};
  Tensors cpu(Device::cpu, DType::bf16, sizes), gpu(Device::cuda, DType::bf16, sizes);
  Optimizer a("adamw", cpu.params()), b("adamw", gpu.params());
  for (std::size_t k = 0; k < sizes.size(); ++k) cpu.set(cpu.grads[k], k, 3), gpu.set(gpu.grads[k], k, 3);
  a.step();
  b.load_state_dict(a.state_dict());  // CPU state onto the device
  for (std::size_t k = 0; k < sizes.size(); ++k) cpu.set(cpu.grads[k], k, 4), gpu.set(gpu.grads[k], k, 4);
  // The parameters themselves are the caller's: copy the CPU's over.
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const auto host = cpu.bytes(k);
    copy_bytes(gpu.values[k].data(), Device::cuda, host.data(), Device::cpu, host.size());
  }
  a.step();
  b.step();
  for (std::size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(cpu.bytes(k), gpu.bytes(k));
  const auto sa = a.state_tensor(0, "exp_avg_sq");
  const std::vector<float> x(sa.begin(), sa.end());
  const auto sb = b.state_tensor(0, "exp_avg_sq");
  EXPECT_EQ(0, std::memcmp(x.data(), sb.data(), x.size() * sizeof(float)));
}

// torch's current stream (the legacy default stream, handle 0): the steps are
// enqueued without waiting, ten of them in a row (more than the staging
// ring's slots), and give the bits of steps complete on return; a
// parameter reset in between starts afresh on both.
TEST(Gpu, StepsEnqueuedOnACallersStreamHaveTheOwnStreamsBits) {
  NEED_DEVICE();
  const std::vector<std::size_t> sizes{70001, 1, 4096};
  Tensors own(Device::cuda, DType::f32, sizes), caller(Device::cuda, DType::f32, sizes);
  Optimizer a("adam", own.params(), {{"amsgrad", true}}), b("adam", caller.params(), {{"amsgrad", true}});
  b.set_cuda_stream(std::uintptr_t{0});
  for (int step = 0; step < 10; ++step) {
    for (std::size_t k = 0; k < sizes.size(); ++k)
      own.set(own.grads[k], k, 10 + step), caller.set(caller.grads[k], k, 10 + step);
    if (step == 6) a.reset_state(1), b.reset_state(1);
    a.step();
    b.step();
  }
  synchronize_stream(0);
  for (std::size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(own.bytes(k), caller.bytes(k)) << "parameter " << k;
  EXPECT_EQ(b.state_scalar(1, "step"), 4.0);  // reset before the seventh of ten steps
}

// GradScaler's protocol: a step whose device flag is not 0 changes no
// parameter or state tensor, and its host side (Adam's step count; NAdam's
// mu_product) is put back; a step that made the state leaves none (SGD's
// next step is then a first step: b = g, not (1 - dampening) g). The same
// bits as not stepping at all.
TEST(Gpu, AStepWhoseSkipFlagIsSetIsUndoneOnTheDeviceAndTheHost) {
  NEED_DEVICE();
  const std::vector<std::size_t> sizes{4097, 3};
  for (const auto& [rule, options] : std::vector<std::pair<std::string, OptionMap>>{
           {"adam", {}}, {"nadam", {}}, {"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.5}}}}) {
    SCOPED_TRACE(rule);
    Tensors flagged(Device::cuda, DType::bf16, sizes), plain(Device::cuda, DType::bf16, sizes);
    Optimizer a(rule, flagged.params(), options), b(rule, plain.params(), options);
    a.set_cuda_stream(std::uintptr_t{0});
    Buffer zero(sizeof(float), 0, Device::cuda, "flag 0"), one(sizeof(float), 0, Device::cuda, "flag 1");
    const float value = 1.0f;
    copy_bytes(one.data(), Device::cuda, &value, Device::cpu, sizeof value);
    for (int step = 0; step < 6; ++step) {
      const bool skip = step == 0 || step == 3;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        flagged.set(flagged.grads[k], k, 20 + step), plain.set(plain.grads[k], k, 20 + step);
      a.skip_next_step_if(static_cast<const float*>(skip ? one.data() : zero.data()));
      a.step();
      if (!skip) b.step();
      if (step == 0) {
        a.settle_skipped_step();
        EXPECT_FALSE(a.has_state(0));
      }
    }
    a.settle_skipped_step();
    for (std::size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(flagged.bytes(k), plain.bytes(k)) << "parameter " << k;
    const StateDict da = a.state_dict(), db = b.state_dict();
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (const auto& [key, value] : db.state.at(i)) {
        if (std::holds_alternative<double>(value)) EXPECT_EQ(std::get<double>(da.state.at(i).at(key)), std::get<double>(value)) << key;
        else EXPECT_EQ(std::get<StateTensor>(da.state.at(i).at(key)).data, std::get<StateTensor>(value).data) << key;
      }
  }
}

// The tensor_stats rules (LAMB, LARS, Adafactor): their norms are summed
// on the device in another order than the CPU's lane sums (stats.cuh), so
// the results agree within 1e-6 of each tensor's largest magnitude rather
// than bit for bit; two device runs agree bit for bit. Shapes: vectors
// around the kernels' chunk (16384), matrices with more rows than a column
// sum's band (256) and a 3-D tensor (Adafactor factors the last two
// dimensions), and an empty one.
std::vector<Case> stats_cases() {
  return {
      {"lamb", {}},
      {"lamb", {{"adam_w_mode", false}, {"weight_decay", 0.1}, {"max_grad_norm", 0.5}, {"use_nvlamb", true}}},
      {"lars", {{"lr", 0.1}}},
      {"lars", {{"lr", 0.1}, {"weight_decay", 1e-4}, {"momentum", 0.9}}},
      {"lars", {{"lr", 0.1}, {"always_adapt", true}, {"trust_clip", true}, {"momentum", 0.9}, {"nesterov", true}}},
      {"adafactor", {}},
      {"adafactor", {{"lr", 1e-2}, {"relative_step", false}, {"beta1", 0.9}, {"weight_decay", 0.01}}},
  };
}

std::vector<Shape> stats_shapes() {
  return {{1}, {16385}, {300, 70}, {2, 3, 50}, {0}, {7, 1}, {1, 513}};
}

// The largest |x| over the parameter, and the largest |x - y| against it.
std::pair<float, float> largest_and_difference(const Tensors& x, const Tensors& y, std::size_t k) {
  float big = 0.0f, diff = 0.0f;
  for (std::size_t i = 0; i < x.sizes[k]; ++i) {
    const float a = x.at(x.values[k], i), b = y.at(y.values[k], i);
    big = std::max(big, std::fabs(a));
    diff = std::max(diff, std::fabs(a - b));
  }
  return {big, diff};
}

// Steps rule `c` over `shapes` on the CPU, on the device, and on the device
// enqueued on a caller's stream, `steps` times with the same gradients
// (parameter 2 without one at step 2 where `gap`): after each step the two
// device runs agree bit for bit and the device is within `rel` of each
// tensor's largest magnitude of the CPU (plus a bf16 rounding). Returns the
// CPU's and the device's state.
std::pair<StateDict, StateDict> against_the_cpu(const Case& c, DType t, const std::vector<Shape>& shapes, int steps,
                                                float rel, bool gap) {
  Tensors cpu(Device::cpu, t, shapes), gpu(Device::cuda, t, shapes), again(Device::cuda, t, shapes);
  Optimizer a(c.rule, cpu.params(), c.options), b(c.rule, gpu.params(), c.options),
      b2(c.rule, again.params(), c.options);
  b2.set_cuda_stream(std::uintptr_t{0});  // enqueued on a caller's stream: the same bits
  for (int step = 0; step < steps; ++step) {
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      cpu.set(cpu.grads[k], k, 7 * step + 1);
      gpu.set(gpu.grads[k], k, 7 * step + 1);
      again.set(again.grads[k], k, 7 * step + 1);
      const bool has = !(gap && step == 2 && k == 2);
      a.param(k).has_grad = b.param(k).has_grad = b2.param(k).has_grad = has;
    }
    a.step();
    b.step();
    b2.step();
    synchronize_stream(0);
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      EXPECT_EQ(gpu.bytes(k), again.bytes(k)) << "parameter " << k << " after step " << step;
      const auto [big, diff] = largest_and_difference(cpu, gpu, k);
      EXPECT_LE(diff, rel * big + (t == DType::f32 ? 0.0f : big / 128.0f))
          << "parameter " << k << " after step " << step;
    }
  }
  return {a.state_dict(), b.state_dict()};
}

TEST(Gpu, TensorStatsRulesAgreeWithTheCpuAndRepeatTheirBits) {
  NEED_DEVICE();
  for (const Case& c : stats_cases())
    for (DType t : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(c.rule + " " + std::string(name_of(t)));
      const auto [da, db] = against_the_cpu(c, t, stats_shapes(), 5, 1e-6f, true);
      // The small state (Adafactor's row and column averages) and the
      // moments agree as the parameters do.
      for (const auto& [i, entry] : da.state)
        for (const auto& [key, value] : entry) {
          if (std::holds_alternative<double>(value)) {
            EXPECT_EQ(std::get<double>(value), std::get<double>(db.state.at(i).at(key))) << key;
            continue;
          }
          const auto& x = std::get<StateTensor>(value).data;
          const auto& y = std::get<StateTensor>(db.state.at(i).at(key)).data;
          ASSERT_EQ(x.size(), y.size()) << key;
          float big = 0.0f, diff = 0.0f;
          for (std::size_t e = 0; e < x.size(); ++e) {
            big = std::max(big, std::fabs(x[e]));
            diff = std::max(diff, std::fabs(x[e] - y[e]));
          }
          EXPECT_LE(diff, 1e-5f * big) << "state '" << key << "' of " << i;
        }
    }
}

// GradScaler's flag on a tensor_stats rule: read on the host before the
// passes; a flagged step changes nothing, its step count is put back.
TEST(Gpu, ATensorStatsStepWhoseSkipFlagIsSetChangesNothing) {
  NEED_DEVICE();
  const std::vector<Shape> shapes{{300, 70}, {33}};
  Tensors flagged(Device::cuda, DType::f32, shapes), plain(Device::cuda, DType::f32, shapes);
  Optimizer a("adafactor", flagged.params()), b("adafactor", plain.params());
  Buffer zero(sizeof(float), 0, Device::cuda, "flag 0"), one(sizeof(float), 0, Device::cuda, "flag 1");
  const float value = 1.0f, nothing = 0.0f;
  copy_bytes(one.data(), Device::cuda, &value, Device::cpu, sizeof value);
  copy_bytes(zero.data(), Device::cuda, &nothing, Device::cpu, sizeof nothing);
  for (int step = 0; step < 4; ++step) {
    const bool skip = step == 2;
    for (std::size_t k = 0; k < shapes.size(); ++k)
      flagged.set(flagged.grads[k], k, 30 + step), plain.set(plain.grads[k], k, 30 + step);
    a.skip_next_step_if(static_cast<const float*>(skip ? one.data() : zero.data()));
    a.step();
    if (!skip) b.step();
  }
  a.settle_skipped_step();
  for (std::size_t k = 0; k < shapes.size(); ++k) EXPECT_EQ(flagged.bytes(k), plain.bytes(k)) << "parameter " << k;
  EXPECT_EQ(a.state_scalar(0, "step"), 3.0);
}

// Muon: the momentum and the step are the CPU's per-element math (so the
// momentum buffer is the CPU's bit for bit), the Newton-Schulz products
// cuBLAS's SGEMM in another order than Eigen's: the parameters agree within
// 1e-5 of each tensor's largest magnitude; two device runs, one on a
// caller's stream, agree bit for bit. Wide, tall, square, one-row and empty
// matrices; ns_steps 0 (the scaling alone) and an odd count (the result
// lands in the scratch and is copied back).
TEST(Gpu, MuonOnCublasAgreesWithTheCpuAndRepeatsItsBits) {
  NEED_DEVICE();
  const std::vector<Case> muon_cases{
      {"muon", {{"lr", 0.02}}},
      {"muon", {{"lr", 0.02}, {"nesterov", false}, {"adjust_lr_fn", "match_rms_adamw"}, {"weight_decay", 0.0}}},
      {"muon", {{"lr", 0.02}, {"ns_steps", 0}}},
      {"muon", {{"lr", 0.03}, {"ns_steps", 7}, {"momentum", 0.0}}},
  };
  const std::vector<Shape> shapes{{300, 70}, {70, 300}, {64, 64}, {1, 513}, {0, 4}};
  for (const Case& c : muon_cases)
    for (DType t : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(c.rule + " case " + std::to_string(&c - muon_cases.data()) + " " + std::string(name_of(t)));
      const auto [da, db] = against_the_cpu(c, t, shapes, 4, 1e-5f, false);
      // The momentum reads only the gradients: the CPU's bits in either type.
      for (const auto& [i, entry] : da.state)
        for (const auto& [key, value] : entry) {
          if (!std::holds_alternative<StateTensor>(value)) continue;
          EXPECT_EQ(std::get<StateTensor>(value).data, std::get<StateTensor>(db.state.at(i).at(key)).data)
              << "state '" << key << "' of " << i;
        }
    }
}

// ns_dtype bfloat16 (torch's rounding, emulated) is CPU-only: the device
// step is refused in one line and changes nothing.
TEST(Gpu, MuonsBfloat16NewtonSchulzIsRefusedOnTheDevice) {
  NEED_DEVICE();
  const std::vector<Shape> shapes{{16, 8}};
  Tensors gpu(Device::cuda, DType::f32, shapes);
  Optimizer o("muon", gpu.params(), {{"ns_dtype", "bfloat16"}});
  const std::vector<unsigned char> before = gpu.bytes(0);
  try {
    o.step();
    FAIL() << "the step ran";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("ns_dtype bfloat16 (torch's rounding) is CPU-only"), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
  EXPECT_EQ(gpu.bytes(0), before);
}

// distopt's own clipping on device gradients: the norm in double summed in
// another order than the CPU's (so the same float norm, or one rounding
// apart), the scale and the clamp the CPU's per element; max-norm exactly
// the CPU's, NaN propagated.
TEST(Gpu, ClippingTakesDeviceGradients) {
  NEED_DEVICE();
  const DenormalMode mode(DenormalMode::ieee);
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    for (double norm_type : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE(str(name_of(t), " norm ", norm_type));
      const std::vector<std::size_t> sizes{70001, 1, 0, 16384};
      Tensors cpu(Device::cpu, t, sizes), gpu(Device::cuda, t, sizes);
      for (std::size_t k = 0; k < sizes.size(); ++k) cpu.set(cpu.grads[k], k, 5), gpu.set(gpu.grads[k], k, 5);
      std::vector<TensorView> a, b;
      for (const Param& p : cpu.params()) a.push_back(p.grad);
      for (const Param& p : gpu.params()) b.push_back(p.grad);
      const double na = clip_grad_norm(a, 0.5, norm_type), nb = clip_grad_norm(b, 0.5, norm_type);
      if (std::isinf(norm_type)) EXPECT_EQ(na, nb);
      else EXPECT_NEAR(na, nb, 2e-7 * na);
      // Scaled by the same coefficient (when the norms are the same float),
      // then clamped: the CPU's bits.
      auto same = [&](const char* what) {
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          std::vector<unsigned char> x(cpu.grads[k].size_bytes()), y(x.size());
          copy_bytes(x.data(), Device::cpu, cpu.grads[k].data(), Device::cpu, x.size());
          copy_bytes(y.data(), Device::cpu, gpu.grads[k].data(), Device::cuda, y.size());
          EXPECT_EQ(x, y) << what << ", gradient " << k;
        }
      };
      if (na != nb) continue;  // a norm one rounding apart scales by another coefficient
      same("scaled");
      clip_grad_value(a, 0.01);
      clip_grad_value(b, 0.01);
      same("clamped");
    }
  // A NaN gradient: the inf-norm is NaN on both.
  Tensors gpu(Device::cuda, DType::f32, std::vector<std::size_t>{3});
  const float nan[3] = {1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  copy_bytes(gpu.grads[0].data(), Device::cuda, nan, Device::cpu, sizeof nan);
  std::vector<TensorView> b{gpu.params()[0].grad};
  EXPECT_TRUE(std::isnan(clip_grad_norm(b, 1.0, std::numeric_limits<double>::infinity())));
}

TEST(Gpu, OutOfMemoryIsOneLineNamingTheSize) {
  NEED_DEVICE();
  try {
    Buffer b(std::size_t{1} << 50, 0, Device::cuda, "state 'exp_avg' of parameter 0 ('w')");
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const DeviceError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of CUDA memory allocating 1048576.00 GiB for state 'exp_avg' of parameter 0 ('w')"),
              std::string::npos)
        << m;
    EXPECT_EQ(m.find('\n'), std::string::npos);
  }
  Buffer after(1024, 0, Device::cuda, "after");  // the device still works
  EXPECT_FALSE(after.empty());
}

TEST(Gpu, ARuleWithoutAKernelAndMixedDevicesAreRefused) {
  NEED_DEVICE();
  Tensors gpu(Device::cuda, DType::f32, std::vector<std::size_t>{8});
  try {
    Optimizer o("shampoo", gpu.params());
    FAIL() << "shampoo accepted device parameters";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("shampoo has no CUDA kernel yet"), std::string::npos) << e.what();
  }
  Tensors cpu(Device::cpu, DType::f32, std::vector<std::size_t>{8});
  std::vector<Param> mixed = gpu.params();
  mixed.push_back(cpu.params()[0]);
  mixed.back().name = "host";
  EXPECT_THROW(Optimizer("adam", mixed), InvalidInput);
}

}  // namespace
}  // namespace distopt
