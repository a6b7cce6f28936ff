// The GEMM libraries in Debian on model gpt's matrix products (scripts/bench_gemm;
// docs/performance.md, "gpt: the GEMM library"): Eigen, OpenBLAS (one thread),
// oneDNN's dnnl_sgemm (one thread), on the shapes of one training step of
// the default comparison model, one rank. Prints GFLOP/s per shape and
// library, the step's GEMM time per library, and whether each library gives
// the same bits on a repeat. It first measures the core's float32 FMA peak
// (independent FMAs on the widest vectors -march=native allows), the limit
// the libraries' rates are read against.
#include <Eigen/Core>
#include <immintrin.h>
#include <cblas.h>
#include <dnnl.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

extern "C" void openblas_set_num_threads(int);

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
using ConstMap = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;

struct Shape {
  const char* what;
  bool ta, tb;
  int m, n, k;
  int count;  // per training step
};

using Gemm = std::function<void(const Shape&, const float*, const float*, float*)>;

void eigen_gemm(const Shape& s, const float* a, const float* b, float* c) {
  const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
  Map C(c, s.m, s.n, Eigen::OuterStride<>(s.n));
  if (!s.ta && !s.tb) C.noalias() = ConstMap(a, s.m, s.k, Eigen::OuterStride<>(lda)) * ConstMap(b, s.k, s.n, Eigen::OuterStride<>(ldb));
  if (!s.ta && s.tb) C.noalias() = ConstMap(a, s.m, s.k, Eigen::OuterStride<>(lda)) * ConstMap(b, s.n, s.k, Eigen::OuterStride<>(ldb)).transpose();
  if (s.ta && !s.tb) C.noalias() = ConstMap(a, s.k, s.m, Eigen::OuterStride<>(lda)).transpose() * ConstMap(b, s.k, s.n, Eigen::OuterStride<>(ldb));
}

void openblas_gemm(const Shape& s, const float* a, const float* b, float* c) {
  cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, 1.0f, a,
              s.ta ? s.m : s.k, b, s.tb ? s.k : s.n, 0.0f, c, s.n);
}

void onednn_gemm(const Shape& s, const float* a, const float* b, float* c) {
  dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.m, s.n, s.k, 1.0f, a, s.ta ? s.m : s.k, b, s.tb ? s.k : s.n, 0.0f, c, s.n);
}

// The widest float32 vectors -march=native allows, for the peak below.
#if defined(__AVX512F__)
constexpr int kVectorBits = 512;
using Vec = __m512;
Vec vec_set(float x) { return _mm512_set1_ps(x); }
Vec vec_fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
constexpr int kVectorBits = 256;
using Vec = __m256;
Vec vec_set(float x) { return _mm256_set1_ps(x); }
Vec vec_fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// GFLOP/s of 12 independent chains of FMAs on those vectors.
double fma_peak() {
  constexpr int kChains = 12, kLanes = kVectorBits / 32;
  const Vec b = vec_set(0.999f), c = vec_set(1e-4f);
  Vec acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = vec_set(0.001f * i);
  const long n = 50'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < n; ++r)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = vec_fma(acc[i], b, c);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float lanes[kChains * kLanes];
  std::memcpy(lanes, acc, sizeof lanes);
  float sink = 0;
  for (float v : lanes) sink += v;
  if (sink == 12345.0f) std::printf(" ");  // keeps the chains alive
  return double(n) * kChains * kLanes * 2 / t / 1e9;
}

double seconds(const std::function<void()>& f, int reps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  openblas_set_num_threads(1);
  omp_set_num_threads(1);
  // Model L4 D256 T128, 16 samples a rank: BT = 2048.
  const int BT = 2048, D = 256, V = 256, T = 128, hd = 64, BH = 64, L = 4;
  const std::vector<Shape> shapes = {
      {"qkv      x Wattn^T", false, true, BT, 3 * D, D, L},
      {"proj     y Wproj^T", false, true, BT, D, D, L},
      {"fc       m Wfc^T", false, true, BT, 4 * D, D, L},
      {"mproj    g Wmp^T", false, true, BT, D, 4 * D, L},
      {"head     h wte^T", false, true, BT, V, D, 1},
      {"dX qkv   d Wattn", false, false, BT, D, 3 * D, L},
      {"dX proj  d Wproj", false, false, BT, D, D, L},
      {"dX fc    d Wfc", false, false, BT, D, 4 * D, L},
      {"dX mproj d Wmp", false, false, BT, 4 * D, D, L},
      {"dX head  d wte", false, false, BT, D, V, 1},
      {"dW qkv   d^T x", true, false, 3 * D, D, BT, L},
      {"dW proj  d^T y", true, false, D, D, BT, L},
      {"dW fc    d^T m", true, false, 4 * D, D, BT, L},
      {"dW mproj d^T g", true, false, D, 4 * D, BT, L},
      {"dW head  d^T h", true, false, V, D, BT, 1},
      {"att QK^T", false, true, T, T, hd, 2 * BH * L},     // forward and dP = dY V^T
      {"att PV", false, false, T, hd, T, 3 * BH * L},      // forward, dQ = dS K, dV-like
      {"att P^T dY", true, false, T, hd, T, 2 * BH * L},   // dV = P^T dY, dK = dS^T Q
  };
  const std::vector<std::pair<const char*, Gemm>> libs = {
      {"eigen", eigen_gemm}, {"openblas", openblas_gemm}, {"dnnl", onednn_gemm}};
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  const double peak = fma_peak();
  std::printf("float32 FMA peak of this core: %.1f GFLOP/s (%d-bit vectors)\n", peak, kVectorBits);
  std::printf("%-20s %6s %6s %6s", "shape", "m", "n", "k");
  for (const auto& l : libs) std::printf(" %10s", l.first);
  std::printf("   (GFLOP/s)\n");
  std::vector<double> step(libs.size(), 0);
  std::vector<bool> same(libs.size(), true);
  for (const Shape& s : shapes) {
    std::vector<float> a(std::size_t(s.m) * s.k), b(std::size_t(s.k) * s.n), c(std::size_t(s.m) * s.n), c2(c.size());
    for (float& v : a) v = nd(gen);
    for (float& v : b) v = nd(gen);
    std::printf("%-20s %6d %6d %6d", s.what, s.m, s.n, s.k);
    for (std::size_t i = 0; i < libs.size(); ++i) {
      const Gemm& g = libs[i].second;
      g(s, a.data(), b.data(), c.data());  // warm-up
      const int r = s.m * s.n * s.k < 4'000'000 ? reps * 50 : reps;
      const double t = seconds([&] { g(s, a.data(), b.data(), c.data()); }, r);
      g(s, a.data(), b.data(), c2.data());
      if (std::memcmp(c.data(), c2.data(), c.size() * sizeof(float)) != 0) same[i] = false;
      step[i] += t * s.count;
      std::printf(" %10.1f", 2.0 * s.m * s.n * s.k / t / 1e9);
    }
    std::printf("\n");
  }
  std::printf("%-41s", "one training step's GEMMs (ms)");
  for (std::size_t i = 0; i < libs.size(); ++i) std::printf(" %10.1f", step[i] * 1e3);
  std::printf("\n%-41s", "step's GEMM rate / FMA peak");
  double flops = 0;
  for (const Shape& s : shapes) flops += 2.0 * s.m * s.n * s.k * s.count;
  for (std::size_t i = 0; i < libs.size(); ++i) std::printf(" %10.2f", flops / step[i] / 1e9 / peak);
  std::printf("\n%-41s", "same bits on a repeat");
  for (std::size_t i = 0; i < libs.size(); ++i) std::printf(" %10s", same[i] ? "yes" : "NO");
  std::printf("\n");
  return 0;
}
