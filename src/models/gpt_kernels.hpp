// The CPU kernels of model gpt (src/models/gpt.cpp), in the manner of llm.c's:
// the matrix products (oneDNN, float32 or bfloat16 operands), LayerNorm,
// causal attention, GELU, softmax cross-entropy and the embeddings, each
// with its backward pass. Every kernel cuts its work into tasks on the
// model's ThreadPool that do not depend on the number of threads (gpt.cpp,
// "Threads"), so the bits are the same at any count. Private to src/models.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "distopt/core/thread_pool.hpp"

namespace distopt::models::gpt_kernels {

// bfloat16 products (--matmul-precision bf16): the operands rounded to
// bfloat16 (to nearest, ties to even), products summed in float32, as
// oneDNN's bf16 matmul does on AVX512-BF16 (or AMX) at twice float32's rate.
using bf16_t = std::uint16_t;  // bfloat16's bits (distopt/core/dtype.hpp)

// A product's operand: a float matrix with leading dimension ld and, under
// bf16 products, the same matrix rounded (same layout) when the model keeps
// one (an activation read twice), else null (rounded when needed).
struct Operand {
  const float* f;
  const bf16_t* h;
  std::size_t ld;
  Operand at(std::size_t offset) const { return {f + offset, h != nullptr ? h + offset : nullptr, ld}; }
};

// A rounded copy's data, or null (float32 products keep none).
inline bf16_t* rounded_data(std::vector<bf16_t>& v) { return v.empty() ? nullptr : v.data(); }
// A weight matrix: rounded by the product that reads it (once per product).
inline Operand weight(const float* w, std::size_t ld) { return {w, nullptr, ld}; }

// The kernels on `threads` threads (the calling one included), their
// products in float32 or, with `bf16_products`, in bfloat16. Row-major
// matrices throughout; B, T, D, H: samples, context, dim, heads.
class Kernels {
 public:
  Kernels(int threads, bool bf16_products) : pool_(threads), bf16_(bf16_products) {}

  bool bf16() const { return bf16_; }
  // Bytes of the kernels' own scratch (a product's rounded operand).
  std::size_t workspace_bytes() const { return b16_.capacity() * sizeof(bf16_t); }

  // dst (rows x cols, dense) <- src (leading dimension ld) rounded to
  // bfloat16, on the pool; a no-op under float32 products.
  void round_rows(const float* src, std::size_t rows, std::size_t cols, std::size_t ld, bf16_t* dst);

  // C = A op(B) (+ C) (+ bias, a row of n), A m x k row-major: tasks of
  // kRows rows, each adding the bias to its rows (inside the product under
  // bf16 products).
  void matmul(bool tb, std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c, std::size_t ldc,
              bool accumulate, const float* bias = nullptr);

  // C = A^T B, A k x m and B k x n row-major, both kept rounded under bf16
  // products: a weight's gradient, summed over the k rows. Tasks take
  // blocks of C's rows (each whole over k).
  void matmul_tn(std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c, std::size_t ldc);

  // LayerNorm over rows of D elements (eps 1e-5, torch's): y = xhat * w + b,
  // keeping xhat and 1 / std for backward.
  void layer_norm_rows(const float* x, std::size_t rows, std::size_t D, const float* w, const float* b, float* y,
                       float* xhat, float* rstd);

  // LayerNorm's backward: dx (+)= d input, dw and db += its gradient.
  void layer_norm_grad(const float* dy, const float* xhat, const float* rstd, std::size_t rows, std::size_t D,
                       const float* w, float* dw, float* db, float* dx, bool accumulate);

  // db += the column sums of dy (rows x n): a bias's gradient.
  void bias_grad(const float* dy, std::size_t rows, std::size_t n, float* db);

  // out (BT x D) = wte's row of each token + wpe's row of its position
  // (row r is position r % T).
  void embed(const float* wte, const float* wpe, const std::uint32_t* tokens, std::size_t BT, std::size_t T,
             std::size_t D, float* out);

  // Backward of embed: each row of dout (BT x D) added to its token's row
  // of dwte and its position's row of dwpe.
  void embed_backward(const float* dout, const std::uint32_t* tokens, std::size_t BT, std::size_t T, std::size_t D,
                      float* dwte, float* dwpe);

  // Causal self-attention of every (sample, head) from qkv (BT x 3D: q, k,
  // v of each position): probs (B x H x T x T) <- the softmax probabilities,
  // rounded into probs16 under bf16 products; y (BT x D) <- their products
  // with v, heads side by side.
  void attention(Operand qkv, std::size_t B, std::size_t T, std::size_t D, std::size_t H, float* probs,
                 bf16_t* probs16, float* y);

  // Backward of attention: dqkv (BT x 3D) from dys (dY, BT x D) and
  // attention's qkv and probs (probs16); dscores (and dscores16 under bf16
  // products) is scratch of probs' size.
  void attention_backward(Operand qkv, Operand dys, const float* probs, const bf16_t* probs16, std::size_t B,
                          std::size_t T, std::size_t D, std::size_t H, float* dqkv, float* dscores,
                          bf16_t* dscores16);

  // GELU (tanh approximation) of f (rows x n): t <- the tanh, out <- the
  // output, rounded into out16 under bf16 products.
  void gelu(const float* f, std::size_t rows, std::size_t n, float* t, float* out, bf16_t* out16);

  // Backward of gelu: df (rows x n) *= GELU'(f), from gelu's f (fs) and t
  // (ts), rounded into df16 under bf16 products.
  void gelu_backward(const float* fs, const float* ts, std::size_t rows, std::size_t n, float* df, bf16_t* df16);

  // Softmax cross-entropy of the logits (rows x V) against `targets`: each
  // row's loss and whether its maximum is the target, both divided by T
  // (a sample's mean over its positions), into row_loss and row_correct.
  // With `backward`, the logits become scale · (softmax - onehot(target));
  // without, they stay (next_logits reads them).
  void cross_entropy(float* logits, const std::uint32_t* targets, std::size_t rows, std::size_t V, std::size_t T,
                     float scale, bool backward, double* row_loss, double* row_correct);

 private:
  // f(begin, end) over [0, n) in blocks of `block`, on the pool, each task
  // in the calling thread's floating-point mode (flushing denormals or not).
  template <class F>
  void blocks(std::size_t n, std::size_t block, F&& f);

  // One product in the model's precision, on the calling thread. Under bf16
  // products both operands come rounded.
  void product(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, Operand a, Operand b, float* c,
               std::size_t ldc, bool accumulate) const;

  // The operand's rounded form: its own, or b16_ (dense, ld = cols).
  Operand rounded(Operand x, std::size_t rows, std::size_t cols);

  ThreadPool pool_;
  bool bf16_;  // products in bfloat16 (--matmul-precision bf16)
  std::vector<bf16_t> b16_;  // a product's second operand, rounded
};

}  // namespace distopt::models::gpt_kernels
