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
// The kernels -- products, LayerNorm, attention, GELU, the loss, the
// embeddings, each forward next to its backward -- are in gpt_kernels.cpp,
// so that forward and backward here read as the model's sequence of kernel
// calls (as llm.c's train_gpt2.c), and the activations they share stay
// private to this file.
#include <algorithm>
#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"
#include "gpt_kernels.hpp"

namespace distopt::models {

namespace {

using gpt_kernels::bf16_t;
using gpt_kernels::Kernels;
using gpt_kernels::Operand;
using gpt_kernels::rounded_data;
using gpt_kernels::weight;

constexpr std::size_t kAlign = 16;  // elements: 64 bytes
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The parameters of one block, as offsets within its unit.
struct BlockSlots {
  std::size_t ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, mproj_w, mproj_b;
};

template <class... V>
std::size_t bytes_of(const V&... v) {
  return (std::size_t{0} + ... + (v.capacity() * sizeof(typename V::value_type)));
}

class Gpt final : public Model {
 public:
  Gpt(const GptShape& s, int threads, bool bf16_products, bool checkpoint)
      : s_(s), kernels_(threads, bf16_products), checkpoint_(checkpoint) {
    const std::size_t D = s.dim, V = s.vocab, T = s.context;
    features_ = T + 1;
    outputs_ = V;
    std::size_t offset = 0;
    auto add = [&](Unit& unit, const std::string& name, Shape shape) {
      std::size_t n = 1;
      for (auto e : shape) n *= static_cast<std::size_t>(e);
      unit.params.push_back(params_.size());
      offset = unit.begin + place_in_unit(offset - unit.begin, n);
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
    return {logits_.begin() + static_cast<std::ptrdiff_t>((n - 1) * V),
            logits_.begin() + static_cast<std::ptrdiff_t>(n * V)};
  }

  // GPT-2's: weights and embeddings ~ N(0, 0.02), the residual output
  // projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02 / sqrt(2 layers)),
  // biases 0, LayerNorm weights 1.
  void init(std::span<float> buffer, std::uint64_t seed) const override {
    DISTOPT_CHECK(buffer.size() == buffer_elements_);
    init_range(0, buffer, seed);
  }
  void init_range(std::size_t begin, std::span<float> out, std::uint64_t seed) const override {
    const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(s_.layers));
    init_each_param(begin, out, [&](std::size_t i, std::size_t first, std::span<float> values) {
      const ParamSlot& p = params_[i];
      const std::string& n = p.name;
      auto ends = [&](const char* suffix) {
        const std::string sfx(suffix);
        return n.size() >= sfx.size() && n.compare(n.size() - sfx.size(), sfx.size(), sfx) == 0;
      };
      if (ends("ln_1.weight") || ends("ln_2.weight") || n == "ln_f.weight") {
        std::fill(values.begin(), values.end(), 1.0f);
      } else if (p.shape.size() == 2) {
        const double sd = ends("c_proj.weight") ? proj_std : 0.02;
        Rng rng(seed, 2000 + i);
        rng.discard(2 * first);  // a normal() takes two
        for (float& v : values) v = static_cast<float>(sd * rng.normal());
      }
    });
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
    return kernels_.workspace_bytes() + bytes_of(hf16_, d16_, dy16_, ds16_, resid_, xhatf_, rstdf_, hf_, logits_, dres_,
                                                 dtmp_, dqkv_, datt_, wte_, dwte_head_, tokens_, targets_, row_loss_,
                                                 row_correct_);
  }

  BlockActs& acts_of(std::size_t l) { return acts_[checkpoint_ ? 0 : l]; }

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
      if (kernels_.bf16()) {
        b.a16.assign(BT * D, 0);
        b.qkv16.assign(BT * 3 * D, 0);
        b.att16.assign(capacity_ * H * T * T, 0);
        b.y16.assign(BT * D, 0);
        b.m16.assign(BT * D, 0);
        b.g16.assign(BT * 4 * D, 0);
      }
    }
    if (kernels_.bf16()) {
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
      kernels_.embed(wte, wpe, tokens_.data(), BT, T, D, resid_.data());
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
      kernels_.layer_norm_rows(resid_.data(), BT, D, u.data() + lnf_w_, u.data() + lnf_b_, hf_.data(), xhatf_.data(),
                               rstdf_.data());
      access.release(last, pass);
    }
    kernels_.round_rows(hf_.data(), BT, D, D, rounded_data(hf16_));
    kernels_.matmul(true, BT, V, D, {hf_.data(), rounded_data(hf16_), D}, weight(wte_.data(), D), logits_.data(), V,
                    false);
    const float scale = grad_scale / static_cast<float>(T);
    kernels_.cross_entropy(logits_.data(), targets_.data(), BT, V, T, scale, backward, row_loss_.data(),
                           row_correct_.data());
    BatchStats stats;
    stats.count = static_cast<double>(B);
    for (std::size_t r = 0; r < BT; ++r) {
      stats.loss_sum += row_loss_[r];
      stats.correct += row_correct_[r];
    }
    if (!backward) return stats;

    // Backward: dlogits is in logits_. The head: d hf = dlogits wte, and
    // wte's share dlogits^T hf (added to its gradient with the embeddings).
    kernels_.round_rows(logits_.data(), BT, V, V, rounded_data(d16_));
    const Operand dlogits{logits_.data(), rounded_data(d16_), V};
    kernels_.matmul(false, BT, D, V, dlogits, weight(wte_.data(), D), dtmp_.data(), D, false);
    kernels_.matmul_tn(V, D, BT, dlogits, {hf_.data(), rounded_data(hf16_), D}, dwte_head_.data(), D);
    {
      const std::size_t last = 1 + s_.layers;
      const std::span<const float> u = access.acquire(last, Pass::backward);
      const std::span<float> g = access.grads(last);
      std::fill(g.begin(), g.end(), 0.0f);
      kernels_.layer_norm_grad(dtmp_.data(), xhatf_.data(), rstdf_.data(), BT, D, u.data() + lnf_w_, g.data() + lnf_w_,
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
      kernels_.embed_backward(dres_.data(), tokens_.data(), BT, T, D, dwte, dwpe);
      access.release(0, Pass::backward);
      access.grads_done(0);
    }
    return stats;
  }

  // resid_ <- block(resid_), keeping what backward needs in `a`.
  void block_forward(const float* w, BlockActs& a, std::size_t B) {
    const std::size_t T = s_.context, D = s_.dim, H = s_.heads, BT = B * T;
    const BlockSlots& p = block_;
    Kernels& k = kernels_;
    k.layer_norm_rows(resid_.data(), BT, D, w + p.ln1_w, w + p.ln1_b, a.a.data(), a.xhat1.data(), a.rstd1.data());
    k.round_rows(a.a.data(), BT, D, D, rounded_data(a.a16));
    k.matmul(true, BT, 3 * D, D, {a.a.data(), rounded_data(a.a16), D}, weight(w + p.attn_w, D), a.qkv.data(), 3 * D,
             false, w + p.attn_b);
    k.round_rows(a.qkv.data(), BT, 3 * D, 3 * D, rounded_data(a.qkv16));
    k.attention({a.qkv.data(), rounded_data(a.qkv16), 3 * D}, B, T, D, H, a.att.data(), rounded_data(a.att16),
                a.y.data());
    k.round_rows(a.y.data(), BT, D, D, rounded_data(a.y16));
    // x1 = x + y Wproj^T + b, in place in resid_.
    k.matmul(true, BT, D, D, {a.y.data(), rounded_data(a.y16), D}, weight(w + p.proj_w, D), resid_.data(), D, true,
             w + p.proj_b);
    k.layer_norm_rows(resid_.data(), BT, D, w + p.ln2_w, w + p.ln2_b, a.m.data(), a.xhat2.data(), a.rstd2.data());
    k.round_rows(a.m.data(), BT, D, D, rounded_data(a.m16));
    k.matmul(true, BT, 4 * D, D, {a.m.data(), rounded_data(a.m16), D}, weight(w + p.fc_w, D), a.f.data(), 4 * D, false,
             w + p.fc_b);
    k.gelu(a.f.data(), BT, 4 * D, a.t.data(), a.g.data(), rounded_data(a.g16));
    k.matmul(true, BT, D, 4 * D, {a.g.data(), rounded_data(a.g16), 4 * D}, weight(w + p.mproj_w, 4 * D), resid_.data(),
             D, true, w + p.mproj_b);
  }

  // dres_ holds d(out); on return d(in). Gradients into g (zeroed).
  void block_backward(const float* w, float* g, BlockActs& a, std::size_t B) {
    const std::size_t T = s_.context, D = s_.dim, H = s_.heads, BT = B * T;
    const BlockSlots& p = block_;
    Kernels& k = kernels_;
    bf16_t* d16 = rounded_data(d16_);  // the gradient read next, rounded
    // MLP: out = x1 + gelu(m Wfc^T + bfc) Wmp^T + bmp.
    k.bias_grad(dres_.data(), BT, D, g + p.mproj_b);
    k.round_rows(dres_.data(), BT, D, D, d16);
    k.matmul_tn(D, 4 * D, BT, {dres_.data(), d16, D}, {a.g.data(), rounded_data(a.g16), 4 * D}, g + p.mproj_w, 4 * D);
    float* df = dtmp_.data();  // BT x 4D
    k.matmul(false, BT, 4 * D, D, {dres_.data(), d16, D}, weight(w + p.mproj_w, 4 * D), df, 4 * D, false);
    k.gelu_backward(a.f.data(), a.t.data(), BT, 4 * D, df, d16);
    k.bias_grad(df, BT, 4 * D, g + p.fc_b);
    k.matmul_tn(4 * D, D, BT, {df, d16, 4 * D}, {a.m.data(), rounded_data(a.m16), D}, g + p.fc_w, D);
    float* dm = dqkv_.data();  // BT x D scratch
    k.matmul(false, BT, D, 4 * D, {df, d16, 4 * D}, weight(w + p.fc_w, D), dm, D, false);
    // d x1 = d out + LN2'(dm)
    k.layer_norm_grad(dm, a.xhat2.data(), a.rstd2.data(), BT, D, w + p.ln2_w, g + p.ln2_w, g + p.ln2_b, dres_.data(),
                      true);
    // Attention: x1 = x + y Wproj^T + bproj.
    k.bias_grad(dres_.data(), BT, D, g + p.proj_b);
    k.round_rows(dres_.data(), BT, D, D, d16);
    k.matmul_tn(D, D, BT, {dres_.data(), d16, D}, {a.y.data(), rounded_data(a.y16), D}, g + p.proj_w, D);
    float* dy = dtmp_.data();  // BT x D
    k.matmul(false, BT, D, D, {dres_.data(), d16, D}, weight(w + p.proj_w, D), dy, D, false);
    k.round_rows(dy, BT, D, D, rounded_data(dy16_));
    const Operand qkv{a.qkv.data(), rounded_data(a.qkv16), 3 * D}, dys{dy, rounded_data(dy16_), D};
    float* dqkv = dqkv_.data();
    k.attention_backward(qkv, dys, a.att.data(), rounded_data(a.att16), B, T, D, H, dqkv, datt_.data(),
                         rounded_data(ds16_));
    k.bias_grad(dqkv, BT, 3 * D, g + p.attn_b);
    k.round_rows(dqkv, BT, 3 * D, 3 * D, d16);
    k.matmul_tn(3 * D, D, BT, {dqkv, d16, 3 * D}, {a.a.data(), rounded_data(a.a16), D}, g + p.attn_w, D);
    float* da = dtmp_.data();
    k.matmul(false, BT, D, 3 * D, {dqkv, d16, 3 * D}, weight(w + p.attn_w, D), da, D, false);
    k.layer_norm_grad(da, a.xhat1.data(), a.rstd1.data(), BT, D, w + p.ln1_w, g + p.ln1_w, g + p.ln1_b, dres_.data(),
                      true);
  }

  GptShape s_;
  Kernels kernels_;  // on the model's threads, in its product precision
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