// A decoder-only transformer as in GPT-2 (docs/models.md, "gpt"): token and
// learned position embeddings, pre-LayerNorm blocks of causal multi-head
// self-attention and a 4x MLP with tanh-approximated GELU, a final
// LayerNorm and an output projection tied to the token embedding, softmax
// cross-entropy on the next byte.
//
// A sample is context + 1 tokens (as floats): the model reads the first
// `context` and predicts each one's successor. Its loss is the mean over
// the context's positions, so the trainer's per-sample mean is the mean
// per-token loss, as torch's F.cross_entropy gives it.
//
// Weights are stored as torch's nn.Linear stores them, [out, in] row-major.
// Units: "embeddings" (wte, wpe), one per block "h.<i>", and "ln_f". The
// head reads wte from a copy taken when the embeddings unit is acquired in
// forward, so each unit is acquired once per pass in order (forward) or
// reverse order (backward); the head's share of wte's gradient waits in a
// buffer until the embeddings unit's backward adds it.
//
// Threads: a rank's forward and backward run on the model's ThreadPool
// (--threads). The work is cut into tasks that do not depend on the
// number of threads -- products by fixed blocks of rows, attention by
// (sample, head), reductions over rows by fixed blocks of columns, each
// summing its rows in order -- so the bits are the same at any count.
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/core/random.hpp"
#include "distopt/core/thread_pool.hpp"
#include "distopt/models/model.hpp"

// libgomp's (which oneDNN runs on); declared here so that no OpenMP
// compiler flag touches the other models (Eigen would thread under it).
extern "C" void omp_set_num_threads(int);

namespace distopt::models {

namespace {

constexpr std::size_t kAlign = 16;  // elements: 64 bytes
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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
void gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, const float* a, std::size_t lda,
          const float* b, std::size_t ldb, float* c, std::size_t ldc, bool accumulate) {
  thread_local const bool one_thread = [] {
    omp_set_num_threads(1);
    return true;
  }();
  (void)one_thread;
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', static_cast<dnnl_dim_t>(m), static_cast<dnnl_dim_t>(n),
                 static_cast<dnnl_dim_t>(k), 1.0f, a, static_cast<dnnl_dim_t>(lda), b, static_cast<dnnl_dim_t>(ldb),
                 accumulate ? 1.0f : 0.0f, c, static_cast<dnnl_dim_t>(ldc));
  DISTOPT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(st));
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

// The parameters of one block, as offsets within its unit.
struct BlockSlots {
  std::size_t ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, mproj_w, mproj_b;
};

// LayerNorm over rows of d elements (eps 1e-5, torch's): y = xhat * w + b,
// keeping xhat and 1 / std for backward.
void layer_norm(const float* x, std::size_t rows, std::size_t d, const float* w, const float* b, float* y, float* xhat,
                float* rstd) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float mean = 0;
    for (std::size_t j = 0; j < d; ++j) mean += xr[j];
    mean /= static_cast<float>(d);
    float var = 0;
    for (std::size_t j = 0; j < d; ++j) {
      const float e = xr[j] - mean;
      var += e * e;
    }
    var /= static_cast<float>(d);
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
    float mean_g = 0, mean_gh = 0;
    for (std::size_t j = 0; j < d; ++j) {
      const float gw = g[j] * w[j];
      mean_g += gw;
      mean_gh += gw * h[j];
    }
    mean_g /= static_cast<float>(d);
    mean_gh /= static_cast<float>(d);
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

class Gpt final : public Model {
 public:
  Gpt(const GptShape& s, int threads) : s_(s), pool_(threads) {
    const std::size_t D = s.dim, V = s.vocab, T = s.context;
    features_ = T + 1;
    outputs_ = V;
    std::size_t offset = 0;
    auto add = [&](Unit& unit, const std::string& name, Shape shape) {
      std::size_t n = 1;
      for (auto e : shape) n *= static_cast<std::size_t>(e);
      unit.params.push_back(params_.size());
      params_.push_back({name, offset, std::move(shape)});
      const std::size_t at = offset - unit.begin;
      offset += round_up(n);
      return at;
    };
    const auto d = static_cast<std::int64_t>(D);
    Unit emb{"embeddings", offset, 0, {}};
    add(emb, "wte", {static_cast<std::int64_t>(V), d});
    wpe_at_ = add(emb, "wpe", {static_cast<std::int64_t>(T), d});
    emb.end = offset;
    units_.push_back(std::move(emb));
    for (std::size_t l = 0; l < s.layers; ++l) {
      const std::string p = "h." + std::to_string(l) + ".";
      Unit u{"h." + std::to_string(l), offset, 0, {}};
      BlockSlots b{};
      b.ln1_w = add(u, p + "ln_1.weight", {d});
      b.ln1_b = add(u, p + "ln_1.bias", {d});
      b.attn_w = add(u, p + "attn.c_attn.weight", {3 * d, d});
      b.attn_b = add(u, p + "attn.c_attn.bias", {3 * d});
      b.proj_w = add(u, p + "attn.c_proj.weight", {d, d});
      b.proj_b = add(u, p + "attn.c_proj.bias", {d});
      b.ln2_w = add(u, p + "ln_2.weight", {d});
      b.ln2_b = add(u, p + "ln_2.bias", {d});
      b.fc_w = add(u, p + "mlp.c_fc.weight", {4 * d, d});
      b.fc_b = add(u, p + "mlp.c_fc.bias", {4 * d});
      b.mproj_w = add(u, p + "mlp.c_proj.weight", {d, 4 * d});
      b.mproj_b = add(u, p + "mlp.c_proj.bias", {d});
      if (l == 0) block_ = b;
      DISTOPT_CHECK(b.mproj_b == block_.mproj_b, "blocks share one layout");
      u.end = offset;
      units_.push_back(std::move(u));
    }
    Unit fin{"ln_f", offset, 0, {}};
    lnf_w_ = add(fin, "ln_f.weight", {d});
    lnf_b_ = add(fin, "ln_f.bias", {d});
    fin.end = offset;
    units_.push_back(std::move(fin));
    buffer_elements_ = offset;
  }

  std::string_view name() const override { return "gpt"; }
  const GptShape& shape() const { return s_; }

  // The logits after tokens[0..n): causal attention makes position n - 1's
  // output independent of what follows, so the window is padded with zeros.
  std::vector<float> next_logits(UnitAccess& access, std::span<const std::uint32_t> tokens) {
    const std::size_t n = tokens.size(), T = s_.context, V = s_.vocab;
    if (n < 1 || n > T) throw InvalidInput(str("gpt reads 1 to ", T, " tokens at a time (got ", n, ")"));
    std::vector<float> window(T + 1, 0.0f);
    for (std::size_t t = 0; t < n; ++t) {
      if (tokens[t] >= V) throw InvalidInput(str("token ", tokens[t], " is outside the vocabulary of ", V));
      window[t] = static_cast<float>(tokens[t]);
    }
    (void)run(access, window.data(), 1, 1.0f, false);
    return {logits_.begin() + static_cast<std::ptrdiff_t>((n - 1) * V), logits_.begin() + static_cast<std::ptrdiff_t>(n * V)};
  }

  // GPT-2's: weights and embeddings ~ N(0, 0.02), the residual output
  // projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02 / sqrt(2 layers)),
  // biases 0, LayerNorm weights 1.
  void init(std::span<float> buffer, std::uint64_t seed) const override {
    DISTOPT_CHECK(buffer.size() == buffer_elements_);
    std::fill(buffer.begin(), buffer.end(), 0.0f);
    const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(s_.layers));
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const ParamSlot& p = params_[i];
      const std::string& n = p.name;
      auto ends = [&](const char* suffix) {
        const std::string sfx(suffix);
        return n.size() >= sfx.size() && n.compare(n.size() - sfx.size(), sfx.size(), sfx) == 0;
      };
      float* v = buffer.data() + p.offset;
      if (ends("ln_1.weight") || ends("ln_2.weight") || n == "ln_f.weight") {
        std::fill(v, v + p.numel(), 1.0f);
      } else if (p.shape.size() == 2) {
        const double sd = ends("c_proj.weight") ? proj_std : 0.02;
        Rng rng(seed, 2000 + i);
        for (std::size_t k = 0; k < p.numel(); ++k) v[k] = static_cast<float>(sd * rng.normal());
      }
    }
  }

 protected:
  BatchStats do_forward_backward(UnitAccess& access, const float* x, const float* /*y*/, std::size_t n,
                                 float grad_scale) override {
    return run(access, x, n, grad_scale, true);
  }
  BatchStats do_evaluate(UnitAccess& access, const float* x, const float* /*y*/, std::size_t n) override {
    return run(access, x, n, 1.0f, false);
  }

 private:
  // Activations of one block kept for backward.
  struct BlockActs {
    std::vector<float> xhat1, rstd1, a;  // LN1
    std::vector<float> qkv;     // BT x 3D
    std::vector<float> att;     // B x H x T x T probabilities
    std::vector<float> y;       // attention output before c_proj, BT x D
    std::vector<float> xhat2, rstd2, m;  // LN2 of x + attn
    std::vector<float> f, t, g;  // BT x 4D: before GELU, its tanh, after
  };

  // f(begin, end) over [0, n) in blocks of `block`, on the pool, each task
  // in the calling thread's floating-point mode (flushing denormals or not).
  template <class F>
  void blocks(std::size_t n, std::size_t block, F&& f) {
    const unsigned control = fp_control();
    pool_.parallel_for((n + block - 1) / block, [&](std::size_t i) {
      set_fp_control(control);
      f(i * block, std::min(n, (i + 1) * block));
    });
  }

  // C = A op(B) (+ C), A m x k row-major: tasks of kRows rows.
  void matmul(bool tb, std::size_t m, std::size_t n, std::size_t k, const float* a, std::size_t lda, const float* b,
              std::size_t ldb, float* c, std::size_t ldc, bool accumulate) {
    blocks(m, kRows, [&](std::size_t r0, std::size_t r1) {
      gemm(false, tb, r1 - r0, n, k, a + r0 * lda, lda, b, ldb, c + r0 * ldc, ldc, accumulate);
    });
  }

  // C = A^T B, A k x m and B k x n row-major: a weight's gradient, summed
  // over the k rows. Tasks take blocks of C's rows (each whole over k).
  void matmul_tn(std::size_t m, std::size_t n, std::size_t k, const float* a, std::size_t lda, const float* b,
                 std::size_t ldb, float* c, std::size_t ldc) {
    const std::size_t block = m >= 3 * kRows ? kRows : kRows / 2;
    blocks(m, block, [&](std::size_t r0, std::size_t r1) {
      gemm(true, false, r1 - r0, n, k, a + r0, lda, b, ldb, c + r0 * ldc, ldc, false);
    });
  }

  void layer_norm_rows(const float* x, std::size_t rows, const float* w, const float* b, float* y, float* xhat,
                       float* rstd) {
    const std::size_t D = s_.dim;
    blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
      layer_norm(x + r0 * D, r1 - r0, D, w, b, y + r0 * D, xhat + r0 * D, rstd + r0);
    });
  }

  // LayerNorm's backward: dx (+)= d input, dw and db += its gradient.
  void layer_norm_grad(const float* dy, const float* xhat, const float* rstd, std::size_t rows, const float* w,
                       float* dw, float* db, float* dx, bool accumulate) {
    const std::size_t D = s_.dim;
    blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
      layer_norm_backward(dy + r0 * D, xhat + r0 * D, rstd + r0, r1 - r0, D, w, dx + r0 * D, accumulate);
    });
    blocks(D, kColumns, [&](std::size_t j0, std::size_t j1) { column_sums(dy, xhat, rows, D, j0, j1, dw, db); });
  }

  void bias_rows(float* y, std::size_t rows, std::size_t n, const float* b) {
    blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) { add_bias(y + r0 * n, r1 - r0, n, b); });
  }

  void bias_grad(const float* dy, std::size_t rows, std::size_t n, float* db) {
    blocks(n, kColumns, [&](std::size_t j0, std::size_t j1) { column_sums(dy, nullptr, rows, n, j0, j1, nullptr, db); });
  }

  void reserve(std::size_t batch) {
    if (batch <= capacity_ && !acts_.empty()) return;
    capacity_ = std::max(batch, capacity_);
    const std::size_t BT = capacity_ * s_.context, D = s_.dim, T = s_.context, H = s_.heads;
    acts_.assign(s_.layers, {});
    for (BlockActs& b : acts_) {
      b.xhat1.assign(BT * D, 0);
      b.rstd1.assign(BT, 0);
      b.a.assign(BT * D, 0);
      b.qkv.assign(BT * 3 * D, 0);
      b.att.assign(capacity_ * H * T * T, 0);
      b.y.assign(BT * D, 0);
      b.xhat2.assign(BT * D, 0);
      b.rstd2.assign(BT, 0);
      b.m.assign(BT * D, 0);
      b.f.assign(BT * 4 * D, 0);
      b.t.assign(BT * 4 * D, 0);
      b.g.assign(BT * 4 * D, 0);
    }
    resid_.assign(BT * D, 0);
    xhatf_.assign(BT * D, 0);
    rstdf_.assign(BT, 0);
    hf_.assign(BT * D, 0);
    logits_.assign(BT * s_.vocab, 0);
    dres_.assign(BT * D, 0);
    dtmp_.assign(BT * 4 * D, 0);
    dqkv_.assign(BT * 3 * D, 0);
    datt_.assign(capacity_ * H * T * T, 0);
    wte_.assign(s_.vocab * D, 0);
    dwte_head_.assign(s_.vocab * D, 0);
    tokens_.assign(BT, 0);
    targets_.assign(BT, 0);
    row_loss_.assign(BT, 0);
    row_correct_.assign(BT, 0);
  }

  BatchStats run(UnitAccess& access, const float* x, std::size_t B, float grad_scale, bool backward) {
    reserve(std::max<std::size_t>(B, 1));
    const std::size_t T = s_.context, D = s_.dim, V = s_.vocab, BT = B * T;
    const Pass pass = backward ? Pass::forward : Pass::evaluate;
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t t = 0; t < T; ++t) {
        const float in = x[b * (T + 1) + t], out = x[b * (T + 1) + t + 1];
        DISTOPT_CHECK(in >= 0 && in < static_cast<float>(V) && out >= 0 && out < static_cast<float>(V),
                      "token out of the vocabulary: ", in, " ", out);
        tokens_[b * T + t] = static_cast<std::uint32_t>(in);
        targets_[b * T + t] = static_cast<std::uint32_t>(out);
      }

    // Embeddings.
    {
      const std::span<const float> u = access.acquire(0, pass);
      const float* wte = u.data();
      const float* wpe = u.data() + wpe_at_;
      std::copy(wte, wte + V * D, wte_.begin());
      blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r) {
          const float* e = wte + static_cast<std::size_t>(tokens_[r]) * D;
          const float* p = wpe + (r % T) * D;
          for (std::size_t j = 0; j < D; ++j) resid_[r * D + j] = e[j] + p[j];
        }
      });
      access.release(0, pass);
    }
    for (std::size_t l = 0; l < s_.layers; ++l) {
      const std::span<const float> u = access.acquire(1 + l, pass);
      block_forward(u.data(), acts_[l], B);
      access.release(1 + l, pass);
    }
    // Final LayerNorm, then the tied head.
    {
      const std::size_t last = 1 + s_.layers;
      const std::span<const float> u = access.acquire(last, pass);
      layer_norm_rows(resid_.data(), BT, u.data() + lnf_w_, u.data() + lnf_b_, hf_.data(), xhatf_.data(),
                      rstdf_.data());
      access.release(last, pass);
    }
    matmul(true, BT, V, D, hf_.data(), D, wte_.data(), D, logits_.data(), V, false);
    const float scale = grad_scale / static_cast<float>(T);
    blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
      for (std::size_t r = r0; r < r1; ++r) {
        float* z = logits_.data() + r * V;
        const std::uint32_t label = targets_[r];
        std::size_t arg = 0;
        float mx = z[0];
        for (std::size_t j = 1; j < V; ++j)
          if (z[j] > mx) mx = z[j], arg = j;
        float sum = 0;
        for (std::size_t j = 0; j < V; ++j) sum += exp_approx(z[j] - mx);
        const float lse = mx + std::log(sum);
        row_loss_[r] = (double(lse) - double(z[label])) / static_cast<double>(T);
        row_correct_[r] = arg == label ? 1.0 / static_cast<double>(T) : 0.0;
        if (backward) {
          for (std::size_t j = 0; j < V; ++j) z[j] = exp_approx(z[j] - lse) * scale;
          z[label] -= scale;
        }
      }
    });
    BatchStats stats;
    stats.count = static_cast<double>(B);
    for (std::size_t r = 0; r < BT; ++r) {
      stats.loss_sum += row_loss_[r];
      stats.correct += row_correct_[r];
    }
    if (!backward) return stats;

    // Backward: dlogits is in logits_. The head: d hf = dlogits wte, and
    // wte's share dlogits^T hf (added to its gradient with the embeddings).
    matmul(false, BT, D, V, logits_.data(), V, wte_.data(), D, dtmp_.data(), D, false);
    matmul_tn(V, D, BT, logits_.data(), V, hf_.data(), D, dwte_head_.data(), D);
    {
      const std::size_t last = 1 + s_.layers;
      const std::span<const float> u = access.acquire(last, Pass::backward);
      const std::span<float> g = access.grads(last);
      std::fill(g.begin(), g.end(), 0.0f);
      layer_norm_grad(dtmp_.data(), xhatf_.data(), rstdf_.data(), BT, u.data() + lnf_w_, g.data() + lnf_w_,
                      g.data() + lnf_b_, dres_.data(), false);
      access.release(last, Pass::backward);
      access.grads_done(last);
    }
    for (std::size_t l = s_.layers; l-- > 0;) {
      const std::span<const float> u = access.acquire(1 + l, Pass::backward);
      const std::span<float> g = access.grads(1 + l);
      std::fill(g.begin(), g.end(), 0.0f);
      block_backward(u.data(), g.data(), acts_[l], B);
      access.release(1 + l, Pass::backward);
      access.grads_done(1 + l);
    }
    {
      (void)access.acquire(0, Pass::backward);
      const std::span<float> g = access.grads(0);
      std::fill(g.begin(), g.end(), 0.0f);
      float* dwte = g.data();
      float* dwpe = g.data() + wpe_at_;
      std::copy(dwte_head_.begin(), dwte_head_.end(), dwte);
      // Rows scatter into the token's and the position's rows: tasks take
      // columns, and each adds the rows in order.
      blocks(D, kColumns, [&](std::size_t j0, std::size_t j1) {
        for (std::size_t r = 0; r < BT; ++r) {
          float* e = dwte + static_cast<std::size_t>(tokens_[r]) * D;
          float* p = dwpe + (r % T) * D;
          const float* d = dres_.data() + r * D;
          for (std::size_t j = j0; j < j1; ++j) {
            e[j] += d[j];
            p[j] += d[j];
          }
        }
      });
      access.release(0, Pass::backward);
      access.grads_done(0);
    }
    return stats;
  }

  // resid_ <- block(resid_), keeping what backward needs in `a`.
  void block_forward(const float* w, BlockActs& a, std::size_t B) {
    const std::size_t T = s_.context, D = s_.dim, H = s_.heads, hd = D / H, BT = B * T;
    const BlockSlots& p = block_;
    layer_norm_rows(resid_.data(), BT, w + p.ln1_w, w + p.ln1_b, a.a.data(), a.xhat1.data(), a.rstd1.data());
    matmul(true, BT, 3 * D, D, a.a.data(), D, w + p.attn_w, D, a.qkv.data(), 3 * D, false);
    bias_rows(a.qkv.data(), BT, 3 * D, w + p.attn_b);
    const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
    pool_.parallel_for(B * H, [&, control = fp_control()](std::size_t bh) {
      set_fp_control(control);
      const std::size_t b = bh / H, h = bh % H;
      const float* q = a.qkv.data() + b * T * 3 * D + h * hd;
      const float* k = q + D;
      const float* v = q + 2 * D;
      float* att = a.att.data() + bh * T * T;
      gemm(false, true, T, T, hd, q, 3 * D, k, 3 * D, att, T, false);
      for (std::size_t i = 0; i < T; ++i) {
        float* row = att + i * T;
        float mx = -INFINITY;
        for (std::size_t j = 0; j <= i; ++j) mx = std::max(mx, row[j] * inv);
        float sum = 0;
        for (std::size_t j = 0; j <= i; ++j) {
          row[j] = exp_approx(row[j] * inv - mx);
          sum += row[j];
        }
        const float r = 1.0f / sum;
        for (std::size_t j = 0; j <= i; ++j) row[j] *= r;
        for (std::size_t j = i + 1; j < T; ++j) row[j] = 0;
      }
      gemm(false, false, T, hd, T, att, T, v, 3 * D, a.y.data() + b * T * D + h * hd, D, false);
    });
    // x1 = x + y Wproj^T + b, in place in resid_.
    matmul(true, BT, D, D, a.y.data(), D, w + p.proj_w, D, resid_.data(), D, true);
    bias_rows(resid_.data(), BT, D, w + p.proj_b);
    layer_norm_rows(resid_.data(), BT, w + p.ln2_w, w + p.ln2_b, a.m.data(), a.xhat2.data(), a.rstd2.data());
    matmul(true, BT, 4 * D, D, a.m.data(), D, w + p.fc_w, D, a.f.data(), 4 * D, false);
    blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
      add_bias(a.f.data() + r0 * 4 * D, r1 - r0, 4 * D, w + p.fc_b);
      for (std::size_t i = r0 * 4 * D; i < r1 * 4 * D; ++i) {
        const float f = a.f[i];
        a.t[i] = tanh_approx(kGeluC * (f + 0.044715f * f * f * f));
        a.g[i] = 0.5f * f * (1.0f + a.t[i]);
      }
    });
    matmul(true, BT, D, 4 * D, a.g.data(), 4 * D, w + p.mproj_w, 4 * D, resid_.data(), D, true);
    bias_rows(resid_.data(), BT, D, w + p.mproj_b);
  }

  // dres_ holds d(out); on return d(in). Gradients into g (zeroed).
  void block_backward(const float* w, float* g, BlockActs& a, std::size_t B) {
    const std::size_t T = s_.context, D = s_.dim, H = s_.heads, hd = D / H, BT = B * T;
    const BlockSlots& p = block_;
    // MLP: out = x1 + gelu(m Wfc^T + bfc) Wmp^T + bmp.
    bias_grad(dres_.data(), BT, D, g + p.mproj_b);
    matmul_tn(D, 4 * D, BT, dres_.data(), D, a.g.data(), 4 * D, g + p.mproj_w, 4 * D);
    float* df = dtmp_.data();  // BT x 4D
    matmul(false, BT, 4 * D, D, dres_.data(), D, w + p.mproj_w, 4 * D, df, 4 * D, false);
    blocks(BT * 4 * D, kRows * 4 * D, [&](std::size_t i0, std::size_t i1) {
      for (std::size_t i = i0; i < i1; ++i) {
        const float f = a.f[i];
        const float t = a.t[i];
        const float du = kGeluC * (1.0f + 3.0f * 0.044715f * f * f);
        df[i] *= 0.5f * (1.0f + t) + 0.5f * f * (1.0f - t * t) * du;
      }
    });
    bias_grad(df, BT, 4 * D, g + p.fc_b);
    matmul_tn(4 * D, D, BT, df, 4 * D, a.m.data(), D, g + p.fc_w, D);
    float* dm = dqkv_.data();  // BT x D scratch
    matmul(false, BT, D, 4 * D, df, 4 * D, w + p.fc_w, D, dm, D, false);
    // d x1 = d out + LN2'(dm)
    layer_norm_grad(dm, a.xhat2.data(), a.rstd2.data(), BT, w + p.ln2_w, g + p.ln2_w, g + p.ln2_b, dres_.data(), true);
    // Attention: x1 = x + y Wproj^T + bproj.
    bias_grad(dres_.data(), BT, D, g + p.proj_b);
    matmul_tn(D, D, BT, dres_.data(), D, a.y.data(), D, g + p.proj_w, D);
    float* dy = dtmp_.data();  // BT x D
    matmul(false, BT, D, D, dres_.data(), D, w + p.proj_w, D, dy, D, false);
    const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
    float* dqkv = dqkv_.data();
    pool_.parallel_for(B * H, [&, control = fp_control()](std::size_t bh) {
      set_fp_control(control);
      const std::size_t b = bh / H, h = bh % H;
      const float* q = a.qkv.data() + b * T * 3 * D + h * hd;
      const float* k = q + D;
      const float* v = q + 2 * D;
      float* dq = dqkv + b * T * 3 * D + h * hd;
      float* dk = dq + D;
      float* dv = dq + 2 * D;
      const float* att = a.att.data() + bh * T * T;
      const float* dyh = dy + b * T * D + h * hd;
      float* datt = datt_.data() + bh * T * T;
      // dV = P^T dY; dP = dY V^T
      gemm(true, false, T, hd, T, att, T, dyh, D, dv, 3 * D, false);
      gemm(false, true, T, T, hd, dyh, D, v, 3 * D, datt, T, false);
      // dS = P (dP - rowsum(dP P)) / sqrt(hd)
      for (std::size_t i = 0; i < T; ++i) {
        const float* pr = att + i * T;
        float* dr = datt + i * T;
        float dot = 0;
        for (std::size_t j = 0; j <= i; ++j) dot += pr[j] * dr[j];
        for (std::size_t j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot) * inv;
        for (std::size_t j = i + 1; j < T; ++j) dr[j] = 0;
      }
      gemm(false, false, T, hd, T, datt, T, k, 3 * D, dq, 3 * D, false);
      gemm(true, false, T, hd, T, datt, T, q, 3 * D, dk, 3 * D, false);
    });
    bias_grad(dqkv, BT, 3 * D, g + p.attn_b);
    matmul_tn(3 * D, D, BT, dqkv, 3 * D, a.a.data(), D, g + p.attn_w, D);
    float* da = dtmp_.data();
    matmul(false, BT, D, 3 * D, dqkv, 3 * D, w + p.attn_w, D, da, D, false);
    layer_norm_grad(da, a.xhat1.data(), a.rstd1.data(), BT, w + p.ln1_w, g + p.ln1_w, g + p.ln1_b, dres_.data(), true);
  }

  GptShape s_;
  ThreadPool pool_;
  BlockSlots block_{};
  std::size_t wpe_at_ = 0, lnf_w_ = 0, lnf_b_ = 0;
  std::size_t capacity_ = 0;
  std::vector<BlockActs> acts_;
  std::vector<float> resid_, xhatf_, rstdf_, hf_, logits_, dres_, dtmp_, dqkv_, datt_, wte_, dwte_head_;
  std::vector<std::uint32_t> tokens_, targets_;
  std::vector<double> row_loss_, row_correct_;
};

}  // namespace

std::vector<float> gpt_next_logits(Model& gpt, std::span<const float> buffer, std::span<const std::uint32_t> tokens) {
  auto* g = dynamic_cast<Gpt*>(&gpt);
  DISTOPT_CHECK(g != nullptr, "gpt_next_logits on model ", gpt.name());
  BufferAccess access(gpt, buffer);
  return g->next_logits(access, tokens);
}

std::unique_ptr<Model> make_gpt(const GptShape& shape, int threads) {
  if (shape.layers < 1) throw InvalidInput(str("--layers must be at least 1 (got ", shape.layers, ")"));
  if (shape.heads < 1) throw InvalidInput(str("--heads must be at least 1 (got ", shape.heads, ")"));
  if (shape.dim < 1 || shape.dim % shape.heads != 0)
    throw InvalidInput(str("--heads ", shape.heads, " does not divide --dim ", shape.dim,
                           ": every head needs dim / heads channels"));
  if (shape.context < 1) throw InvalidInput(str("--context must be at least 1 (got ", shape.context, ")"));
  if (shape.vocab < 2) throw InvalidInput("model gpt needs a vocabulary of at least 2 tokens");
  if (threads < 1) throw InvalidInput(str("--threads must be at least 1 (got ", threads, ")"));
  return std::make_unique<Gpt>(shape, threads);
}

}  // namespace distopt::models
