// The kernels of model gpt (gpt_kernels.hpp): the products on oneDNN, and
// LayerNorm, attention, GELU, the loss and the embeddings as loops on the
// model's ThreadPool. Each kernel's forward and backward sit together, so a
// reader checks one against the other (and against scripts/gpt_torch.py) on
// adjacent screens. Built with -fno-trapping-math (src/CMakeLists.txt): the
// exp, tanh and GELU loops vectorize only under it; the bits are IEEE's
// either way.
#include "gpt_kernels.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <map>
#include <tuple>

#include "distopt/core/dtype.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/models/model.hpp"

// libgomp's (which oneDNN runs on); declared here so that no OpenMP
// compiler flag touches the other models (Eigen would thread under it).
extern "C" void omp_set_num_threads(int);

namespace distopt::models::gpt_kernels {

namespace {

// Task sizes, fixed so that the bits do not depend on the thread count:
// rows of a row-wise task (a product's rows cost 2% over whole products on
// one core at 256; docs/performance.md), columns of a column reduction.
constexpr std::size_t kRows = 256;
constexpr std::size_t kColumns = 64;

// C (m x n, leading dimension ldc) = op(A) op(B) (+ C when `accumulate`),
// row-major; op(A) is m x k, op(B) is k x n. oneDNN's dnnl_sgemm, on the
// calling thread alone: ranks are threads, and one thread per product keeps
// the bits independent of the machine's load (docs/performance.md, "gpt":
// it was the fastest of Eigen, OpenBLAS and oneDNN on these shapes).
// oneDNN runs on OpenMP: every thread that calls it (a rank, a pool
// worker) gives it a team of one, so that products never split their work
// by the machine's core count.
void one_omp_thread() {
  thread_local const bool once = [] {
    omp_set_num_threads(1);
    return true;
  }();
  (void)once;
}

void gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, const float* a, std::size_t lda,
          const float* b, std::size_t ldb, float* c, std::size_t ldc, bool accumulate) {
  one_omp_thread();
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', static_cast<dnnl_dim_t>(m), static_cast<dnnl_dim_t>(n),
                 static_cast<dnnl_dim_t>(k), 1.0f, a, static_cast<dnnl_dim_t>(lda), b, static_cast<dnnl_dim_t>(ldb),
                 accumulate ? 1.0f : 0.0f, c, static_cast<dnnl_dim_t>(ldc));
  DISTOPT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(st));
}

// dst (rows x cols, dense) <- rows of src with stride ld, rounded.
void pack_bf16(const float* src, std::size_t rows, std::size_t cols, std::size_t ld, bf16_t* dst) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* s = src + r * ld;
    bf16_t* d = dst + r * cols;
    for (std::size_t j = 0; j < cols; ++j) d[j] = float_to_bf16_bits(s[j]);
  }
}

// C (m x n, leading dimension ldc) = op(A) op(B) (+ bias, a row of n) (+ C)
// as gemm() below, from bfloat16 operands: oneDNN's matmul primitive, one
// per shape and thread, made on first use.
void gemm_bf16(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, const bf16_t* a, std::size_t lda,
               const bf16_t* b, std::size_t ldb, float* c, std::size_t ldc, bool accumulate,
               const float* bias = nullptr) {
  one_omp_thread();
  using dnnl::memory;
  // The primitive and its memory objects, pointed at each call's data.
  struct Entry {
    dnnl::matmul matmul;
    memory a, b, c, bias;
  };
  using Key =
      std::tuple<bool, bool, std::size_t, std::size_t, std::size_t, std::size_t, std::size_t, std::size_t, bool, bool>;
  thread_local const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  thread_local dnnl::stream stream(engine);
  thread_local std::map<Key, Entry> cache;
  const Key key{ta, tb, m, n, k, lda, ldb, ldc, accumulate, bias != nullptr};
  auto it = cache.find(key);
  if (it == cache.end()) {
    const auto M = static_cast<memory::dim>(m), N = static_cast<memory::dim>(n), K = static_cast<memory::dim>(k);
    const auto LA = static_cast<memory::dim>(lda), LB = static_cast<memory::dim>(ldb);
    const memory::desc ad({M, K}, memory::data_type::bf16, ta ? memory::dims{1, LA} : memory::dims{LA, 1});
    const memory::desc bd({K, N}, memory::data_type::bf16, tb ? memory::dims{1, LB} : memory::dims{LB, 1});
    const memory::desc cd({M, N}, memory::data_type::f32, memory::dims{static_cast<memory::dim>(ldc), 1});
    const memory::desc biasd = bias != nullptr ? memory::desc({1, N}, memory::data_type::f32, memory::dims{N, 1})
                                               : memory::desc();
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops sum;
      sum.append_sum(1.0f);
      attr.set_post_ops(sum);
    }
    try {
      const dnnl::matmul::primitive_desc pd(
          bias != nullptr ? dnnl::matmul::desc(ad, bd, biasd, cd) : dnnl::matmul::desc(ad, bd, cd), attr, engine);
      it = cache
               .emplace(key, Entry{dnnl::matmul(pd), memory(ad, engine, nullptr), memory(bd, engine, nullptr),
                                   memory(cd, engine, nullptr),
                                   bias != nullptr ? memory(biasd, engine, nullptr) : memory()})
               .first;
    } catch (const dnnl::error& e) {
      throw InvalidInput(
          str("--matmul-precision bf16: oneDNN has no bfloat16 product of this shape on this CPU (", e.what(), ")"));
    }
  }
  Entry& e = it->second;
  e.a.set_data_handle(const_cast<bf16_t*>(a));
  e.b.set_data_handle(const_cast<bf16_t*>(b));
  e.c.set_data_handle(c);
  if (bias == nullptr) {
    e.matmul.execute(stream, {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}});
  } else {
    e.bias.set_data_handle(const_cast<float*>(bias));
    e.matmul.execute(stream,
                     {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_BIAS, e.bias}, {DNNL_ARG_DST, e.c}});
  }
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

// e^x within 2 ulp over float's range (Cephes' expf polynomial after
// x = n ln 2 + r), without branches, so that loops over it vectorize; the
// library's expf and tanhf do not, and took a third of a step.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
}

// tanh(u) = 1 - 2 / (e^2u + 1): within 1.2e-7 of tanh absolutely (not
// relatively near 0, which GELU's 1 + tanh does not need).
inline float tanh_approx(float u) { return 1.0f - 2.0f / (exp_approx(2.0f * u) + 1.0f); }

// Reductions over a row in 16 interleaved partial sums, added pairwise at
// the end: a fixed order (the same bits on every run and thread count)
// that vectorizes, which a running sum does not (a fifth of a step was
// scalar softmax and LayerNorm sums).
constexpr std::size_t kLanes = 16;

inline float lane_total(float (&acc)[kLanes]) {
  for (std::size_t w = kLanes / 2; w > 0; w /= 2)
    for (std::size_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

inline float sum_of(const float* x, std::size_t n) {
  float acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  for (std::size_t l = 0; i + l < n; ++l) acc[l] += x[i + l];
  return lane_total(acc);
}

inline float dot_of(const float* x, const float* y, std::size_t n) {
  float acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) acc[l] += x[i + l] * y[i + l];
  for (std::size_t l = 0; i + l < n; ++l) acc[l] += x[i + l] * y[i + l];
  return lane_total(acc);
}

// Sum of (x - mean)^2.
inline float square_deviation_sum(const float* x, float mean, std::size_t n) {
  float acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) acc[l] += (x[i + l] - mean) * (x[i + l] - mean);
  for (std::size_t l = 0; i + l < n; ++l) acc[l] += (x[i + l] - mean) * (x[i + l] - mean);
  return lane_total(acc);
}

inline float max_of(const float* x, std::size_t n) {
  float acc[kLanes];
  std::fill(acc, acc + kLanes, -INFINITY);
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], x[i + l]);
  for (std::size_t l = 0; i + l < n; ++l) acc[l] = std::max(acc[l], x[i + l]);
  for (std::size_t w = kLanes / 2; w > 0; w /= 2)
    for (std::size_t l = 0; l < w; ++l) acc[l] = std::max(acc[l], acc[l + w]);
  return acc[0];
}

// LayerNorm over rows of d elements (eps 1e-5, torch's): y = xhat * w + b,
// keeping xhat and 1 / std for backward.
void layer_norm(const float* x, std::size_t rows, std::size_t d, const float* w, const float* b, float* y, float* xhat,
                float* rstd) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float mean = sum_of(xr, d) / static_cast<float>(d);
    const float var = square_deviation_sum(xr, mean, d) / static_cast<float>(d);
    const float s = 1.0f / std::sqrt(var + 1e-5f);
    rstd[r] = s;
    float* hr = xhat + r * d;
    float* yr = y + r * d;
    for (std::size_t j = 0; j < d; ++j) {
      hr[j] = (xr[j] - mean) * s;
      yr[j] = hr[j] * w[j] + b[j];
    }
  }
}

// Backward of layer_norm to its input: dx (+)= from dy (dw, db: column_sums).
void layer_norm_backward(const float* dy, const float* xhat, const float* rstd, std::size_t rows, std::size_t d,
                         const float* w, float* dx, bool accumulate) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* g = dy + r * d;
    const float* h = xhat + r * d;
    float acc_g[kLanes] = {}, acc_gh[kLanes] = {};
    for (std::size_t j = 0; j < d; ++j) {
      const float gw = g[j] * w[j];
      acc_g[j % kLanes] += gw;
      acc_gh[j % kLanes] += gw * h[j];
    }
    const float mean_g = lane_total(acc_g) / static_cast<float>(d);
    const float mean_gh = lane_total(acc_gh) / static_cast<float>(d);
    float* o = dx + r * d;
    for (std::size_t j = 0; j < d; ++j) {
      const float v = rstd[r] * (g[j] * w[j] - mean_g - h[j] * mean_gh);
      o[j] = accumulate ? o[j] + v : v;
    }
  }
}

// Columns [j0, j1) of rows x n matrices, summed over the rows in order:
// sum[j] += dy[., j] and, with xhat, prod[j] += dy[., j] xhat[., j] (a
// LayerNorm's or a bias's gradient).
void column_sums(const float* dy, const float* xhat, std::size_t rows, std::size_t n, std::size_t j0, std::size_t j1,
                 float* prod, float* sum) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* g = dy + r * n;
    if (xhat != nullptr) {
      const float* h = xhat + r * n;
      for (std::size_t j = j0; j < j1; ++j) prod[j] += g[j] * h[j];
    }
    for (std::size_t j = j0; j < j1; ++j) sum[j] += g[j];
  }
}

void add_bias(float* y, std::size_t rows, std::size_t n, const float* b) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < n; ++j) y[r * n + j] += b[j];
}

}  // namespace

template <class F>
void Kernels::blocks(std::size_t n, std::size_t block, F&& f) {
  const unsigned control = fp_control();
  pool_.parallel_for((n + block - 1) / block, [&](std::size_t i) {
    set_fp_control(control);
    f(i * block, std::min(n, (i + 1) * block));
  });
}

void Kernels::product(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c,
                      std::size_t ldc, bool accumulate) const {
  if (bf16_) gemm_bf16(ta, tb, m, n, k, a.h, a.ld, b.h, b.ld, c, ldc, accumulate);
  else gemm(ta, tb, m, n, k, a.f, a.ld, b.f, b.ld, c, ldc, accumulate);
}

void Kernels::round_rows(const float* src, std::size_t rows, std::size_t cols, std::size_t ld, bf16_t* dst) {
  if (!bf16_) return;
  blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
    pack_bf16(src + r0 * ld, r1 - r0, cols, ld, dst + r0 * cols);
  });
}

Operand Kernels::rounded(Operand x, std::size_t rows, std::size_t cols) {
  if (!bf16_ || x.h != nullptr) return x;
  if (b16_.size() < rows * cols) b16_.resize(rows * cols);
  round_rows(x.f, rows, cols, x.ld, b16_.data());
  return {nullptr, b16_.data(), cols};
}

void Kernels::matmul(bool tb, std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c,
                     std::size_t ldc, bool accumulate, const float* bias) {
  DISTOPT_CHECK(bias == nullptr || ldc == n, "a bias goes with dense rows");
  b = tb ? rounded(b, n, k) : rounded(b, k, n);
  blocks(m, kRows, [&](std::size_t r0, std::size_t r1) {
    if (!bf16_) {
      gemm(false, tb, r1 - r0, n, k, a.f + r0 * a.ld, a.ld, b.f, b.ld, c + r0 * ldc, ldc, accumulate);
      if (bias != nullptr) add_bias(c + r0 * ldc, r1 - r0, n, bias);
      return;
    }
    Operand rows = a.at(r0 * a.ld);
    if (rows.h == nullptr) {
      thread_local std::vector<bf16_t> a16;
      a16.resize((r1 - r0) * k);
      pack_bf16(rows.f, r1 - r0, k, rows.ld, a16.data());
      rows = {nullptr, a16.data(), k};
    }
    gemm_bf16(false, tb, r1 - r0, n, k, rows.h, rows.ld, b.h, b.ld, c + r0 * ldc, ldc, accumulate, bias);
  });
}

void Kernels::matmul_tn(std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c,
                        std::size_t ldc) {
  DISTOPT_CHECK(!bf16_ || (a.h != nullptr && b.h != nullptr), "a weight gradient's operands come rounded");
  const std::size_t block = m >= 3 * kRows ? kRows : kRows / 2;
  blocks(m, block, [&](std::size_t r0, std::size_t r1) {
    product(true, false, r1 - r0, n, k, a.at(r0), b, c + r0 * ldc, ldc, false);
  });
}

void Kernels::layer_norm_rows(const float* x, std::size_t rows, std::size_t D, const float* w, const float* b,
                              float* y, float* xhat, float* rstd) {
  blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
    layer_norm(x + r0 * D, r1 - r0, D, w, b, y + r0 * D, xhat + r0 * D, rstd + r0);
  });
}

void Kernels::layer_norm_grad(const float* dy, const float* xhat, const float* rstd, std::size_t rows,
                              std::size_t D, const float* w, float* dw, float* db, float* dx, bool accumulate) {
  blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
    layer_norm_backward(dy + r0 * D, xhat + r0 * D, rstd + r0, r1 - r0, D, w, dx + r0 * D, accumulate);
  });
  blocks(D, kColumns, [&](std::size_t j0, std::size_t j1) { column_sums(dy, xhat, rows, D, j0, j1, dw, db); });
}

void Kernels::bias_grad(const float* dy, std::size_t rows, std::size_t n, float* db) {
  blocks(n, kColumns, [&](std::size_t j0, std::size_t j1) { column_sums(dy, nullptr, rows, n, j0, j1, nullptr, db); });
}

void Kernels::embed(const float* wte, const float* wpe, const std::uint32_t* tokens, std::size_t BT, std::size_t T,
                    std::size_t D, float* out) {
  blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const float* e = wte + static_cast<std::size_t>(tokens[r]) * D;
      const float* p = wpe + (r % T) * D;
      for (std::size_t j = 0; j < D; ++j) out[r * D + j] = e[j] + p[j];
    }
  });
}

void Kernels::embed_backward(const float* dout, const std::uint32_t* tokens, std::size_t BT, std::size_t T,
                             std::size_t D, float* dwte, float* dwpe) {
  // Rows scatter into the token's and the position's rows: tasks take
  // columns, and each adds the rows in order.
  blocks(D, kColumns, [&](std::size_t j0, std::size_t j1) {
    for (std::size_t r = 0; r < BT; ++r) {
      float* e = dwte + static_cast<std::size_t>(tokens[r]) * D;
      float* p = dwpe + (r % T) * D;
      const float* d = dout + r * D;
      for (std::size_t j = j0; j < j1; ++j) {
        e[j] += d[j];
        p[j] += d[j];
      }
    }
  });
}

void Kernels::attention(Operand qkv, std::size_t B, std::size_t T, std::size_t D, std::size_t H, float* probs,
                        bf16_t* probs16, float* y) {
  const std::size_t hd = D / H;
  const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
  blocks(B * H, 1, [&](std::size_t bh, std::size_t) {
    const std::size_t b = bh / H, h = bh % H;
    const Operand q = qkv.at(b * T * 3 * D + h * hd), k = q.at(D), v = q.at(2 * D);
    float* att = probs + bh * T * T;
    product(false, true, T, T, hd, q, k, att, T, false);
    for (std::size_t i = 0; i < T; ++i) {
      // Row i sees keys 0..i; max(row) inv is max(row inv) exactly (inv > 0).
      float* row = att + i * T;
      const float mx = max_of(row, i + 1) * inv;
      for (std::size_t j = 0; j <= i; ++j) row[j] = exp_approx(row[j] * inv - mx);
      const float r = 1.0f / sum_of(row, i + 1);
      for (std::size_t j = 0; j <= i; ++j) row[j] *= r;
      for (std::size_t j = i + 1; j < T; ++j) row[j] = 0;
    }
    bf16_t* att16 = bf16_ ? probs16 + bh * T * T : nullptr;
    if (bf16_) pack_bf16(att, T, T, T, att16);
    product(false, false, T, hd, T, {att, att16, T}, v, y + b * T * D + h * hd, D, false);
  });
}

void Kernels::attention_backward(Operand qkv, Operand dys, const float* probs, const bf16_t* probs16, std::size_t B,
                                 std::size_t T, std::size_t D, std::size_t H, float* dqkv, float* dscores,
                                 bf16_t* dscores16) {
  const std::size_t hd = D / H;
  const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
  blocks(B * H, 1, [&](std::size_t bh, std::size_t) {
    const std::size_t b = bh / H, h = bh % H;
    const Operand q = qkv.at(b * T * 3 * D + h * hd), k = q.at(D), v = q.at(2 * D);
    const Operand dyh = dys.at(b * T * D + h * hd);
    const Operand att{probs + bh * T * T, bf16_ ? probs16 + bh * T * T : nullptr, T};
    float* dq = dqkv + b * T * 3 * D + h * hd;
    float* dk = dq + D;
    float* dv = dq + 2 * D;
    float* datt = dscores + bh * T * T;
    // dV = P^T dY; dP = dY V^T
    product(true, false, T, hd, T, att, dyh, dv, 3 * D, false);
    product(false, true, T, T, hd, dyh, v, datt, T, false);
    // dS = P (dP - rowsum(dP P)) / sqrt(hd)
    for (std::size_t i = 0; i < T; ++i) {
      const float* pr = att.f + i * T;
      float* dr = datt + i * T;
      const float dot = dot_of(pr, dr, i + 1);
      for (std::size_t j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot) * inv;
      for (std::size_t j = i + 1; j < T; ++j) dr[j] = 0;
    }
    bf16_t* ds16 = bf16_ ? dscores16 + bh * T * T : nullptr;
    if (bf16_) pack_bf16(datt, T, T, T, ds16);
    const Operand ds{datt, ds16, T};
    product(false, false, T, hd, T, ds, k, dq, 3 * D, false);
    product(true, false, T, hd, T, ds, q, dk, 3 * D, false);
  });
}

void Kernels::gelu(const float* f, std::size_t rows, std::size_t n, float* t, float* out, bf16_t* out16) {
  blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t i = r0 * n; i < r1 * n; ++i) {
      t[i] = tanh_approx(kGeluC * (f[i] + 0.044715f * f[i] * f[i] * f[i]));
      out[i] = 0.5f * f[i] * (1.0f + t[i]);
    }
    if (bf16_) pack_bf16(out + r0 * n, r1 - r0, n, n, out16 + r0 * n);
  });
}

void Kernels::gelu_backward(const float* fs, const float* ts, std::size_t rows, std::size_t n, float* df,
                            bf16_t* df16) {
  blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t i = r0 * n; i < r1 * n; ++i) {
      const float f = fs[i];
      const float t = ts[i];
      const float du = kGeluC * (1.0f + 3.0f * 0.044715f * f * f);
      df[i] *= 0.5f * (1.0f + t) + 0.5f * f * (1.0f - t * t) * du;
    }
    if (bf16_) pack_bf16(df + r0 * n, r1 - r0, n, n, df16 + r0 * n);
  });
}

void Kernels::cross_entropy(float* logits, const std::uint32_t* targets, std::size_t rows, std::size_t V,
                            std::size_t T, float scale, bool backward, double* row_loss, double* row_correct) {
  blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      float* z = logits + r * V;
      const std::uint32_t label = targets[r];
      const float mx = max_of(z, V);
      const float at_label = z[label];
      std::size_t arg = 0;
      while (arg + 1 < V && z[arg] != mx) ++arg;  // the first maximum
      // e = e^(z - max) (in place when backward follows: the logits are
      // not needed again; else in scratch, next_logits reads them); the
      // loss is log(sum e) + max - z[label], d loss / dz = e / sum - onehot.
      thread_local std::vector<float> scratch;
      if (!backward) scratch.resize(V);
      float* e = backward ? z : scratch.data();
      for (std::size_t j = 0; j < V; ++j) e[j] = exp_approx(z[j] - mx);
      const float sum = sum_of(e, V);
      row_loss[r] = (double(mx + std::log(sum)) - double(at_label)) / static_cast<double>(T);
      row_correct[r] = arg == label ? 1.0 / static_cast<double>(T) : 0.0;
      if (backward) {
        const float k = scale / sum;
        for (std::size_t j = 0; j < V; ++j) z[j] *= k;
        z[label] -= scale;
      }
    }
  });
}

}  // namespace distopt::models::gpt_kernels

namespace distopt::models {

bool bf16_products_native() {
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16_isa = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);  // AMX's includes its bits
  return (isa & bf16_isa) == bf16_isa;
}

bool bf16_products_available() {
  static const bool available = [] {
    using dnnl::memory;
    try {
      const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
      const memory::desc a({2, 2}, memory::data_type::bf16, memory::format_tag::ab);
      const memory::desc c({2, 2}, memory::data_type::f32, memory::format_tag::ab);
      (void)dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, a, c), engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

}  // namespace distopt::models
