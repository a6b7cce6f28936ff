// Eigen or OpenBLAS for the built-in models? The GEMMs of one training step
// of the 784-256-128-10 MLP at batch 128 (forward, weight gradients, input
// gradients of layers 2 and 3), single-threaded, timed with each library.
// Not part of the build (OpenBLAS is not a dependency); the result is in
// docs/performance.md. Build and run:
//   apt-get install -y libeigen3-dev libopenblas-dev
//   g++ -O3 -march=native -DNDEBUG -I/usr/include/eigen3 bench/mlp_gemm_choice.cpp -o /tmp/gemm -lopenblas
//   OPENBLAS_NUM_THREADS=1 /tmp/gemm
#include <cblas.h>

#include <Eigen/Core>
#include <chrono>
#include <cstdio>
#include <functional>
#include <utility>
#include <vector>

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

int main() {
  const int batch = 128, width[4] = {784, 256, 128, 10};
  std::vector<Mat> w(3), dw(3), act(4), delta(4);
  for (int l = 0; l < 3; ++l) {
    w[l] = Mat::Random(width[l + 1], width[l]);
    dw[l] = Mat::Zero(width[l + 1], width[l]);
  }
  for (int l = 0; l < 4; ++l) {
    act[l] = Mat::Random(batch, width[l]);
    delta[l] = Mat::Random(batch, width[l]);
  }
  double flops = 0;
  for (int l = 0; l < 3; ++l) flops += 2.0 * 2 * batch * width[l] * width[l + 1] + (l > 0 ? 2.0 * batch * width[l] * width[l + 1] : 0);
  auto eigen = [&] {
    for (int l = 0; l < 3; ++l) act[l + 1].noalias() = act[l] * w[l].transpose();
    for (int l = 2; l >= 0; --l) {
      dw[l].noalias() = delta[l + 1].transpose() * act[l];
      if (l > 0) delta[l].noalias() = delta[l + 1] * w[l];
    }
  };
  auto openblas = [&] {
    for (int l = 0; l < 3; ++l)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, width[l + 1], width[l], 1, act[l].data(), width[l],
                  w[l].data(), width[l], 0, act[l + 1].data(), width[l + 1]);
    for (int l = 2; l >= 0; --l) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, width[l + 1], width[l], batch, 1, delta[l + 1].data(),
                  width[l + 1], act[l].data(), width[l], 0, dw[l].data(), width[l]);
      if (l > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, width[l], width[l + 1], 1, delta[l + 1].data(),
                    width[l + 1], w[l].data(), width[l], 0, delta[l].data(), width[l]);
    }
  };
  for (int round = 0; round < 3; ++round)
    for (auto& [name, fn] : {std::pair<const char*, std::function<void()>>{"eigen", eigen}, {"openblas", openblas}}) {
      fn();
      const int n = 200;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) fn();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
      std::printf("%-9s %.3f ms/step  %6.1f GFLOP/s  %8.0f samples/s (GEMMs only)\n", name, s * 1e3, flops / s / 1e9,
                  batch / s);
    }
}
