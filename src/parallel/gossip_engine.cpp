// The gossip strategies: sgp, osgp, dpsgd, slowmo (strategy.hpp;
// docs/gossip.md). Each rank holds the whole model: the numerator x (what
// its optimizer steps, in the padded layout) and the push-sum weight w;
// the model runs on the de-biased z = x / w. The trainer scales backward so
// that the ranks' gradients sum to the global batch's; a gossip rank steps
// with its own local mean gradient, which is n times its contribution.
#include <cmath>
#include <cstring>
#include <optional>

#include "distopt/core/error.hpp"
#include "distopt/gossip/push_sum.hpp"
#include "internal.hpp"

namespace distopt::parallel::detail {

namespace {

enum class Mode { sgp, osgp, dpsgd, slowmo };

Mode mode_of(std::string_view name) {
  if (name == "osgp") return Mode::osgp;
  if (name == "dpsgd") return Mode::dpsgd;
  if (name == "slowmo") return Mode::slowmo;
  return Mode::sgp;
}

void validate(std::string_view name, const StrategyOptions& o) {
  if (o.param_dtype != DType::f32)
    throw InvalidInput(str("--param-dtype ", name_of(o.param_dtype), ": strategy ", name,
                           " keeps fp32 parameters (mixed precision is for ddp and zero1-3)"));
  const GossipOptions& g = o.gossip;
  if (g.synch_freq < 0) throw InvalidInput(str("--synch-freq must be at least 0 (got ", g.synch_freq, ")"));
  if (g.localsgd_frequency < 1)
    throw InvalidInput(str("--localsgd-frequency must be at least 1 (got ", g.localsgd_frequency, ")"));
  if (g.slowmo_frequency < 1)
    throw InvalidInput(str("--slowmo-frequency must be at least 1 (got ", g.slowmo_frequency, ")"));
  if (!(g.slowmo_momentum >= 0 && g.slowmo_momentum < 1))
    throw InvalidInput(str("--slowmo-momentum must be in [0, 1) (got ", g.slowmo_momentum, ")"));
  if (!(g.slowmo_lr > 0 && std::isfinite(g.slowmo_lr)))
    throw InvalidInput(str("--slowmo-lr must be a positive number (got ", g.slowmo_lr, ")"));
  if (g.slowmo_base != "localsgd" && g.slowmo_base != "sgp")
    throw InvalidInput(str("--slowmo-base: '", g.slowmo_base, "' is not localsgd or sgp"));
}

class GossipEngine final : public Strategy, public models::UnitAccess {
 public:
  GossipEngine(std::string_view name, Communicator& comm, const FlatLayout& flat, std::span<const float> initial,
               const OptimizerSpec& spec, const StrategyOptions& options)
      : name_(name),
        mode_(mode_of(name)),
        comm_(comm),
        layout_(flat.params, flat.elements, flat.units, comm.size(), options.bucket_elements),
        options_(options.gossip),
        topology_(options.gossip.topology.empty() ? (mode_ == Mode::dpsgd ? "bipartite-exponential" : "exponential")
                                                  : options.gossip.topology,
                  comm.size(), options.gossip.peers_per_iteration) {
    DISTOPT_CHECK(initial.size() == flat.elements, initial.size(), " vs ", flat.elements);
    check_agreement(comm, name, layout_, spec, options);
    const std::size_t padded = layout_.padded_elements();
    x_.assign(padded, 0.0f);
    grads_.assign(padded, 0.0f);
    for (const auto& u : layout_.units())
      std::copy(initial.begin() + static_cast<std::ptrdiff_t>(u.begin),
                initial.begin() + static_cast<std::ptrdiff_t>(u.begin + u.size()), x_.begin() + u.padded_offset);
    std::vector<Param> views;
    for (std::size_t p = 0; p < layout_.params().size(); ++p) {
      const ParamSlot& s = layout_.params()[p];
      const std::size_t at = layout_.padded_offset(p);
      views.push_back({s.name, {x_.data() + at, DType::f32, s.shape}, {grads_.data() + at, DType::f32, s.shape}, true});
      owned_.push_back({grads_.data() + at, DType::f32, {std::int64_t(s.numel())}});
    }
    optimizer_ = std::make_unique<Optimizer>(spec.name, std::move(views), spec.options);
    const bool push_sum = mode_ == Mode::sgp || mode_ == Mode::osgp ||
                          (mode_ == Mode::slowmo && options_.slowmo_base == "sgp");
    if (push_sum || mode_ == Mode::dpsgd) gossip_.emplace(comm, topology_, padded);
    if (mode_ == Mode::osgp)
      for (int j = 1; j <= options_.synch_freq; ++j)
        pipeline_.push_back(std::make_unique<gossip::PushSum>(comm, topology_, padded, gossip::PushSum::kTag + j));
    if (mode_ == Mode::dpsgd) {
      // The exchange of x^0 runs during the first forward and backward.
      send_ = x_;
      double unused = 1.0;
      gossip_->start(send_, unused);
    }
    if (mode_ == Mode::slowmo) {
      slow_x_ = x_;
      slow_u_.assign(padded, 0.0f);
    }
  }

  ~GossipEngine() override {
    // Rounds in flight: every rank started the same ones (the schedule
    // does not depend on timing), so finishing them completes and nothing
    // stays behind in the transport.
    try {
      for (auto& p : pipeline_)
        if (p->in_flight()) p->finish(x_, w_);
      if (gossip_ && gossip_->in_flight()) {
        double unused = w_;
        gossip_->finish(mode_ == Mode::dpsgd ? send_ : x_, unused);
      }
    } catch (...) {
    }
  }

  std::string_view name() const override { return name_; }
  const ShardLayout& layout() const override { return layout_; }
  models::UnitAccess& access() override { return *this; }
  Optimizer& optimizer() override { return *optimizer_; }
  std::uint64_t bytes_sent() const override { return comm_.bytes_sent(); }
  double exposed_seconds() const override { return exposed_s_; }
  MemoryUse memory() const override {
    MemoryUse m;
    m.params = (x_.size() + z_.size() + send_.size() + slow_x_.size()) * sizeof(float);
    m.grads = grads_.size() * sizeof(float);
    m.master_params = optimizer_->master_bytes();
    m.optimizer_state = optimizer_->state_bytes() - m.master_params + slow_u_.size() * sizeof(float);
    return m;
  }

  // ---- UnitAccess: the model runs on z = x / w ----

  std::span<const float> acquire(std::size_t u, models::Pass) override {
    const auto& unit = layout_.units().at(u);
    return std::span<const float>(model_values()).subspan(unit.padded_offset, unit.size());
  }
  void release(std::size_t, models::Pass) override {}
  std::span<float> grads(std::size_t u) override {
    const auto& unit = layout_.units().at(u);
    return std::span<float>(grads_).subspan(unit.padded_offset, unit.size());
  }
  void grads_done(std::size_t) override {}

  void step(const UpdateFn& update) override {
    // The rank's own mean gradient.
    if (comm_.size() > 1) {
      const auto n = static_cast<float>(comm_.size());
      for (float& g : grads_) g *= n;
    }
    for (std::size_t i = 0; i < optimizer_->num_params(); ++i) optimizer_->param(i).has_grad = true;
    if (mode_ == Mode::dpsgd) {
      // x <- W x (the exchange started after the last step), then the
      // step with the gradient taken at the old x.
      double unused = 1.0;
      blocked([&] { gossip_->finish(send_, unused); });
      set_x(send_);
    }
    // Statistics (clipping, the scaler's inf check) are the rank's own.
    const GradShard shard{owned_, [](double&, bool) {}};
    if (update)
      update(*optimizer_, shard);
    else
      optimizer_->step();
    ++steps_;
    switch (mode_) {
      case Mode::sgp:
        blocked([&] { gossip_->mix(x_, w_); });
        break;
      case Mode::osgp:
        overlap_round();
        break;
      case Mode::dpsgd: {
        send_ = x_;
        double unused = 1.0;
        gossip_->start(send_, unused);
        break;
      }
      case Mode::slowmo:
        slowmo_round();
        break;
    }
    z_valid_ = false;
  }

  std::span<const float> own_params() override { return model_values(); }

  std::vector<float> gather(std::span<const float> own) override { return unpadded(layout_, average(own)); }

  std::unique_ptr<models::UnitAccess> access_to(std::span<const float> own) override {
    struct Owning final : models::UnitAccess {
      Owning(Communicator& c, const ShardLayout& l, std::vector<float> v)
          : values(std::move(v)), inner(c, l, values, /*replicated=*/true) {}
      std::span<const float> acquire(std::size_t u, models::Pass p) override { return inner.acquire(u, p); }
      void release(std::size_t u, models::Pass p) override { inner.release(u, p); }
      std::span<float> grads(std::size_t u) override { return inner.grads(u); }
      void grads_done(std::size_t u) override { inner.grads_done(u); }
      std::vector<float> values;
      ValuesAccess inner;
    };
    return std::make_unique<Owning>(comm_, layout_, average(own));
  }

  models::UnitAccess& eval_access() override {
    eval_values_ = average(model_values());
    eval_ = std::make_unique<ValuesAccess>(comm_, layout_, eval_values_, /*replicated=*/true);
    return *eval_;
  }

  double consensus_distance() override {
    const std::span<const float> z = model_values();
    const std::vector<float> mean = average(z);
    double d = 0;
    for (std::size_t i = 0; i < z.size(); ++i) {
      const double e = static_cast<double>(z[i]) - mean[i];
      d += e * e;
    }
    comm_.all_reduce(&d, &d, 1, ElemType::f64, ReduceOp::sum);
    return d / comm_.size();
  }

 private:
  // x itself on a regular graph in step (w = 1), else z = x / w.
  std::span<const float> model_values() {
    if (w_ == 1.0) return x_;
    if (!z_valid_) {
      z_.resize(x_.size());
      const auto inv = static_cast<float>(1.0 / w_);
      for (std::size_t i = 0; i < x_.size(); ++i) z_[i] = x_[i] * inv;
      z_valid_ = true;
    }
    return z_;
  }

  // x_ takes new values in place: the optimizer's parameter views point
  // into its storage.
  void set_x(std::span<const float> values) {
    DISTOPT_CHECK(values.size() == x_.size(), values.size(), " vs ", x_.size());
    std::copy(values.begin(), values.end(), x_.begin());
  }

  // The mean over ranks of padded values (rank-ordered sum, then / n).
  std::vector<float> average(std::span<const float> values) {
    std::vector<float> out(values.begin(), values.end());
    if (comm_.size() > 1) comm_.all_reduce(out.data(), out.data(), out.size(), ElemType::f32, ReduceOp::avg);
    return out;
  }

  // osgp: a round is sent after every step and added synch_freq + 1 steps
  // later (waiting for it then if it has not arrived): synch_freq + 1
  // rounds take turns in a pipeline. The schedule does not depend on
  // arrival times, so runs are reproducible bit for bit.
  void overlap_round() {
    const std::uint64_t round = steps_ - 1;
    gossip::PushSum& slot = round % (pipeline_.size() + 1) == 0 ? *gossip_ : *pipeline_[round % (pipeline_.size() + 1) - 1];
    if (slot.in_flight()) blocked([&] { slot.finish(x_, w_); });
    slot.set_iteration(round);
    slot.start(x_, w_);
  }

  // slowmo: the base algorithm's communication, and every slowmo_frequency
  // steps the exact average with the outer momentum step (which replaces
  // the base communication of that step).
  void slowmo_round() {
    if (steps_ % static_cast<std::uint64_t>(options_.slowmo_frequency) == 0) {
      blocked([&] {
        if (options_.slowmo_base == "sgp") {
          // Exact average of the de-biased models; the weights restart at 1.
          const std::span<const float> z = model_values();
          if (z.data() != x_.data()) set_x(z);
          w_ = 1.0;
        }
        set_x(average(x_));
      });
      // u <- beta u + (x_old - x_avg) / lr;  x_old <- x_old - alpha lr u;  x <- x_old.
      const double lr = optimizer_->lr(0);
      const double beta = options_.slowmo_momentum, alpha = options_.slowmo_lr;
      for (std::size_t i = 0; i < x_.size(); ++i) {
        slow_u_[i] = static_cast<float>(beta * slow_u_[i] + (static_cast<double>(slow_x_[i]) - x_[i]) / lr);
        slow_x_[i] = static_cast<float>(slow_x_[i] - alpha * lr * slow_u_[i]);
      }
      set_x(slow_x_);
      return;
    }
    if (options_.slowmo_base == "sgp")
      blocked([&] { gossip_->mix(x_, w_); });
    else if (steps_ % static_cast<std::uint64_t>(options_.localsgd_frequency) == 0)
      blocked([&] { set_x(average(x_)); });
  }

  template <class F>
  void blocked(F&& fn) {
    add_seconds(exposed_s_, std::forward<F>(fn));
  }

  std::string name_;
  Mode mode_;
  Communicator& comm_;
  ShardLayout layout_;
  GossipOptions options_;
  gossip::Topology topology_;
  std::vector<float> x_, grads_, z_, send_, slow_x_, slow_u_, eval_values_;
  std::vector<TensorView> owned_;
  std::unique_ptr<Optimizer> optimizer_;
  std::optional<gossip::PushSum> gossip_;
  std::vector<std::unique_ptr<gossip::PushSum>> pipeline_;  // osgp: the other synch_freq rounds in flight
  std::unique_ptr<ValuesAccess> eval_;
  double w_ = 1.0;
  bool z_valid_ = false;
  std::uint64_t steps_ = 0;
  double exposed_s_ = 0;
};

}  // namespace

std::unique_ptr<Strategy> make_gossip_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                               std::span<const float> initial, const OptimizerSpec& optimizer,
                                               const StrategyOptions& options) {
  validate(name, options);
  return std::make_unique<GossipEngine>(name, comm, layout, initial, optimizer, options);
}

}  // namespace distopt::parallel::detail
