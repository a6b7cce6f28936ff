// slowmo, SlowMo (Wang et al. 2020; docs/gossip.md, "Training"): the base
// algorithm's communication after every step -- local SGD (the exact
// average of x every localsgd_frequency steps) or sgp (a push-sum round) --
// and every slowmo_frequency steps the exact average x_avg with the outer
// momentum step, which replaces the base communication of that step:
//   u <- beta u + (x_old - x_avg) / lr;  x_old <- x_old - alpha lr u;  x <- x_old.
// slow_x_ is x_old, the model after the last outer step; slow_u_ is u.
#include <algorithm>

#include "core.hpp"

namespace distopt::parallel::detail {

namespace {

class Slowmo final : public GossipCore {
 public:
  explicit Slowmo(const StrategyArgs& a)
      : GossipCore(a),
        sgp_base_(a.options.gossip.slowmo_base == "sgp") {
    if (sgp_base_) add_push_sum();
    slow_x_ = x_;
    slow_u_.assign(x_.size(), 0.0f);
  }

 private:
  void mix() override {
    if (steps_ % static_cast<std::uint64_t>(options_.slowmo_frequency) == 0) {
      outer_step();
      return;
    }
    if (sgp_base_)
      mix_push_sum();
    else if (steps_ % static_cast<std::uint64_t>(options_.localsgd_frequency) == 0)
      blocked([&] { set_x(average(x_)); });
  }

  void outer_step() {
    blocked([&] {
      if (sgp_base_) {
        // Exact average of the de-biased models; the weights restart at 1.
        const std::span<const float> z = model_values();
        if (z.data() != x_.data()) set_x(z);
        w_ = 1.0;
      }
      set_x(average(x_));
    });
    ++outer_steps_;
    const double lr = optimizer_->lr(0);
    const double beta = options_.slowmo_momentum, alpha = options_.slowmo_lr;
    for (std::size_t i = 0; i < x_.size(); ++i) {
      slow_u_[i] = static_cast<float>(beta * slow_u_[i] + (static_cast<double>(slow_x_[i]) - x_[i]) / lr);
      slow_x_[i] = static_cast<float>(slow_x_[i] - alpha * lr * slow_u_[i]);
    }
    set_x(slow_x_);
  }

  void start_fresh() override { slow_x_ = x_; }
  void save_tensors(LocalState& st) override {
    st.tensors.emplace_back("slow_x", slow_x_);
    st.tensors.emplace_back("slow_u", slow_u_);
  }
  void load_tensors(const LocalState& st) override {
    slow_x_ = saved_tensor(st, "slow_x");
    slow_u_ = saved_tensor(st, "slow_u");
    if (st.survivor) {
      const float outer = saved_tensor(st, "slowmo_outer", 1)[0];
      if (!(outer >= 0 && outer < 1.6e7f))
        throw InvalidInput(str("slowmo: a survivor's state counts ", outer, " outer steps"));
      outer_steps_ = static_cast<std::uint64_t>(outer);
    }
  }
  void survivor_tensors(LocalState& st) override {
    save_tensors(st);
    st.tensors.emplace_back("slowmo_outer", std::vector<float>{static_cast<float>(outer_steps_)});
  }
  // The outer step's average may have completed on some survivors only:
  // those behind take the outer state of the first that took the most
  // outer steps, and its model, as the outer step ends.
  void agree_survivors() override {
    const auto n = static_cast<std::size_t>(comm_.size());
    const auto mine = static_cast<std::int64_t>(outer_steps_);
    std::vector<std::int64_t> all(n);
    comm_.all_gather(&mine, all.data(), 1, ElemType::i64);
    const auto most = std::max_element(all.begin(), all.end());
    if (std::all_of(all.begin(), all.end(), [&](std::int64_t v) { return v == *most; })) return;
    const int src = static_cast<int>(most - all.begin());
    comm_.broadcast(slow_x_.data(), slow_x_.size(), ElemType::f32, src);
    comm_.broadcast(slow_u_.data(), slow_u_.size(), ElemType::f32, src);
    if (mine != *most) {
      set_x(slow_x_);
      w_ = 1.0;
      outer_steps_ = static_cast<std::uint64_t>(*most);
    }
  }
  void add_memory(MemoryUse& m) const override {
    m.params += slow_x_.size() * sizeof(float);
    m.optimizer_state += slow_u_.size() * sizeof(float);
  }

  const bool sgp_base_;  // the base is sgp (push-sum rounds), else local SGD
  std::vector<float> slow_x_, slow_u_;
  std::uint64_t outer_steps_ = 0;  // since the strategy was made (survivors compare them)
};

// The topology flags follow the base: local SGD averages exactly.
std::string misfit(const StrategyInfo& self, std::string_view flag, const GossipOptions& options) {
  if (std::string why = gossip_misfit(self.name, flag, /*synch_freq=*/false, /*slowmo=*/true); !why.empty())
    return why;
  if (flag == "localsgd-frequency" && options.slowmo_base != "localsgd")
    return "--localsgd-frequency applies to --slowmo-base localsgd";
  if ((flag == "topology" || flag == "peers-per-iteration") && options.slowmo_base == "localsgd")
    return "--topology applies to slowmo with --slowmo-base sgp (local SGD averages exactly)";
  return {};
}

}  // namespace

constexpr const char* kHelp =
    "local SGD or sgp, with SlowMo's outer momentum step on the exact average every slowmo_frequency steps";
extern const StrategyInfo kSlowmo{.name = "slowmo", .help = kHelp, .per_rank_models = true,
                                  .topology = "exponential", .option_misfit = misfit,
                                  .make = make_gossip<Slowmo>};

}  // namespace distopt::parallel::detail
