// MLP, softmax regression and linear regression on Eigen. Weights are stored
// as torch stores nn.Linear's: [out, in] row-major, then the bias [out].
//
// Forward, per layer l:  Z = A_l W_l^T + b_l,  A_{l+1} = relu(Z) (hidden)
// Loss: cross-entropy with log-sum-exp (classification) or (z - y)^2 / 2.
// Backward:  dW_l = dZ^T A_l,  db_l = column sums of dZ,
//            dZ_{l-1} = (dZ W_l) ∘ [A_l > 0]   (not computed for the input).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"

namespace distopt::models {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
// No alignment is claimed: parameters come from whatever unit buffer the
// strategy hands out, and Eigen's products pack their operands anyway.
using MapMat = Eigen::Map<RowMat>;
using MapConstMat = Eigen::Map<const RowMat>;
// A block of columns of a row-major matrix (a tile's outputs).
using Columns = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
using ConstColumns = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;

constexpr std::size_t kAlign = 16;  // elements: 64 bytes
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// One unit per layer: [weight | pad | bias | pad]. Forward acquires the
// units in order, backward in reverse; a unit's gradient is complete when
// its layer's backward is done, so a strategy can reduce it while the
// layers below are still running.
//
// Tiles (tile_rows > 0): a layer of more than tile_rows outputs is
// computed in blocks of tile_rows rows of its weight -- the outputs' block
// Z[:, rows] = A W[rows]^T, dW[rows] = dZ[:, rows]^T A, and dA summed over
// the blocks in order -- and used a range at a time: each row block, then
// [pad | bias | pad]. The blocks fix the arithmetic whatever the strategy.
class Mlp final : public Model {
 public:
  Mlp(std::string name, std::vector<std::size_t> widths, bool regression, std::size_t tile_rows = 0)
      : name_(std::move(name)), widths_(std::move(widths)), regression_(regression), tile_rows_(tile_rows) {
    features_ = widths_.front();
    outputs_ = widths_.back();
    std::size_t offset = 0;
    for (std::size_t l = 0; l + 1 < widths_.size(); ++l) {
      Unit unit{"fc" + std::to_string(l + 1), offset, 0, {}};
      unit.params.push_back(params_.size());
      params_.push_back({unit.name + ".weight", offset, {std::int64_t(widths_[l + 1]), std::int64_t(widths_[l])}});
      offset += round_up(widths_[l + 1] * widths_[l]);
      unit.params.push_back(params_.size());
      params_.push_back({unit.name + ".bias", offset, {std::int64_t(widths_[l + 1])}});
      offset += round_up(widths_[l + 1]);
      unit.end = offset;
      if (tiled(l)) {
        const std::size_t weight = widths_[l + 1] * widths_[l];
        unit.tile = std::max(tile_rows_ * widths_[l], unit.end - unit.begin - weight);
      }
      units_.push_back(std::move(unit));
    }
    buffer_elements_ = offset;
  }

  std::string_view name() const override { return name_; }
  // Each layer's output is kept for backward; the deltas are scratch.
  std::size_t activation_bytes() const override { return bytes_of(act_); }
  std::size_t workspace_bytes() const override { return bytes_of(delta_); }

  void init(std::span<float> buffer, std::uint64_t seed) const override {
    DISTOPT_CHECK(buffer.size() == buffer_elements_);
    init_range(0, buffer, seed);
  }
  void init_range(std::size_t begin, std::span<float> out, std::uint64_t seed) const override {
    init_each_param(begin, out, [&](std::size_t i, std::size_t first, std::span<float> values) {
      const double fan_in = static_cast<double>(widths_[i / 2]);
      const double bound = 1.0 / std::sqrt(fan_in);
      Rng rng(seed, 1000 + i);
      rng.discard(first);  // a uniform() takes one
      for (float& v : values) v = static_cast<float>(rng.uniform(-bound, bound));
    });
  }

 protected:
  BatchStats do_forward_backward(UnitAccess& access, const float* x, const float* y, std::size_t n,
                                 float grad_scale) override {
    reserve(n);
    forward(access, Pass::forward, x, n);
    const std::size_t layers = widths_.size() - 1;
    BatchStats stats = loss_and_delta(y, n, grad_scale, /*want_delta=*/true);
    for (std::size_t l = layers; l-- > 0;) {
      const std::size_t in = widths_[l], out = widths_[l + 1];
      if (tiled(l)) {
        backward_tiles(access, l, l == 0 ? x : act_[l].data(), n);
        continue;
      }
      const std::span<const float> unit = access.acquire(l, Pass::backward);
      const std::span<float> grads = access.grads(l);
      DISTOPT_CHECK(unit.size() == unit_size(l) && grads.size() == unit_size(l));
      MapMat dz(delta_[l + 1].data(), n, out);
      MapMat dw(grads.data(), out, in);
      if (l == 0)
        dw.noalias() = dz.transpose() * MapConstMat(x, n, in);
      else
        dw.noalias() = dz.transpose() * MapMat(act_[l].data(), n, in);
      float* db = grads.data() + bias_offset(l);
      for (std::size_t j = 0; j < out; ++j) db[j] = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float* row = dz.data() + i * out;
        for (std::size_t j = 0; j < out; ++j) db[j] += row[j];
      }
      // The padding after the weight and after the bias.
      std::fill(grads.data() + out * in, db, 0.0f);
      std::fill(db + out, grads.data() + grads.size(), 0.0f);
      if (l > 0) {
        MapMat da(delta_[l].data(), n, in);
        da.noalias() = dz * MapConstMat(unit.data(), out, in);
        const float* a = act_[l].data();
        float* d = da.data();
        for (std::size_t k = 0; k < n * in; ++k) d[k] = a[k] > 0 ? d[k] : 0.0f;
      }
      access.release(l, Pass::backward);
      access.grads_done(l);
    }
    return stats;
  }

  BatchStats do_evaluate(UnitAccess& access, const float* x, const float* y, std::size_t n) override {
    // All n samples through one layer at a time: every rank acquires each
    // unit once, however many samples it holds.
    reserve(n);
    forward(access, Pass::evaluate, x, n);
    return loss_and_delta(y, n, 1.0f, /*want_delta=*/false);
  }

 private:
  std::size_t unit_size(std::size_t l) const { return units_[l].end - units_[l].begin; }
  std::size_t bias_offset(std::size_t l) const { return params_[2 * l + 1].offset - units_[l].begin; }

  void reserve(std::size_t n) {
    if (n <= capacity_ && !act_.empty()) return;
    capacity_ = std::max(n, capacity_);
    act_.assign(widths_.size(), {});
    delta_.assign(widths_.size(), {});
    for (std::size_t l = 1; l < widths_.size(); ++l) {
      act_[l].assign(round_up(capacity_ * widths_[l]), 0.0f);
      delta_[l].assign(round_up(capacity_ * widths_[l]), 0.0f);
    }
  }

  // act_[l] for l >= 1 (act_[last] holds the logits / predictions).
  void forward(UnitAccess& access, Pass pass, const float* x, std::size_t n) {
    const std::size_t layers = widths_.size() - 1;
    for (std::size_t l = 0; l < layers; ++l) {
      const std::size_t in = widths_[l], out = widths_[l + 1];
      MapMat z(act_[l + 1].data(), n, out);
      const MapConstMat a(l == 0 ? x : act_[l].data(), n, in);
      if (tiled(l)) {
        for (std::size_t r = 0; r < out; r += tile_rows_) {
          const std::size_t rows = std::min(tile_rows_, out - r);
          const std::span<const float> w = access.acquire_range(l, r * in, (r + rows) * in, pass);
          Columns(z.data() + r, n, rows, Eigen::OuterStride<>(out)).noalias() =
              a * MapConstMat(w.data(), rows, in).transpose();
          access.release_range(l, r * in, pass);
        }
        const std::span<const float> tail = access.acquire_range(l, out * in, unit_size(l), pass);
        add_bias(z, tail.data() + (bias_offset(l) - out * in), l + 1 < layers);
        access.release_range(l, out * in, pass);
        continue;
      }
      const std::span<const float> unit = access.acquire(l, pass);
      DISTOPT_CHECK(unit.size() == unit_size(l));
      z.noalias() = a * MapConstMat(unit.data(), out, in).transpose();
      add_bias(z, unit.data() + bias_offset(l), l + 1 < layers);
      access.release(l, pass);
    }
  }

  // z += b on every row, then relu (hidden layers).
  static void add_bias(MapMat& z, const float* b, bool relu) {
    const auto n = static_cast<std::size_t>(z.rows()), out = static_cast<std::size_t>(z.cols());
    for (std::size_t i = 0; i < n; ++i) {
      float* row = z.data() + i * out;
      if (relu)
        for (std::size_t j = 0; j < out; ++j) row[j] = std::max(row[j] + b[j], 0.0f);
      else
        for (std::size_t j = 0; j < out; ++j) row[j] += b[j];
    }
  }

  bool tiled(std::size_t l) const { return tile_rows_ > 0 && widths_[l + 1] > tile_rows_; }

  // Backward of a tiled layer: a row block of the weight at a time, then
  // the bias.
  void backward_tiles(UnitAccess& access, std::size_t l, const float* a_in, std::size_t n) {
    const std::size_t in = widths_[l], out = widths_[l + 1];
    const MapConstMat a(a_in, n, in);
    const MapMat dz(delta_[l + 1].data(), n, out);
    MapMat da(l > 0 ? delta_[l].data() : nullptr, l > 0 ? n : 0, in);
    for (std::size_t r = 0; r < out; r += tile_rows_) {
      const std::size_t rows = std::min(tile_rows_, out - r);
      const ConstColumns dzr(dz.data() + r, n, rows, Eigen::OuterStride<>(out));
      const std::span<float> g = access.grads_range(l, r * in, (r + rows) * in);
      MapMat(g.data(), rows, in).noalias() = dzr.transpose() * a;
      if (l > 0) {
        const std::span<const float> w = access.acquire_range(l, r * in, (r + rows) * in, Pass::backward);
        if (r == 0)
          da.noalias() = dzr * MapConstMat(w.data(), rows, in);
        else
          da.noalias() += dzr * MapConstMat(w.data(), rows, in);
        access.release_range(l, r * in, Pass::backward);
      }
      access.grads_range_done(l, r * in, (r + rows) * in);
    }
    // [pad | bias | pad]: the bias's gradient is the column sums of dZ.
    const std::span<float> tail = access.grads_range(l, out * in, unit_size(l));
    std::fill(tail.begin(), tail.end(), 0.0f);
    float* db = tail.data() + (bias_offset(l) - out * in);
    for (std::size_t i = 0; i < n; ++i) {
      const float* row = dz.data() + i * out;
      for (std::size_t j = 0; j < out; ++j) db[j] += row[j];
    }
    access.grads_range_done(l, out * in, unit_size(l));
    if (l > 0) {
      const float* act = act_[l].data();
      float* d = da.data();
      for (std::size_t k = 0; k < n * in; ++k) d[k] = act[k] > 0 ? d[k] : 0.0f;
    }
    access.grads_done(l);
  }

  BatchStats loss_and_delta(const float* y, std::size_t n, float grad_scale, bool want_delta) {
    const std::size_t last = widths_.size() - 1, c = widths_[last];
    const float* z = act_[last].data();
    float* dz = delta_[last].data();
    BatchStats s;
    s.count = static_cast<double>(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float* row = z + i * c;
      if (regression_) {
        const double diff = double(row[0]) - double(y[i]);
        s.loss_sum += 0.5 * diff * diff;
        if (want_delta) dz[i] = static_cast<float>(diff) * grad_scale;
        continue;
      }
      const std::size_t label = static_cast<std::size_t>(y[i]);
      DISTOPT_DCHECK(label < c);
      std::size_t arg = 0;
      float m = row[0];
      for (std::size_t j = 1; j < c; ++j)
        if (row[j] > m) m = row[j], arg = j;
      float sum = 0;
      for (std::size_t j = 0; j < c; ++j) sum += std::exp(row[j] - m);
      const float lse = m + std::log(sum);
      s.loss_sum += double(lse) - double(row[label]);
      s.correct += arg == label ? 1 : 0;
      if (want_delta) {
        float* d = dz + i * c;
        for (std::size_t j = 0; j < c; ++j) d[j] = std::exp(row[j] - lse) * grad_scale;
        d[label] -= grad_scale;
      }
    }
    return s;
  }

  static std::size_t bytes_of(const std::vector<std::vector<float>>& v) {
    std::size_t bytes = 0;
    for (const auto& x : v) bytes += x.capacity() * sizeof(float);
    return bytes;
  }

  std::string name_;
  std::vector<std::size_t> widths_;
  bool regression_;
  std::size_t tile_rows_;
  std::size_t capacity_ = 0;
  std::vector<std::vector<float>> act_, delta_;
};

}  // namespace

std::vector<std::string_view> model_names() { return {"mlp", "logreg", "linreg", "gpt"}; }

std::unique_ptr<Model> make_model(std::string_view name, std::size_t features, std::size_t classes,
                                  const ModelOptions& options) {
  if (features == 0) throw InvalidInput("a model needs at least one input feature");
  if (name == "gpt") {
    if (classes != options.gpt.vocab)
      throw InvalidInput(str("model gpt reads byte tokens: it needs a text data set (--data fortunes or --data text), "
                             "not one of ", classes, " classes"));
    if (features != options.gpt.context + 1)
      throw InvalidInput(str("model gpt with --context ", options.gpt.context, " needs samples of ",
                             options.gpt.context + 1, " tokens, the data has ", features));
    if (options.tile_rows > 0)
      throw InvalidInput("tiles (--tile-rows) apply to model mlp; model gpt is used a block at a time");
    return make_gpt(options.gpt, options.threads, options.matmul, options.activation_checkpointing);
  }
  if (options.tile_rows > 0 && name != "mlp")
    throw InvalidInput(str("tiles (--tile-rows) apply to model mlp, not ", name));
  if (options.threads != 1)
    throw InvalidInput(str("--threads applies to model gpt; model ", name, " runs on one thread a rank"));
  if (options.matmul != MatmulPrecision::f32)
    throw InvalidInput(str("--matmul-precision applies to model gpt; model ", name, " multiplies in float32"));
  std::vector<std::size_t> hidden = options.hidden;
  if (name == "mlp" || name == "logreg") {
    if (classes < 2) throw InvalidInput(str("model ", name, " needs a classification dataset"));
    std::vector<std::size_t> widths{features};
    if (name == "mlp") {
      if (hidden.empty()) hidden = {256, 128};
      for (auto h : hidden) {
        if (h == 0) throw InvalidInput("hidden layer widths must be positive");
        widths.push_back(h);
      }
    }
    widths.push_back(classes);
    return std::make_unique<Mlp>(std::string(name), std::move(widths), false, options.tile_rows);
  }
  if (name == "linreg") {
    if (classes != 0) throw InvalidInput("model linreg needs a regression dataset (--data synthetic-regression)");
    return std::make_unique<Mlp>("linreg", std::vector<std::size_t>{features, 1}, true);
  }
  throw InvalidInput(str("unknown model '", name, "' (known: mlp, logreg, linreg, gpt)"));
}

}  // namespace distopt::models
