// Functions compiled for the CPU and, under nvcc, for the GPU as well.
//
// A pointwise update rule's per-element math is written once, with these
// helpers, and runs both in the CPU loop and in the CUDA kernel
// (docs/gpu.md). They are spelled so that both compile to the same IEEE
// operation: correctly rounded sqrt and division (nvcc's defaults,
// -prec-sqrt=true -prec-div=true), no fused multiply-add (the CPU builds
// with -ffp-contract=off, the CUDA kernels with -fmad=false), and min/max
// with std::min/std::max's choice of operand when one is NaN (not fminf's).
#pragma once

#include <cstdint>

#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cmath>
#endif

#if defined(__CUDACC__)
#define DISTOPT_HD __host__ __device__ __forceinline__
#else
#define DISTOPT_HD inline
#endif

namespace distopt::hd {

DISTOPT_HD std::uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

DISTOPT_HD float float_of(std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return std::bit_cast<float>(b);
#endif
}

DISTOPT_HD float sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

DISTOPT_HD float abs(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// std::max(a, b) and std::min(a, b), operand for operand.
DISTOPT_HD float max(float a, float b) { return a < b ? b : a; }
DISTOPT_HD float min(float a, float b) { return b < a ? b : a; }

}  // namespace distopt::hd
