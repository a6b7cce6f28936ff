// The gossip strategies: sgp, osgp, dpsgd, adpsgd, slowmo (strategy.hpp;
// docs/gossip.md). Each rank holds the whole model: the numerator x (what
// its optimizer steps, in the padded layout) and the push-sum weight w;
// the model runs on the de-biased z = x / w. The trainer scales backward so
// that the ranks' gradients sum to the global batch's; a gossip rank steps
// with its own local mean gradient, which is n times its contribution.
//
// adpsgd is the one whose result depends on timing: its pairwise averages
// run on a thread of their own (gossip::AsyncPairwise) and land in x
// whenever they complete, while the model runs on a copy of x taken after
// each step.
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>

#include "distopt/core/error.hpp"
#include "distopt/gossip/pairwise.hpp"
#include "distopt/gossip/push_sum.hpp"
#include "internal.hpp"

namespace distopt::parallel::detail {

namespace {

enum class Mode { sgp, osgp, dpsgd, adpsgd, slowmo };

Mode mode_of(std::string_view name) {
  if (name == "osgp") return Mode::osgp;
  if (name == "dpsgd") return Mode::dpsgd;
  if (name == "adpsgd") return Mode::adpsgd;
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
  if (name == "adpsgd" && !g.topology.empty() && g.topology != "bipartite-exponential")
    throw InvalidInput(str("--topology ", g.topology,
                           ": adpsgd averages in pairs on bipartite-exponential (its only topology)"));
  if (name == "adpsgd" && g.peers_per_iteration != 1)
    throw InvalidInput("--peers-per-iteration: adpsgd averages with one partner at a time");
}

std::optional<gossip::Topology> topology_for(Mode mode, const GossipOptions& g, int world) {
  if (mode == Mode::adpsgd) return std::nullopt;  // gossip::pairwise_partner's matching
  if (!g.topology.empty()) return gossip::Topology(g.topology, world, g.peers_per_iteration);
  return gossip::Topology(mode == Mode::dpsgd ? "bipartite-exponential" : "exponential", world, g.peers_per_iteration);
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
        topology_(topology_for(mode_, options.gossip, comm.size())) {
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
    optimizer_ = std::make_unique<Optimizer>(spec.name, optimizer_groups(spec, std::move(views)), spec.options);
    const bool push_sum = mode_ == Mode::sgp || mode_ == Mode::osgp ||
                          (mode_ == Mode::slowmo && options_.slowmo_base == "sgp");
    if (push_sum || mode_ == Mode::dpsgd) gossip_.emplace(comm, *topology_, padded);
    if (mode_ == Mode::osgp)
      for (int j = 1; j <= options_.synch_freq; ++j)
        pipeline_.push_back(std::make_unique<gossip::PushSum>(comm, *topology_, padded, gossip::PushSum::kTag + j));
    if (mode_ == Mode::adpsgd) {
      z_ = x_;
      if (comm.size() > 1) {
        pair_comm_ = comm.split(0, comm.rank());
        pairwise_ = std::make_unique<gossip::AsyncPairwise>(*pair_comm_, x_, x_mutex_);
      }
    }
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
  std::uint64_t bytes_sent() const override {
    return comm_.bytes_sent() + (pairwise_ ? pairwise_->bytes_sent() : 0);
  }
  double exposed_seconds() const override { return exposed_s_; }
  MemoryUse memory() const override {
    MemoryUse m;
    // adpsgd: x, the model's copy z, and the gossip thread's snapshot and
    // received message.
    m.params = (x_.size() + z_.size() + send_.size() + slow_x_.size() + (pairwise_ ? 2 * x_.size() : 0)) *
               sizeof(float);
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
      // x <- W x (the exchange started after the last step, unless a
      // checkpoint finished it already), then the step with the gradient
      // taken at the old x.
      double unused = 1.0;
      if (gossip_->in_flight()) blocked([&] { gossip_->finish(send_, unused); });
      set_x(send_);
    }
    // Statistics (clipping, the scaler's inf check) are the rank's own.
    const GradShard shard{owned_, [](double&, bool) {}};
    {
      // adpsgd's gossip thread adds its averages to x under this lock.
      std::lock_guard lock(x_mutex_);
      if (update)
        update(*optimizer_, shard);
      else
        optimizer_->step();
    }
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
      case Mode::adpsgd:
        adpsgd_round();
        return;
      case Mode::slowmo:
        slowmo_round();
        break;
    }
    z_valid_ = false;
  }

  std::span<const float> own_params() override {
    settle();
    return model_values();
  }

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
    settle();
    eval_values_ = average(model_values());
    eval_ = std::make_unique<ValuesAccess>(comm_, layout_, eval_values_, /*replicated=*/true);
    return *eval_;
  }

  std::vector<float> mean_over_ranks(std::span<const float> values) override { return average(values); }

  // Scalars: w, then for each push-sum gossiper (the main one, then osgp's
  // pipeline) its iteration, whether a round is in flight and, if one is,
  // the weight it sent and the in-peers' weight shares (count first).
  // Tensors: x; dpsgd's exchanged W x ("send"); slowmo's slow_x and slow_u;
  // the in-peers' shares of each round in flight ("pushsum<p>.in<i>").
  std::optional<LocalState> local_state() override {
    settle();  // adpsgd: every round allowed has been added
    LocalState st;
    st.steps = steps_;
    st.scalars.push_back(w_);
    st.tensors.emplace_back("x", x_);
    if (mode_ == Mode::dpsgd && gossip_->in_flight()) {
      // The exchange of x started after the last step, finished now into
      // what the next step takes: the same bits as finishing it then.
      double unused = 1.0;
      blocked([&] { gossip_->finish(send_, unused); });
    }
    if (mode_ == Mode::dpsgd) st.tensors.emplace_back("send", send_);
    if (mode_ == Mode::slowmo) {
      st.tensors.emplace_back("slow_x", slow_x_);
      st.tensors.emplace_back("slow_u", slow_u_);
    }
    const std::vector<gossip::PushSum*> all = gossipers();
    for (std::size_t p = 0; p < all.size(); ++p) {
      st.scalars.push_back(static_cast<double>(all[p]->iteration()));
      st.scalars.push_back(all[p]->in_flight() ? 1.0 : 0.0);
      if (!all[p]->in_flight()) continue;
      gossip::PushSum::Pending round;
      blocked([&] { round = all[p]->pending(); });
      st.scalars.push_back(round.sent_weight);
      st.scalars.push_back(static_cast<double>(round.weights.size()));
      st.scalars.insert(st.scalars.end(), round.weights.begin(), round.weights.end());
      for (std::size_t i = 0; i < round.shares.size(); ++i)
        st.tensors.emplace_back(str("pushsum", p, ".in", i), std::move(round.shares[i]));
    }
    return st;
  }

  void resume(std::uint64_t steps, const LocalState* saved) override {
    // The constructor's exchange of the initial x (dpsgd) is finished and
    // replaced: by the saved one, or by an exchange at step `steps`.
    if (mode_ == Mode::dpsgd && gossip_->in_flight()) {
      double unused = 1.0;
      gossip_->finish(send_, unused);
    }
    steps_ = steps;
    if (saved == nullptr) {
      for (gossip::PushSum* g : gossipers()) g->set_iteration(steps);
      if (mode_ == Mode::dpsgd) {
        send_ = x_;
        double unused = 1.0;
        gossip_->start(send_, unused);
      }
      if (mode_ == Mode::slowmo) slow_x_ = x_;
    } else {
      load_local(*saved);
    }
    if (mode_ == Mode::adpsgd) {
      z_ = x_;
      if (pairwise_) {
        pairwise_.reset();  // none allowed: ends at once
        pairwise_ = std::make_unique<gossip::AsyncPairwise>(*pair_comm_, x_, x_mutex_, gossip::AsyncPairwise::kTag, steps);
      }
    }
    z_valid_ = false;
  }

  double consensus_distance() override {
    settle();
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
  // x itself on a regular graph in step (w = 1), else z = x / w; adpsgd:
  // the copy of x taken after the last step.
  std::span<const float> model_values() {
    if (mode_ == Mode::adpsgd) return z_;
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

  // adpsgd: allow the pairwise round of this step, wait for the one
  // synch_freq + 1 steps older (bounded staleness), and take the model's
  // copy of x with every average that has arrived.
  void adpsgd_round() {
    if (pairwise_) pairwise_->allow(steps_);
    const auto lag = static_cast<std::uint64_t>(options_.synch_freq) + 1;
    copy_model_after(steps_ > lag ? steps_ - lag : 0);
  }

  // adpsgd: waits for every round allowed, so that x is every rank's x
  // after the same rounds, and copies it for the model. Others: nothing.
  void settle() {
    if (mode_ == Mode::adpsgd) copy_model_after(steps_);
  }

  // adpsgd: waits until `rounds` pairwise rounds have completed, then takes
  // the model's copy of x with every average that has arrived.
  void copy_model_after(std::uint64_t rounds) {
    if (pairwise_ && rounds > 0) blocked([&] { pairwise_->wait_for(rounds); });
    std::lock_guard lock(x_mutex_);
    std::copy(x_.begin(), x_.end(), z_.begin());
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

  // The push-sum gossipers in a fixed order: the main one, then osgp's
  // pipeline.
  std::vector<gossip::PushSum*> gossipers() {
    std::vector<gossip::PushSum*> all;
    if (gossip_) all.push_back(&*gossip_);
    for (auto& p : pipeline_) all.push_back(p.get());
    return all;
  }

  // resume() from a LocalState of local_state()'s layout.
  void load_local(const LocalState& st) {
    std::size_t next = 0;
    auto scalar = [&](const char* what) {
      if (next >= st.scalars.size())
        throw InvalidInput(str("the saved ", name_, " state of rank ", comm_.rank(), " ends before its ", what));
      return st.scalars[next++];
    };
    auto tensor = [&](const std::string& name) -> const std::vector<float>& {
      for (const auto& [n, v] : st.tensors)
        if (n == name) {
          if (name.rfind("pushsum", 0) != 0 && v.size() != x_.size())
            throw InvalidInput(str("the saved ", name_, " state of rank ", comm_.rank(), ": ", name, " has ", v.size(),
                                   " elements, this run's model ", x_.size()));
          return v;
        }
      throw InvalidInput(str("the saved ", name_, " state of rank ", comm_.rank(), " has no ", name));
    };
    const double w = scalar("weight");
    if (!(w > 0 && std::isfinite(w)))
      throw InvalidInput(str("the saved ", name_, " state of rank ", comm_.rank(), " has a push-sum weight of ", w));
    w_ = w;
    set_x(tensor("x"));
    if (mode_ == Mode::dpsgd) send_ = tensor("send");
    if (mode_ == Mode::slowmo) {
      slow_x_ = tensor("slow_x");
      slow_u_ = tensor("slow_u");
    }
    const std::vector<gossip::PushSum*> all = gossipers();
    for (std::size_t p = 0; p < all.size(); ++p) {
      const auto iteration = static_cast<std::uint64_t>(scalar("gossip iteration"));
      if (scalar("round in flight") == 0.0) {
        all[p]->set_iteration(iteration);
        continue;
      }
      gossip::PushSum::Pending round;
      round.iteration = iteration;
      round.sent_weight = scalar("sent weight");
      const double count = scalar("in-peer count");
      if (!(count >= 0 && count <= comm_.size()))
        throw InvalidInput(str("the saved ", name_, " state of rank ", comm_.rank(), " has ", count, " in-peers"));
      for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
        round.weights.push_back(scalar("in-peer weight"));
        round.shares.push_back(tensor(str("pushsum", p, ".in", i)));
      }
      all[p]->restore(round);
    }
    if (next != st.scalars.size())
      throw InvalidInput(str("the saved ", name_, " state of rank ", comm_.rank(), " has ", st.scalars.size(),
                             " numbers, this run's ", next));
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
  std::optional<gossip::Topology> topology_;  // none for adpsgd
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
  // adpsgd: x_ is shared with the gossip thread, which has a communicator
  // of its own; pairwise_ is declared last so that it ends (joining its
  // thread) before everything it touches.
  std::mutex x_mutex_;
  std::unique_ptr<Communicator> pair_comm_;
  std::unique_ptr<gossip::AsyncPairwise> pairwise_;
};

}  // namespace

std::unique_ptr<Strategy> make_gossip_strategy(std::string_view name, Communicator& comm, const FlatLayout& layout,
                                               std::span<const float> initial, const OptimizerSpec& optimizer,
                                               const StrategyOptions& options) {
  validate(name, options);
  return std::make_unique<GossipEngine>(name, comm, layout, initial, optimizer, options);
}

}  // namespace distopt::parallel::detail
