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
//
// One file of ~860 lines on purpose: forward and backward of each layer
// sit together so a reader checks one against the other (and against
// scripts/gpt_torch.py) on adjacent screens, and the activations they share
// stay private to it; splitting forward from backward would spread one
// layer's math over two files.
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

// bfloat16 products (--matmul-precision bf16): the operands rounded to
// bfloat16 (to nearest, ties to even), products summed in float32, as
// oneDNN's bf16 matmul does on AVX512-BF16 (or AMX) at twice float32's rate.
using bf16_t = std::uint16_t;  // bfloat16's bits (distopt/core/dtype.hpp)

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
      throw InvalidInput(str("--matmul-precision bf16: oneDNN has no bfloat16 product of this shape on this CPU (", e.what(),
                      ")"));
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
    e.matmul.execute(stream, {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_BIAS, e.bias}, {DNNL_ARG_DST, e.c}});
  }
}

// A product's operand: a float matrix with leading dimension ld and, under
// bf16 products, the same matrix rounded (same layout) when the model keeps
// one (an activation read twice), else null (rounded when needed).
struct Operand {
  const float* f;
  const bf16_t* h;
  std::size_t ld;
  Operand at(std::size_t offset) const { return {f + offset, h != nullptr ? h + offset : nullptr, ld}; }
};

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

template <class... V>
std::size_t bytes_of(const V&... v) {
  return (std::size_t{0} + ... + (v.capacity() * sizeof(typename V::value_type)));
}

class Gpt final : public Model {
 public:
  Gpt(const GptShape& s, int threads, bool bf16_products, bool checkpoint)
      : s_(s), pool_(threads), bf16_(bf16_products), checkpoint_(checkpoint) {
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
    init_range(0, buffer, seed);
  }
  void init_range(std::size_t begin, std::span<float> out, std::uint64_t seed) const override {
    DISTOPT_CHECK(begin <= buffer_elements_ && out.size() <= buffer_elements_ - begin);
    std::fill(out.begin(), out.end(), 0.0f);
    const std::size_t end = begin + out.size();
    const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(s_.layers));
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const ParamSlot& p = params_[i];
      const std::size_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel());
      if (lo >= hi) continue;
      const std::string& n = p.name;
      auto ends = [&](const char* suffix) {
        const std::string sfx(suffix);
        return n.size() >= sfx.size() && n.compare(n.size() - sfx.size(), sfx.size(), sfx) == 0;
      };
      float* v = out.data() + (lo - begin);
      if (ends("ln_1.weight") || ends("ln_2.weight") || n == "ln_f.weight") {
        std::fill(v, v + (hi - lo), 1.0f);
      } else if (p.shape.size() == 2) {
        const double sd = ends("c_proj.weight") ? proj_std : 0.02;
        Rng rng(seed, 2000 + i);
        rng.discard(2 * (lo - p.offset));  // a normal() takes two
        for (std::size_t k = 0; k < hi - lo; ++k) v[k] = static_cast<float>(sd * rng.normal());
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
    // Under bf16 products: the product operands among them, rounded.
    std::vector<bf16_t> a16, qkv16, att16, y16, m16, g16;
  };

  std::size_t activation_bytes() const override {
    std::size_t bytes = 0;
    for (const BlockActs& a : acts_)
      bytes += bytes_of(a.xhat1, a.rstd1, a.a, a.qkv, a.att, a.y, a.xhat2, a.rstd2, a.m, a.f, a.t, a.g, a.a16, a.qkv16,
                        a.att16, a.y16, a.m16, a.g16);
    for (const auto& in : inputs_) bytes += bytes_of(in);
    return bytes;
  }
  std::size_t workspace_bytes() const override {
    return bytes_of(b16_, hf16_, d16_, dy16_, ds16_, resid_, xhatf_, rstdf_, hf_, logits_, dres_, dtmp_, dqkv_, datt_,
                    wte_, dwte_head_, tokens_, targets_, row_loss_, row_correct_);
  }

  BlockActs& acts_of(std::size_t l) { return acts_[checkpoint_ ? 0 : l]; }

  // A rounded copy's data, or null (float32 products keep none).
  static bf16_t* rounded_data(std::vector<bf16_t>& v) { return v.empty() ? nullptr : v.data(); }
  // A weight matrix: rounded by the product that reads it (once per product).
  static Operand weight(const float* w, std::size_t ld) { return {w, nullptr, ld}; }

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

  // One product in the model's precision, on the calling thread. Under bf16
  // products both operands come rounded.
  void product(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c,
               std::size_t ldc, bool accumulate) const {
    if (bf16_) gemm_bf16(ta, tb, m, n, k, a.h, a.ld, b.h, b.ld, c, ldc, accumulate);
    else gemm(ta, tb, m, n, k, a.f, a.ld, b.f, b.ld, c, ldc, accumulate);
  }

  // dst (rows x cols, dense) <- src (leading dimension ld) rounded to
  // bfloat16, on the pool; a no-op under float32 products.
  void round_rows(const float* src, std::size_t rows, std::size_t cols, std::size_t ld, bf16_t* dst) {
    if (!bf16_) return;
    blocks(rows, kRows, [&](std::size_t r0, std::size_t r1) {
      pack_bf16(src + r0 * ld, r1 - r0, cols, ld, dst + r0 * cols);
    });
  }

  // The operand's rounded form: its own, or b16_ (dense, ld = cols).
  Operand rounded(Operand x, std::size_t rows, std::size_t cols) {
    if (!bf16_ || x.h != nullptr) return x;
    if (b16_.size() < rows * cols) b16_.resize(rows * cols);
    round_rows(x.f, rows, cols, x.ld, b16_.data());
    return {nullptr, b16_.data(), cols};
  }

  // C = A op(B) (+ C) (+ bias, a row of n), A m x k row-major: tasks of
  // kRows rows, each adding the bias to its rows (inside the product under
  // bf16 products).
  void matmul(bool tb, std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c, std::size_t ldc,
              bool accumulate, const float* bias = nullptr) {
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

  // C = A^T B, A k x m and B k x n row-major, both kept rounded under bf16
  // products: a weight's gradient, summed over the k rows. Tasks take
  // blocks of C's rows (each whole over k).
  void matmul_tn(std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c, std::size_t ldc) {
    DISTOPT_CHECK(!bf16_ || (a.h != nullptr && b.h != nullptr), "a weight gradient's operands come rounded");
    const std::size_t block = m >= 3 * kRows ? kRows : kRows / 2;
    blocks(m, block, [&](std::size_t r0, std::size_t r1) {
      product(true, false, r1 - r0, n, k, a.at(r0), b, c + r0 * ldc, ldc, false);
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

  void bias_grad(const float* dy, std::size_t rows, std::size_t n, float* db) {
    blocks(n, kColumns, [&](std::size_t j0, std::size_t j1) { column_sums(dy, nullptr, rows, n, j0, j1, nullptr, db); });
  }

  void reserve(std::size_t batch) {
    if (batch <= capacity_ && !acts_.empty()) return;
    capacity_ = std::max(batch, capacity_);
    const std::size_t BT = capacity_ * s_.context, D = s_.dim, T = s_.context, H = s_.heads;
    // Activation checkpointing: one block's activations, recomputed in
    // backward from the block's input, which is all a layer keeps.
    acts_.assign(checkpoint_ ? 1 : s_.layers, {});
    inputs_.assign(checkpoint_ ? s_.layers : 0, std::vector<float>(BT * D, 0));
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
      if (bf16_) {
        b.a16.assign(BT * D, 0);
        b.qkv16.assign(BT * 3 * D, 0);
        b.att16.assign(capacity_ * H * T * T, 0);
        b.y16.assign(BT * D, 0);
        b.m16.assign(BT * D, 0);
        b.g16.assign(BT * 4 * D, 0);
      }
    }
    if (bf16_) {
      hf16_.assign(BT * D, 0);
      d16_.assign(BT * std::max(4 * D, s_.vocab), 0);
      dy16_.assign(BT * D, 0);
      ds16_.assign(capacity_ * H * T * T, 0);
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
      if (checkpoint_ && backward) std::copy(resid_.begin(), resid_.begin() + BT * D, inputs_[l].begin());
      block_forward(u.data(), acts_of(l), B);
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
    round_rows(hf_.data(), BT, D, D, rounded_data(hf16_));
    matmul(true, BT, V, D, {hf_.data(), rounded_data(hf16_), D}, weight(wte_.data(), D), logits_.data(), V, false);
    const float scale = grad_scale / static_cast<float>(T);
    blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
      for (std::size_t r = r0; r < r1; ++r) {
        float* z = logits_.data() + r * V;
        const std::uint32_t label = targets_[r];
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
        row_loss_[r] = (double(mx + std::log(sum)) - double(at_label)) / static_cast<double>(T);
        row_correct_[r] = arg == label ? 1.0 / static_cast<double>(T) : 0.0;
        if (backward) {
          const float k = scale / sum;
          for (std::size_t j = 0; j < V; ++j) z[j] *= k;
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
    round_rows(logits_.data(), BT, V, V, rounded_data(d16_));
    const Operand dlogits{logits_.data(), rounded_data(d16_), V};
    matmul(false, BT, D, V, dlogits, weight(wte_.data(), D), dtmp_.data(), D, false);
    matmul_tn(V, D, BT, dlogits, {hf_.data(), rounded_data(hf16_), D}, dwte_head_.data(), D);
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
      if (checkpoint_ && l + 1 < s_.layers) {
        // The block's forward again, from its input, into the one set of
        // activations (resid_ is free in backward): the same bits. The
        // last block's are still there from forward.
        std::copy(inputs_[l].begin(), inputs_[l].begin() + BT * D, resid_.begin());
        block_forward(u.data(), acts_of(l), B);
      }
      block_backward(u.data(), g.data(), acts_of(l), B);
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
    round_rows(a.a.data(), BT, D, D, rounded_data(a.a16));
    matmul(true, BT, 3 * D, D, {a.a.data(), rounded_data(a.a16), D}, weight(w + p.attn_w, D), a.qkv.data(), 3 * D,
           false, w + p.attn_b);
    round_rows(a.qkv.data(), BT, 3 * D, 3 * D, rounded_data(a.qkv16));
    const Operand qkv{a.qkv.data(), rounded_data(a.qkv16), 3 * D};
    const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
    blocks(B * H, 1, [&](std::size_t bh, std::size_t) {
      const std::size_t b = bh / H, h = bh % H;
      const Operand q = qkv.at(b * T * 3 * D + h * hd), k = q.at(D), v = q.at(2 * D);
      float* att = a.att.data() + bh * T * T;
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
      bf16_t* att16 = bf16_ ? a.att16.data() + bh * T * T : nullptr;
      if (bf16_) pack_bf16(att, T, T, T, att16);
      product(false, false, T, hd, T, {att, att16, T}, v, a.y.data() + b * T * D + h * hd, D, false);
    });
    round_rows(a.y.data(), BT, D, D, rounded_data(a.y16));
    // x1 = x + y Wproj^T + b, in place in resid_.
    matmul(true, BT, D, D, {a.y.data(), rounded_data(a.y16), D}, weight(w + p.proj_w, D), resid_.data(), D, true,
           w + p.proj_b);
    layer_norm_rows(resid_.data(), BT, w + p.ln2_w, w + p.ln2_b, a.m.data(), a.xhat2.data(), a.rstd2.data());
    round_rows(a.m.data(), BT, D, D, rounded_data(a.m16));
    matmul(true, BT, 4 * D, D, {a.m.data(), rounded_data(a.m16), D}, weight(w + p.fc_w, D), a.f.data(), 4 * D, false,
           w + p.fc_b);
    blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
      const float* f = a.f.data();
      float* t = a.t.data();
      float* gelu = a.g.data();
      for (std::size_t i = r0 * 4 * D; i < r1 * 4 * D; ++i) {
        t[i] = tanh_approx(kGeluC * (f[i] + 0.044715f * f[i] * f[i] * f[i]));
        gelu[i] = 0.5f * f[i] * (1.0f + t[i]);
      }
      if (bf16_) pack_bf16(gelu + r0 * 4 * D, r1 - r0, 4 * D, 4 * D, a.g16.data() + r0 * 4 * D);
    });
    matmul(true, BT, D, 4 * D, {a.g.data(), rounded_data(a.g16), 4 * D}, weight(w + p.mproj_w, 4 * D), resid_.data(),
           D, true, w + p.mproj_b);
  }

  // dres_ holds d(out); on return d(in). Gradients into g (zeroed).
  void block_backward(const float* w, float* g, BlockActs& a, std::size_t B) {
    const std::size_t T = s_.context, D = s_.dim, H = s_.heads, hd = D / H, BT = B * T;
    const BlockSlots& p = block_;
    bf16_t* d16 = rounded_data(d16_);  // the gradient read next, rounded
    // MLP: out = x1 + gelu(m Wfc^T + bfc) Wmp^T + bmp.
    bias_grad(dres_.data(), BT, D, g + p.mproj_b);
    round_rows(dres_.data(), BT, D, D, d16);
    matmul_tn(D, 4 * D, BT, {dres_.data(), d16, D}, {a.g.data(), rounded_data(a.g16), 4 * D}, g + p.mproj_w, 4 * D);
    float* df = dtmp_.data();  // BT x 4D
    matmul(false, BT, 4 * D, D, {dres_.data(), d16, D}, weight(w + p.mproj_w, 4 * D), df, 4 * D, false);
    blocks(BT, kRows, [&](std::size_t r0, std::size_t r1) {
      const float* fs = a.f.data();
      const float* ts = a.t.data();
      for (std::size_t i = r0 * 4 * D; i < r1 * 4 * D; ++i) {
        const float f = fs[i];
        const float t = ts[i];
        const float du = kGeluC * (1.0f + 3.0f * 0.044715f * f * f);
        df[i] *= 0.5f * (1.0f + t) + 0.5f * f * (1.0f - t * t) * du;
      }
      if (bf16_) pack_bf16(df + r0 * 4 * D, r1 - r0, 4 * D, 4 * D, d16 + r0 * 4 * D);
    });
    bias_grad(df, BT, 4 * D, g + p.fc_b);
    matmul_tn(4 * D, D, BT, {df, d16, 4 * D}, {a.m.data(), rounded_data(a.m16), D}, g + p.fc_w, D);
    float* dm = dqkv_.data();  // BT x D scratch
    matmul(false, BT, D, 4 * D, {df, d16, 4 * D}, weight(w + p.fc_w, D), dm, D, false);
    // d x1 = d out + LN2'(dm)
    layer_norm_grad(dm, a.xhat2.data(), a.rstd2.data(), BT, w + p.ln2_w, g + p.ln2_w, g + p.ln2_b, dres_.data(), true);
    // Attention: x1 = x + y Wproj^T + bproj.
    bias_grad(dres_.data(), BT, D, g + p.proj_b);
    round_rows(dres_.data(), BT, D, D, d16);
    matmul_tn(D, D, BT, {dres_.data(), d16, D}, {a.y.data(), rounded_data(a.y16), D}, g + p.proj_w, D);
    float* dy = dtmp_.data();  // BT x D
    matmul(false, BT, D, D, {dres_.data(), d16, D}, weight(w + p.proj_w, D), dy, D, false);
    round_rows(dy, BT, D, D, rounded_data(dy16_));
    const Operand qkv{a.qkv.data(), rounded_data(a.qkv16), 3 * D}, dys{dy, rounded_data(dy16_), D};
    const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
    float* dqkv = dqkv_.data();
    blocks(B * H, 1, [&](std::size_t bh, std::size_t) {
      const std::size_t b = bh / H, h = bh % H;
      const Operand q = qkv.at(b * T * 3 * D + h * hd), k = q.at(D), v = q.at(2 * D);
      const Operand dyh = dys.at(b * T * D + h * hd);
      const Operand att{a.att.data() + bh * T * T, bf16_ ? a.att16.data() + bh * T * T : nullptr, T};
      float* dq = dqkv + b * T * 3 * D + h * hd;
      float* dk = dq + D;
      float* dv = dq + 2 * D;
      float* datt = datt_.data() + bh * T * T;
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
      bf16_t* ds16 = bf16_ ? ds16_.data() + bh * T * T : nullptr;
      if (bf16_) pack_bf16(datt, T, T, T, ds16);
      const Operand ds{datt, ds16, T};
      product(false, false, T, hd, T, ds, k, dq, 3 * D, false);
      product(true, false, T, hd, T, ds, q, dk, 3 * D, false);
    });
    bias_grad(dqkv, BT, 3 * D, g + p.attn_b);
    round_rows(dqkv, BT, 3 * D, 3 * D, d16);
    matmul_tn(3 * D, D, BT, {dqkv, d16, 3 * D}, {a.a.data(), rounded_data(a.a16), D}, g + p.attn_w, D);
    float* da = dtmp_.data();
    matmul(false, BT, D, 3 * D, {dqkv, d16, 3 * D}, weight(w + p.attn_w, D), da, D, false);
    layer_norm_grad(da, a.xhat1.data(), a.rstd1.data(), BT, w + p.ln1_w, g + p.ln1_w, g + p.ln1_b, dres_.data(), true);
  }

  GptShape s_;
  ThreadPool pool_;
  bool bf16_;  // products in bfloat16 (--matmul-precision bf16)
  std::vector<bf16_t> b16_;  // a product's second operand, rounded
  std::vector<bf16_t> hf16_, d16_, dy16_, ds16_;  // rounded: ln_f's output, gradients, attention's dY and dS
  BlockSlots block_{};
  std::size_t wpe_at_ = 0, lnf_w_ = 0, lnf_b_ = 0;
  std::size_t capacity_ = 0;
  bool checkpoint_;  // activation checkpointing: acts_ holds one block's, inputs_ each block's input
  std::vector<BlockActs> acts_;
  std::vector<std::vector<float>> inputs_;
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

std::unique_ptr<Model> make_gpt(const GptShape& shape, int threads, MatmulPrecision precision,
                                bool activation_checkpointing) {
  if (shape.layers < 1) throw InvalidInput(str("--layers must be at least 1 (got ", shape.layers, ")"));
  if (shape.heads < 1) throw InvalidInput(str("--heads must be at least 1 (got ", shape.heads, ")"));
  if (shape.dim < 1 || shape.dim % shape.heads != 0)
    throw InvalidInput(str("--heads ", shape.heads, " does not divide --dim ", shape.dim,
                           ": every head needs dim / heads channels"));
  if (shape.context < 1) throw InvalidInput(str("--context must be at least 1 (got ", shape.context, ")"));
  if (shape.vocab < 2) throw InvalidInput("model gpt needs a vocabulary of at least 2 tokens");
  if (threads < 1) throw InvalidInput(str("--threads must be at least 1 (got ", threads, ")"));
  return std::make_unique<Gpt>(shape, threads, precision == MatmulPrecision::bf16, activation_checkpointing);
}

}  // namespace distopt::models
