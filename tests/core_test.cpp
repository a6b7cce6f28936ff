// Core: dtype conversions, buffers, thread pool, errors.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <stdexcept>

#include "distopt/core/buffer.hpp"
#include "distopt/core/copy.hpp"
#include "distopt/core/device.hpp"
#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/tensor.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/optim/clip.hpp"
#include "distopt/optim/grad_scaler.hpp"
#include "distopt/optim/optimizer.hpp"

namespace distopt {
namespace {

bool is_nan_f16(std::uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool is_nan_bf16(std::uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

TEST(Dtype, F16RoundTripsEveryPattern) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_bits_to_float(static_cast<std::uint16_t>(h));
    const std::uint16_t back = float_to_f16_bits(f);
    if (is_nan_f16(static_cast<std::uint16_t>(h))) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(is_nan_f16(back)) << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << h;
    } else {
      ASSERT_EQ(back, h) << "pattern " << h << " -> " << f;
    }
  }
}

TEST(Dtype, Bf16RoundTripsEveryPattern) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_bits_to_float(static_cast<std::uint16_t>(b));
    const std::uint16_t back = float_to_bf16_bits(f);
    if (is_nan_bf16(static_cast<std::uint16_t>(b))) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(is_nan_bf16(back));
    } else {
      ASSERT_EQ(back, b) << "pattern " << b;
    }
  }
}

// Independent reference: the nearest representable value by exhaustive
// comparison of the two neighbours, ties to the even mantissa, computed in
// double.
template <class Widen>
std::uint16_t nearest_even(float f, std::uint16_t lo, Widen widen) {
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dl = std::fabs(static_cast<double>(f) - widen(lo));
  const double dh = std::fabs(static_cast<double>(f) - widen(hi));
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

double widen_f16(std::uint16_t h) {  // via the definition, not the code under test
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1f) return m ? NAN : s * INFINITY;
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1024 + m, e - 25);
}
double widen_bf16(std::uint16_t b) {
  const int e = (b >> 7) & 0xff, m = b & 0x7f;
  const double s = (b & 0x8000) ? -1.0 : 1.0;
  if (e == 0xff) return m ? NAN : s * INFINITY;
  if (e == 0) return s * std::ldexp(m, -133);
  return s * std::ldexp(128 + m, e - 134);
}

TEST(Dtype, FloatToF16RoundsToNearestEven) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int k = 0; k < 2'000'000; ++k) {
    // Random floats concentrated in and around f16's range.
    std::uint32_t x = bits(rng);
    x = (x & 0x807fffffu) | ((static_cast<std::uint32_t>(96 + (x >> 23) % 50)) << 23);
    const float f = std::bit_cast<float>(x);
    const double a = std::fabs(static_cast<double>(f));
    const std::uint16_t got = float_to_f16_bits(f);
    if (a >= 65520.0) {
      ASSERT_EQ(got & 0x7fff, 0x7c00) << f;
      continue;
    }
    // Truncation toward zero gives the lower neighbour of |f|.
    std::uint16_t lo = 0;
    for (int step = 1 << 14; step; step >>= 1)
      if (lo + step <= 0x7bff && widen_f16(static_cast<std::uint16_t>(lo + step)) <= a) lo += step;
    const std::uint16_t want = nearest_even(static_cast<float>(a), lo, widen_f16);
    ASSERT_EQ(got & 0x7fff, want) << "f=" << f;
    ASSERT_EQ(got & 0x8000, (x >> 16) & 0x8000);
    ++checked;
  }
  EXPECT_GT(checked, 1'000'000);
  // Exact ties: halfway between 1 and 1+2^-10 rounds to even (1); the next tie rounds up.
  EXPECT_EQ(float_to_f16_bits(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_f16_bits(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65519.99f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_f16_bits(0x1p-25f), 0x0000);       // tie between 0 and the smallest subnormal
  EXPECT_EQ(float_to_f16_bits(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
}

TEST(Dtype, FloatToBf16RoundsToNearestEven) {
  std::mt19937 rng(2);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int k = 0; k < 2'000'000; ++k) {
    const std::uint32_t x = bits(rng);
    const float f = std::bit_cast<float>(x);
    if (std::isnan(f)) continue;
    const std::uint16_t got = float_to_bf16_bits(f);
    const double a = std::fabs(static_cast<double>(f));
    const std::uint16_t lo = static_cast<std::uint16_t>((x & 0x7fffffffu) >> 16);  // truncation
    std::uint16_t want;
    if (lo == 0x7f7f && a > widen_bf16(0x7f7f)) {  // above the largest finite
      want = a - widen_bf16(0x7f7f) >= std::ldexp(1.0, 127 - 8) ? 0x7f80 : 0x7f7f;
    } else if (lo >= 0x7f80) {
      want = lo;  // infinity
    } else {
      want = nearest_even(static_cast<float>(a), lo, widen_bf16);
    }
    ASSERT_EQ(got & 0x7fff, want) << "x=" << std::hex << x;
  }
  EXPECT_EQ(float_to_bf16_bits(1.0f + 0x1p-8f), 0x3f80);  // tie to even
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_TRUE(is_nan_bf16(float_to_bf16_bits(std::bit_cast<float>(0x7f800001u))));  // NaN stays NaN
}

TEST(Dtype, Names) {
  DType t;
  EXPECT_TRUE(parse_dtype("bfloat16", &t));
  EXPECT_EQ(t, DType::bf16);
  EXPECT_TRUE(parse_dtype("half", &t));
  EXPECT_EQ(t, DType::f16);
  EXPECT_FALSE(parse_dtype("f8", &t));
  EXPECT_EQ(size_of(DType::f32), 4u);
  EXPECT_EQ(name_of(DType::bf16), "bf16");
}

TEST(Buffer, SmallBuffersAreCacheLineAlignedAndZero) {
  for (std::size_t bytes : {1u, 7u, 64u, 4096u, 100000u}) {
    Buffer b(bytes);
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % kCacheLine, 0u);
    for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(b.as<unsigned char>()[i], 0);
  }
  Buffer empty(0);
  EXPECT_TRUE(empty.empty());
}

TEST(Buffer, HugeBuffersAreHugePageAlignedPlusStagger) {
  const std::size_t bytes = kHugeBuffer;
  std::set<std::uintptr_t> offsets;
  for (int slot = 0; slot < 6; ++slot) {
    Buffer b(bytes, slot);
    const auto addr = reinterpret_cast<std::uintptr_t>(b.data());
    EXPECT_EQ(addr % kHugePage, slot * kStaggerStep % kHugePage) << "slot " << slot;
    offsets.insert(addr % kHugePage);
    EXPECT_EQ(b.as<unsigned char>()[bytes - 1], 0);
    b.as<unsigned char>()[bytes - 1] = 1;  // writable to the end
  }
  EXPECT_EQ(offsets.size(), 6u);
}

// Between kLargeBuffer and kHugeBuffer: mapped on its own, page-aligned
// plus the stagger, off huge pages (which would fault in 2 MiB at once).
TEST(Buffer, MidSizedBuffersArePageAlignedPlusStagger) {
  const std::size_t bytes = kLargeBuffer + 12345;
  for (int slot = 0; slot < 3; ++slot) {
    Buffer b(bytes, slot);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 4096, 0u) << "slot " << slot;
    EXPECT_EQ(b.as<unsigned char>()[bytes - 1], 0);
    b.as<unsigned char>()[bytes - 1] = 1;
  }
}

TEST(Buffer, MoveTransfersOwnership) {
  Buffer a(std::size_t{2} << 20, 1);
  void* p = a.data();
  Buffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(a.data(), nullptr);
  Buffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
}

// Streamed copies over sizes around the 128-byte body and the 16 KiB
// four-lane unit, destinations misaligned alike and differently, to one and
// to three destinations: every byte arrives, nothing around is touched.
TEST(Copy, StreamedCopiesAreExactForEverySizeAndAlignment) {
  std::mt19937 gen(7);
  std::vector<unsigned char> src(3 * 16384 + 4096 + 300);
  for (auto& b : src) b = static_cast<unsigned char>(gen());
  for (std::size_t bytes : {0, 1, 31, 127, 128, 129, 16383, 16384, 16385, 49152 + 4096 + 77}) {
    for (std::size_t src_off : {0, 3}) {
      for (int pattern = 0; pattern < 3; ++pattern) {
        // pattern 0: one destination; 1: three alike (offset 5); 2: three differently misaligned.
        const std::size_t n = pattern == 0 ? 1 : 3;
        std::vector<std::vector<unsigned char>> outs(n, std::vector<unsigned char>(bytes + 128, 0xAB));
        std::vector<void*> dsts;
        for (std::size_t k = 0; k < n; ++k) dsts.push_back(outs[k].data() + (pattern == 2 ? 1 + 9 * k : 5) + 32);
        if (src_off + bytes > src.size()) continue;
        if (n == 1)
          stream_bytes(dsts[0], src.data() + src_off, bytes);
        else
          stream_bytes_to(dsts, src.data() + src_off, bytes);
        for (std::size_t k = 0; k < n; ++k) {
          const auto* d = static_cast<const unsigned char*>(dsts[k]);
          ASSERT_EQ(std::memcmp(d, src.data() + src_off, bytes), 0) << bytes << " bytes, pattern " << pattern;
          ASSERT_EQ(d[-1], 0xAB) << "byte before the destination changed";
          ASSERT_EQ(d[bytes], 0xAB) << "byte after the destination changed";
        }
      }
    }
  }
}

TEST(Tensor, Numel) {
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(numel({3, 4}), 12);
  EXPECT_EQ(numel({3, 0, 4}), 0);
  EXPECT_THROW(numel({2, -1}), PreconditionError);
  EXPECT_EQ(to_string({2, 3}), "[2, 3]");
}

TEST(ThreadPool, RunsEveryItemOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (std::size_t n : {0u, 1u, 2u, 7u, 1000u}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, [&](std::size_t i) { hits[i]++; });
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << i;
    }
  }
}

TEST(ThreadPool, RethrowsAndStaysUsable) {
  ThreadPool pool(3);
  EXPECT_THROW(pool.parallel_for(100, [](std::size_t i) {
    if (i == 37) throw std::runtime_error("boom");
  }), std::runtime_error);
  std::atomic<int> sum{0};
  pool.parallel_for(10, [&](std::size_t i) { sum += static_cast<int>(i); });
  EXPECT_EQ(sum.load(), 45);
}

TEST(Errors, PreconditionNamesFileLineAndValues) {
  try {
    const int a = 3, b = 4;
    DISTOPT_CHECK(a == b, "a=", a, " b=", b);
    FAIL();
  } catch (const PreconditionError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("core_test.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("a == b"), std::string::npos) << what;
    EXPECT_NE(what.find("a=3 b=4"), std::string::npos) << what;
  }
  EXPECT_TRUE((std::is_base_of_v<Error, InvalidInput>));
  EXPECT_TRUE((std::is_base_of_v<Error, IoError>));
}

TEST(Device, NamesParse) {
  Device d = Device::cpu;
  EXPECT_TRUE(parse_device("cuda", &d));
  EXPECT_EQ(d, Device::cuda);
  EXPECT_TRUE(parse_device("cpu", &d));
  EXPECT_EQ(d, Device::cpu);
  EXPECT_FALSE(parse_device("gpu", &d));
  EXPECT_EQ(name_of(Device::cuda), "cuda");
}

// Where CUDA cannot be used (no CUDA build, or no device: CI), every way in
// is refused in one line that says which, and nothing is touched.
TEST(Device, WithoutADeviceCudaIsRefusedInOneLine) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device (tests/gpu_test.cpp runs there)";
  const std::string why = cuda_unavailable_reason();
  EXPECT_TRUE(why.rfind(cuda_built() ? "no CUDA device" : "this build has no CUDA", 0) == 0) << why;
  try {
    require_device(Device::cuda);
    FAIL() << "require_device(cuda) passed without a device";
  } catch (const InvalidInput& e) {
    EXPECT_EQ(std::string(e.what()), "--device cuda: " + why);
  }
  EXPECT_NO_THROW(require_device(Device::cpu));
  EXPECT_THROW(Buffer(64, 0, Device::cuda, "x"), Error);
  // An optimizer handed a device view refuses it before touching its memory.
  float fake[4] = {};
  Param p{"w", {fake, DType::f32, {4}, Device::cuda}, {fake, DType::f32, {4}, Device::cuda}, true};
  try {
    Optimizer o("adam", {p});
    FAIL() << "an optimizer accepted device parameters without a device";
  } catch (const InvalidInput& e) {
    EXPECT_EQ(std::string(e.what()), "optimizer on cuda: " + why);
  }
}

// The loss scaler reads gradients on the CPU: a device gradient is refused
// in one line before anything reads it (a host read of device memory would
// crash), on every machine. Clipping runs device gradients on the device
// (tests/gpu_test.cpp); without one it says why in one line.
TEST(Device, ClippingAndTheLossScalerRefuseDeviceGradients) {
  float fake[4] = {1, 2, 3, 4};
  const TensorView g{fake, DType::f32, {4}, Device::cuda};
  const std::vector<TensorView> grads{g};
  const auto refused = [](const auto& fn, const std::string& what) {
    try {
      fn();
      ADD_FAILURE() << what << " read a device tensor";
    } catch (const InvalidInput& e) {
      EXPECT_EQ(std::string(e.what()), what + " reads tensors on the CPU; this one is on cuda (docs/gpu.md)");
    }
  };
  refused([&] { unscale_grads(grads, 0.5f, false); }, "the loss scaler");
  if (cuda_device_count() == 0) {  // (with a device the fake pointer would reach a kernel)
    for (const auto& clip : std::vector<std::function<void()>>{[&] { clip_grad_norm(grads, 1.0); },
                                                               [&] { clip_grad_value(grads, 1.0); }}) {
      try {
        clip();
        ADD_FAILURE() << "clipping ran a device tensor without a device";
      } catch (const InvalidInput& e) {
        EXPECT_EQ(std::string(e.what()), "clipping on cuda: " + cuda_unavailable_reason());
      }
    }
  }
  EXPECT_EQ(fake[0], 1.0f);
  // The one wording of a rule the device cannot run.
  EXPECT_EQ(why_rule_cannot_run("adam", Device::cpu), "");
  EXPECT_EQ(why_rule_cannot_run("nosuchrule", Device::cpu), "unknown update rule 'nosuchrule'");
  EXPECT_EQ(why_rule_cannot_run("shampoo", Device::cuda).rfind("shampoo has no CUDA kernel yet (the device runs ", 0),
            0u);
}

}  // namespace
}  // namespace distopt
