// The built-in models. A model owns no parameters: they live in one flat,
// aligned float32 buffer that the parallel strategy owns (docs/architecture.md,
// "Data layout"), and the model describes where each parameter sits in it. Units
// (layers) are contiguous ranges of that buffer, and a model reaches them
// through a UnitAccess one at a time, so ZeRO-3 can gather one unit at a
// time and every strategy can reduce a unit's gradient as soon as backward
// has finished it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "distopt/core/flat.hpp"

namespace distopt::models {

using distopt::ParamSlot;  // offsets are 64-byte aligned

struct Unit {
  std::string name;            // e.g. "fc1"
  std::size_t begin, end;      // element range of the flat buffer
  std::vector<std::size_t> params;  // indices into Model::params()
  // 0: the unit is used whole. Otherwise the model uses it a range at a
  // time, none longer than `tile` elements (UnitAccess's tiles).
  std::size_t tile = 0;
};

// Sums over a batch: loss (cross-entropy or squared error), correct
// predictions (classification), samples.
struct BatchStats {
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
};

enum class Pass { forward, backward, evaluate };

// How a model reaches its parameters and gradients while it runs: unit by
// unit, so that a parallel strategy can gather a unit just before it is
// needed, prefetch the next one, free it afterwards, and start reducing a
// unit's gradient while backward goes on (ZeRO-3 / FSDP). The strategy
// implements it; BufferAccess below is the plain form over whole buffers.
//
// Spans are unit-local: element k is flat-buffer element units()[u].begin + k,
// and a span has units()[u].end - units()[u].begin elements.
//
// A model calls, per pass: acquire(u) ... release(u) around every use of
// unit u's parameters (forward in unit order, backward in reverse order),
// and in backward, for every unit, grads(u), then grads_done(u) once the
// unit's gradient is completely written (in reverse unit order). Every
// rank makes the same sequence of calls whatever its number of samples
// (zero included): a strategy may run collectives inside them. A model
// with a single unit (one that needs its whole buffer at once) works with
// every strategy; it just gives ZeRO-3 nothing to shard in time.
class UnitAccess {
 public:
  virtual ~UnitAccess() = default;
  // Unit u's parameters, valid until release(u, pass).
  virtual std::span<const float> acquire(std::size_t u, Pass pass) = 0;
  virtual void release(std::size_t u, Pass pass) = 0;
  // Where backward writes unit u's gradient: every element, padding between
  // parameters zeroed. Valid until grads_done(u).
  virtual std::span<float> grads(std::size_t u) = 0;
  // Unit u's gradient is complete.
  virtual void grads_done(std::size_t u) = 0;

  // Tiles (ZeRO-Infinity's memory-centric tiling): a unit with Unit::tile
  // set is used a range at a time and never whole, so that a strategy that
  // gathers parameters (zero3) holds one range of it at a time. Ranges are
  // unit-local [begin, end), no longer than the tile; in each pass they
  // cover the unit once, in increasing order. acquire_range ...
  // release_range around each use of a range's parameters; in backward,
  // grads_range for every range (each element written, padding zeroed),
  // then grads_range_done, and after the last range grads_done(u). The
  // defaults serve the ranges from the whole unit.
  virtual std::span<const float> acquire_range(std::size_t u, std::size_t begin, std::size_t end, Pass pass) {
    return acquire(u, pass).subspan(begin, end - begin);
  }
  virtual void release_range(std::size_t u, std::size_t /*begin*/, Pass pass) { release(u, pass); }
  virtual std::span<float> grads_range(std::size_t u, std::size_t begin, std::size_t end) {
    if (begin == 0) range_grads_ = grads(u);
    return range_grads_.subspan(begin, end - begin);
  }
  virtual void grads_range_done(std::size_t /*u*/, std::size_t /*begin*/, std::size_t /*end*/) {}

 private:
  std::span<float> range_grads_;  // the defaults' whole unit
};

class Model;

// UnitAccess over a whole parameter buffer (and, for backward, a whole
// gradient buffer) in the model's own layout.
class BufferAccess final : public UnitAccess {
 public:
  BufferAccess(const Model& model, std::span<const float> params, std::span<float> grads = {});
  std::span<const float> acquire(std::size_t u, Pass pass) override;
  void release(std::size_t, Pass) override {}
  std::span<float> grads(std::size_t u) override;
  void grads_done(std::size_t) override {}

 private:
  const Model& model_;
  std::span<const float> params_;
  std::span<float> grads_;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string_view name() const = 0;
  const std::vector<ParamSlot>& params() const { return params_; }
  // Contiguous ranges covering [0, buffer_elements()) in order.
  const std::vector<Unit>& units() const { return units_; }
  // Elements of the flat buffer, padding included.
  std::size_t buffer_elements() const { return buffer_elements_; }
  std::size_t features() const { return features_; }
  std::size_t outputs() const { return outputs_; }

  // PyTorch's default for nn.Linear: weight and bias ~ U(-1/sqrt(fan_in),
  // 1/sqrt(fan_in)); padding is zeroed. Deterministic in `seed`.
  virtual void init(std::span<float> buffer, std::uint64_t seed) const = 0;
  // Elements [begin, begin + out.size()) of what init writes, without the
  // whole buffer where the model can (gpt, mlp): a rank that keeps a shard
  // starts from its pieces alone (parallel::InitialParams).
  virtual void init_range(std::size_t begin, std::span<float> out, std::uint64_t seed) const;

  // Forward and backward over n samples (x: n × features, y: labels or
  // targets). Writes d(grad_scale · loss_sum)/d(params) through `access`
  // (every element of every unit; padding zeroed) and returns the batch's
  // sums.
  BatchStats forward_backward(UnitAccess& access, const float* x, const float* y, std::size_t n, float grad_scale) {
    return do_forward_backward(access, x, y, n, grad_scale);
  }
  BatchStats evaluate(UnitAccess& access, const float* x, const float* y, std::size_t n) {
    return do_evaluate(access, x, y, n);
  }
  // The same over whole buffers in the model's layout.
  BatchStats forward_backward(std::span<const float> buffer, const float* x, const float* y, std::size_t n,
                              float grad_scale, std::span<float> grads);
  BatchStats evaluate(std::span<const float> buffer, const float* x, const float* y, std::size_t n);

  // Bytes the model holds for its passes, at the largest batch so far:
  // activations kept from forward for backward, and workspaces (scratch of
  // one layer's pass, logits, gradients flowing between layers).
  virtual std::size_t activation_bytes() const { return 0; }
  virtual std::size_t workspace_bytes() const { return 0; }

 protected:
  virtual BatchStats do_forward_backward(UnitAccess& access, const float* x, const float* y, std::size_t n,
                                         float grad_scale) = 0;
  virtual BatchStats do_evaluate(UnitAccess& access, const float* x, const float* y, std::size_t n) = 0;

  // init_range for a model that draws each parameter on its own (gpt, mlp):
  // zeroes `out` (elements [begin, begin + out.size()) of the buffer, so
  // padding stays 0), then for every parameter i that overlaps it calls
  // fill(i, first, values) to write the parameter's elements [first, first +
  // values.size()), the overlap.
  using ParamFill = std::function<void(std::size_t i, std::size_t first, std::span<float> values)>;
  void init_each_param(std::size_t begin, std::span<float> out, const ParamFill& fill) const;

  std::vector<ParamSlot> params_;
  std::vector<Unit> units_;
  std::size_t buffer_elements_ = 0, features_ = 0, outputs_ = 0;
};

// The shape of model "gpt": a GPT-2-style decoder over byte tokens.
struct GptShape {
  std::size_t layers = 4;
  std::size_t heads = 4;
  std::size_t dim = 128;
  std::size_t context = 64;  // tokens read per sample; a sample holds context + 1
  std::size_t vocab = 256;
};

// How gpt multiplies matrices: float32 throughout, or operands rounded to
// bfloat16 with float32 sums (torch's set_float32_matmul_precision
// "medium"; twice the rate on CPUs with AVX512-BF16 or AMX). Everything
// else -- parameters, gradients, LayerNorm, softmax -- stays float32.
enum class MatmulPrecision { f32, bf16 };

struct ModelOptions {
  std::vector<std::size_t> hidden;  // mlp's hidden widths (empty: 256, 128)
  GptShape gpt;
  // Threads per rank for forward and backward (gpt; the others take 1).
  // The bits do not depend on it.
  int threads = 1;
  MatmulPrecision matmul = MatmulPrecision::f32;  // gpt; the others take fp32
  bool activation_checkpointing = false;          // gpt (make_gpt)
  // mlp: hidden layers of more than this many rows (output features) are
  // computed, and used, in tiles of this many rows (0: whole layers). The
  // tile size is part of the arithmetic: the bits depend on it, not on the
  // strategy.
  std::size_t tile_rows = 0;
};

// "mlp" (features-256-128-classes, ReLU, softmax cross-entropy), "logreg"
// (softmax regression), "linreg" (linear regression, squared error / 2),
// "gpt" (src/models/gpt.cpp: samples of context + 1 tokens, classes the
// vocabulary). Throws InvalidInput for an unknown name, listing the known
// ones, and for a data shape the model cannot read.
std::unique_ptr<Model> make_model(std::string_view name, std::size_t features, std::size_t classes,
                                  const ModelOptions& options);
inline std::unique_ptr<Model> make_model(std::string_view name, std::size_t features, std::size_t classes,
                                         std::vector<std::size_t> hidden = {}) {
  return make_model(name, features, classes, ModelOptions{std::move(hidden), {}, 1, MatmulPrecision::f32, false, 0});
}
// Model "gpt" of that shape, running on `threads` threads, its products in
// `precision` (InvalidInput: heads not dividing dim, a zero size or thread
// count). With `activation_checkpointing` a block keeps only its input
// from forward and runs its forward again in backward (torch.utils.checkpoint):
// the same bits, one block's activations instead of every block's.
std::unique_ptr<Model> make_gpt(const GptShape& shape, int threads = 1,
                                MatmulPrecision precision = MatmulPrecision::f32,
                                bool activation_checkpointing = false);
// Model gpt: the logits (vocab values) of the token after `tokens` (1 to
// context of them), from parameters in the model's layout.
std::vector<float> gpt_next_logits(Model& gpt, std::span<const float> buffer, std::span<const std::uint32_t> tokens);
std::vector<std::string_view> model_names();
// Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX, as
// oneDNN finds it). Without, --matmul-precision bf16 still runs where
// oneDNN emulates it (AVX512), slower than float32.
bool bf16_products_native();
// Whether oneDNN multiplies bfloat16 on this CPU at all (natively or
// emulated); false on a CPU without AVX512 (AVX2 only).
bool bf16_products_available();

}  // namespace distopt::models
