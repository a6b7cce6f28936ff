// Model "gpt" (src/models/gpt.cpp): its loss and every gradient against
// PyTorch's (tests/golden/gpt, from scripts/gen_golden_gpt.py), against
// finite differences, and its unit structure under the strategies.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"

using namespace distopt;

namespace {

struct Golden {
  models::GptShape shape;
  std::size_t batch = 0;
  float loss = 0;
  std::vector<float> tokens;
  std::map<std::string, std::vector<float>> tensors;  // param.<name>, grad.<name>
};

Golden read_golden(const std::string& name) {
  const auto t = checkpoint::read_safetensors(std::string(DISTOPT_SOURCE_DIR) + "/tests/golden/gpt/" + name + ".safetensors");
  Golden g;
  auto meta = [&](const char* key) { return static_cast<std::size_t>(std::stoul(t.metadata.at(key))); };
  g.shape = {meta("layers"), meta("heads"), meta("dim"), meta("context"), 256};
  g.batch = meta("batch");
  for (const ParamSlot& s : t.slots) {
    std::vector<float> v(t.data.begin() + static_cast<std::ptrdiff_t>(s.offset),
                         t.data.begin() + static_cast<std::ptrdiff_t>(s.offset + s.numel()));
    if (s.name == "loss") g.loss = v.at(0);
    else if (s.name == "tokens") g.tokens = std::move(v);
    else g.tensors[s.name] = std::move(v);
  }
  return g;
}

}  // namespace

// Against torch's loss and gradients, plain and with activation
// checkpointing (which must give the same bits).
TEST(Gpt, LossAndEveryGradientMatchPyTorch) {
  for (const bool checkpoint : {false, true})
  for (const std::string name : {"tiny", "small", "wide"}) {
    SCOPED_TRACE(name + (checkpoint ? " checkpointed" : ""));
    const Golden g = read_golden(name);
    auto model = models::make_gpt(g.shape, 1, models::MatmulPrecision::f32, checkpoint);
    std::vector<float> buffer(model->buffer_elements(), 0.0f), grads(model->buffer_elements(), 1.0f);
    ASSERT_EQ(model->params().size() * 2, g.tensors.size());
    for (const ParamSlot& p : model->params()) {
      const auto& w = g.tensors.at("param." + p.name);
      ASSERT_EQ(w.size(), p.numel()) << p.name;
      std::copy(w.begin(), w.end(), buffer.begin() + static_cast<std::ptrdiff_t>(p.offset));
    }
    ASSERT_EQ(g.tokens.size(), g.batch * (g.shape.context + 1));
    const std::vector<float> unused(g.batch, 0.0f);
    const models::BatchStats s = model->forward_backward(buffer, g.tokens.data(), unused.data(), g.batch,
                                                         1.0f / static_cast<float>(g.batch), grads);
    EXPECT_NEAR(s.loss_sum / s.count, g.loss, 1e-5 * g.loss);
    double worst = 0;
    for (const ParamSlot& p : model->params()) {
      const auto& want = g.tensors.at("grad." + p.name);
      double diff = 0, scale = 0;
      for (std::size_t k = 0; k < p.numel(); ++k) {
        diff = std::max(diff, std::abs(double(grads[p.offset + k]) - want[k]));
        scale = std::max(scale, std::abs(double(want[k])));
      }
      ASSERT_GT(scale, 0) << p.name;
      EXPECT_LT(diff / scale, 1e-4) << p.name;
      worst = std::max(worst, diff / scale);
    }
    std::printf("gpt %s%s: loss %.7f vs torch %.7f; worst gradient max|diff|/max|g| %.2e\n", name.c_str(),
                checkpoint ? " (activation checkpointing)" : "", s.loss_sum / s.count, double(g.loss), worst);
    // Padding between parameters: zero gradient.
    std::vector<bool> used(grads.size(), false);
    for (const ParamSlot& p : model->params())
      for (std::size_t k = 0; k < p.numel(); ++k) used[p.offset + k] = true;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!used[i]) {
        ASSERT_EQ(grads[i], 0.0f) << i;
      }
    }
  }
}

TEST(Gpt, Bf16ProductsStayNearPyTorchsFloat32) {
  if (!models::bf16_products_available()) GTEST_SKIP() << "oneDNN has no bfloat16 products on this CPU (AVX2 only)";
  // --matmul-precision bf16 rounds every product's operands to bfloat16
  // (8 significant bits: a relative error up to 2^-9 per operand) and sums
  // in float32. Against torch's float32 gradients that leaves errors of a
  // up to 1e-2 of a tensor's largest gradient; the bounds are 1e-3 on the
  // loss and 2e-2 on gradients. The products really are rounded: the
  // gradients differ from float32's by more than float32's own 1e-4.
  for (const std::string name : {"tiny", "small", "wide"}) {
    SCOPED_TRACE(name);
    const Golden g = read_golden(name);
    std::vector<float> buffer, grads32;
    for (const auto precision : {models::MatmulPrecision::f32, models::MatmulPrecision::bf16}) {
      auto model = models::make_gpt(g.shape, 1, precision);
      buffer.assign(model->buffer_elements(), 0.0f);
      for (const ParamSlot& p : model->params()) {
        const auto& w = g.tensors.at("param." + p.name);
        std::copy(w.begin(), w.end(), buffer.begin() + static_cast<std::ptrdiff_t>(p.offset));
      }
      std::vector<float> grads(model->buffer_elements(), 1.0f);
      const std::vector<float> unused(g.batch, 0.0f);
      const models::BatchStats s = model->forward_backward(buffer, g.tokens.data(), unused.data(), g.batch,
                                                           1.0f / static_cast<float>(g.batch), grads);
      if (precision == models::MatmulPrecision::f32) {
        grads32 = grads;
        continue;
      }
      EXPECT_NEAR(s.loss_sum / s.count, g.loss, 1e-3 * g.loss);
      double worst = 0, from_f32 = 0;
      for (const ParamSlot& p : model->params()) {
        const auto& want = g.tensors.at("grad." + p.name);
        double diff = 0, diff32 = 0, scale = 0;
        for (std::size_t k = 0; k < p.numel(); ++k) {
          diff = std::max(diff, std::abs(double(grads[p.offset + k]) - want[k]));
          diff32 = std::max(diff32, std::abs(double(grads[p.offset + k]) - grads32[p.offset + k]));
          scale = std::max(scale, std::abs(double(want[k])));
        }
        EXPECT_LT(diff / scale, 2e-2) << p.name;
        worst = std::max(worst, diff / scale);
        from_f32 = std::max(from_f32, diff32 / scale);
      }
      EXPECT_GT(from_f32, 1e-4);
      std::printf("gpt %s, bf16 products: loss %.7f vs torch %.7f; worst gradient max|diff|/max|g| %.2e\n",
                  name.c_str(), s.loss_sum / s.count, double(g.loss), worst);
    }
  }
}

TEST(Gpt, NextLogitsAreTheModelsLogits) {
  // What `distopt sample` reads: the logits after each prefix of a window.
  // Their cross-entropy on the next byte, averaged over the window, is the
  // loss that evaluate and forward_backward report for it (so the logits
  // are logits, whichever pass ran before).
  const models::GptShape shape{2, 2, 16, 12, 256};
  auto model = models::make_gpt(shape);
  std::vector<float> w(model->buffer_elements()), grads(model->buffer_elements());
  model->init(w, 9);
  Rng rng(4, 0);
  std::vector<float> window(shape.context + 1), unused(1, 0.0f);
  for (float& t : window) t = static_cast<float>(rng.next() % 256);
  const double loss = model->evaluate(w, window.data(), unused.data(), 1).loss_sum;
  for (int pass = 0; pass < 2; ++pass) {
    double sum = 0;
    for (std::size_t n = 1; n <= shape.context; ++n) {
      std::vector<std::uint32_t> prefix(window.begin(), window.begin() + static_cast<std::ptrdiff_t>(n));
      const std::vector<float> z = models::gpt_next_logits(*model, w, prefix);
      ASSERT_EQ(z.size(), 256u);
      double mx = z[0], total = 0;
      for (float v : z) mx = std::max(mx, double(v));
      for (float v : z) total += std::exp(double(v) - mx);
      sum += mx + std::log(total) - z[static_cast<std::size_t>(window[n])];
    }
    EXPECT_NEAR(sum / static_cast<double>(shape.context), loss, 1e-5 * loss) << pass;
    (void)model->forward_backward(w, window.data(), unused.data(), 1, 1.0f, grads);
  }
}

TEST(Gpt, GradientsMatchFiniteDifferences) {
  // Every parameter tensor: the directional derivative along a random
  // direction, by central differences of the evaluated loss.
  const models::GptShape shape{2, 2, 8, 6, 256};
  auto model = models::make_gpt(shape);
  std::vector<float> w(model->buffer_elements()), grads(model->buffer_elements());
  model->init(w, 3);
  Rng rng(7, 0);
  for (const ParamSlot& p : model->params())
    for (std::size_t k = 0; k < p.numel(); ++k) w[p.offset + k] += static_cast<float>(0.1 * rng.normal());
  const std::size_t batch = 3;
  std::vector<float> tokens(batch * (shape.context + 1)), unused(batch, 0.0f);
  for (float& t : tokens) t = static_cast<float>(rng.next() % 256);
  (void)model->forward_backward(w, tokens.data(), unused.data(), batch, 1.0f, grads);
  const double eps = 1e-2;
  for (const ParamSlot& p : model->params()) {
    std::vector<float> v(p.numel());
    double analytic = 0;
    for (std::size_t k = 0; k < p.numel(); ++k) {
      v[k] = static_cast<float>(rng.normal());
      analytic += double(grads[p.offset + k]) * v[k];
    }
    auto loss_at = [&](double sign) {
      std::vector<float> x = w;
      for (std::size_t k = 0; k < p.numel(); ++k) x[p.offset + k] += static_cast<float>(sign * eps * v[k]);
      return model->evaluate(x, tokens.data(), unused.data(), batch).loss_sum;
    };
    const double numeric = (loss_at(1) - loss_at(-1)) / (2 * eps);
    EXPECT_NEAR(numeric, analytic, 2e-2 * std::abs(analytic) + 2e-4) << p.name;
  }
}

TEST(Gpt, ThreadsGiveTheSameBits) {
  // Tasks are fixed blocks of rows (256), columns (64) and (sample, head):
  // this shape cuts rows and columns into uneven blocks (624 = 256 + 256 +
  // 112 rows, 160 = 64 + 64 + 32 columns), and the pool hands them out
  // in any order. Loss, every gradient and evaluation are the same bits at
  // 1, 2 and 3 threads, with float32 and with bfloat16 products.
  const models::GptShape shape{2, 4, 160, 48, 256};
  const std::size_t batch = 13;
  Rng rng(11, 0);
  std::vector<float> tokens(batch * (shape.context + 1)), unused(batch, 0.0f);
  for (float& t : tokens) t = static_cast<float>(rng.next() % 256);
  for (const auto precision : {models::MatmulPrecision::f32, models::MatmulPrecision::bf16}) {
    if (precision == models::MatmulPrecision::bf16 && !models::bf16_products_available()) {
      std::printf("bfloat16 products skipped: oneDNN has none on this CPU (AVX2 only)\n");
      continue;
    }
    std::vector<float> w, ref_grads;
    double ref_loss = 0, ref_eval = 0;
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(str(threads, " threads, ", precision == models::MatmulPrecision::f32 ? "f32" : "bf16"));
      auto model = models::make_gpt(shape, threads, precision);
      if (w.empty()) {
        w.resize(model->buffer_elements());
        model->init(w, 5);
      }
      std::vector<float> grads(model->buffer_elements(), 7.0f);
      const double loss = model->forward_backward(w, tokens.data(), unused.data(), batch, 1.0f, grads).loss_sum;
      const double eval = model->evaluate(w, tokens.data(), unused.data(), batch).loss_sum;
      if (threads == 1) {
        ref_grads = grads, ref_loss = loss, ref_eval = eval;
        continue;
      }
      EXPECT_EQ(loss, ref_loss);
      EXPECT_EQ(eval, ref_eval);
      ASSERT_EQ(grads.size(), ref_grads.size());
      EXPECT_EQ(std::memcmp(grads.data(), ref_grads.data(), grads.size() * sizeof(float)), 0);
    }
  }
  EXPECT_THROW((void)models::make_gpt(shape, 0), InvalidInput);
}

TEST(Gpt, NamesUnitsAndInitialisationAreGpt2s) {
  const models::GptShape shape{3, 4, 16, 10, 256};
  auto model = models::make_gpt(shape);
  ASSERT_EQ(model->units().size(), 5u);  // embeddings, h.0-2, ln_f
  EXPECT_EQ(model->units().front().name, "embeddings");
  EXPECT_EQ(model->units().back().name, "ln_f");
  std::vector<std::string> names;
  for (const ParamSlot& p : model->params()) names.push_back(p.name);
  EXPECT_EQ(names.front(), "wte");
  EXPECT_EQ(names[1], "wpe");
  EXPECT_EQ(names[2], "h.0.ln_1.weight");
  EXPECT_EQ(names[4], "h.0.attn.c_attn.weight");
  EXPECT_EQ(names.back(), "ln_f.bias");
  EXPECT_EQ(names.size(), 2u + 3 * 12 + 2);
  std::vector<float> w(model->buffer_elements());
  model->init(w, 1);
  auto stddev = [&](const std::string& name) {
    for (const ParamSlot& p : model->params())
      if (p.name == name) {
        double s = 0;
        for (std::size_t k = 0; k < p.numel(); ++k) s += double(w[p.offset + k]) * w[p.offset + k];
        return std::sqrt(s / double(p.numel()));
      }
    return -1.0;
  };
  EXPECT_NEAR(stddev("wte"), 0.02, 0.002);
  EXPECT_NEAR(stddev("h.1.mlp.c_fc.weight"), 0.02, 0.002);
  EXPECT_NEAR(stddev("h.1.mlp.c_proj.weight"), 0.02 / std::sqrt(6.0), 0.001);
  EXPECT_NEAR(stddev("h.2.attn.c_proj.weight"), 0.02 / std::sqrt(6.0), 0.001);
  EXPECT_EQ(stddev("h.0.attn.c_attn.bias"), 0.0);
  EXPECT_EQ(stddev("ln_f.weight"), 1.0);
}

TEST(Gpt, BadShapesAreOneLine) {
  auto error_of = [](const models::GptShape& s) -> std::string {
    try {
      (void)models::make_gpt(s);
    } catch (const InvalidInput& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of({2, 3, 16, 8, 256}), "--heads 3 does not divide --dim 16: every head needs dim / heads channels");
  EXPECT_EQ(error_of({0, 2, 16, 8, 256}), "--layers must be at least 1 (got 0)");
  EXPECT_EQ(error_of({1, 2, 16, 0, 256}), "--context must be at least 1 (got 0)");
  models::ModelOptions o;
  o.gpt = {1, 2, 16, 8, 256};
  try {
    (void)models::make_model("gpt", 784, 10, o);
    ADD_FAILURE() << "gpt on an image data set";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("model gpt reads byte tokens: it needs a text data set"), std::string::npos);
  }
}

// Activation checkpointing: a block keeps its input only and runs its
// forward again in backward. The recomputation is the same arithmetic on
// the same inputs, so loss, every gradient and evaluation are the same bits
// (f32 and bf16 products, 1 and 3 threads); at 8 layers the activations
// kept fall to a fraction of the plain model's.
TEST(Gpt, ActivationCheckpointingGivesTheSameBitsWithFarLessActivationMemory) {
  const models::GptShape shape{8, 4, 64, 32, 256};
  const std::size_t batch = 6;
  Rng rng(5, 0);
  std::vector<float> tokens(batch * (shape.context + 1)), unused(batch, 0.0f);
  for (float& t : tokens) t = static_cast<float>(rng.next() % 256);
  for (const auto precision : {models::MatmulPrecision::f32, models::MatmulPrecision::bf16}) {
    if (precision == models::MatmulPrecision::bf16 && !models::bf16_products_available()) continue;
    for (int threads : {1, 3}) {
      SCOPED_TRACE(str(threads, " threads, ", precision == models::MatmulPrecision::f32 ? "f32" : "bf16"));
      auto plain = models::make_gpt(shape, threads, precision, false);
      auto ckpt = models::make_gpt(shape, threads, precision, true);
      std::vector<float> w(plain->buffer_elements());
      plain->init(w, 3);
      std::vector<float> g1(w.size()), g2(w.size());
      const models::BatchStats a = plain->forward_backward(w, tokens.data(), unused.data(), batch, 0.5f, g1);
      const models::BatchStats b = ckpt->forward_backward(w, tokens.data(), unused.data(), batch, 0.5f, g2);
      EXPECT_EQ(a.loss_sum, b.loss_sum);
      EXPECT_EQ(std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(float)), 0) << "gradients differ";
      EXPECT_EQ(plain->evaluate(w, tokens.data(), unused.data(), batch).loss_sum,
                ckpt->evaluate(w, tokens.data(), unused.data(), batch).loss_sum);
      // Activations: every block's (18 BTD + B H T^2 floats each) against one
      // block's and each block's input (BTD).
      EXPECT_LT(ckpt->activation_bytes() * 4, plain->activation_bytes())
          << ckpt->activation_bytes() << " vs " << plain->activation_bytes();
      EXPECT_EQ(ckpt->workspace_bytes(), plain->workspace_bytes());
      if (threads == 1 && precision == models::MatmulPrecision::f32)
        std::printf("gpt 8x64, batch 6 x 32: activations %zu bytes plain, %zu checkpointed (%.1fx less)\n",
                    plain->activation_bytes(), ckpt->activation_bytes(),
                    double(plain->activation_bytes()) / double(ckpt->activation_bytes()));
    }
  }
}
