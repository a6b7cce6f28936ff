// diloco, DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed
// Low-Communication Training of Language Models"; docs/gossip.md, "DiLoCo"):
// every rank trains its own replica with its own inner optimizer for
// sync_every (H) steps; then the pseudo-gradient
//   delta_r = theta_sync - theta_r
// is averaged over the ranks (rank-ordered sum, then / n), the outer
// optimizer steps theta_sync with it as its gradient, and every rank goes
// on from the result. The inner optimizer's state stays local, as in the
// paper. One all-reduce of the model per H steps is all it communicates.
// start_ is theta_sync (what the outer optimizer steps), delta_ the
// averaged pseudo-gradient (its gradient).
#include <algorithm>

#include "core.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt::parallel::detail {

namespace {

constexpr const char* kOuterPrefix = "outer.";

std::size_t elements(const Optimizer::StateView& v) { return static_cast<std::size_t>(numel(v.shape)); }

class Diloco final : public GossipCore {
 public:
  explicit Diloco(const StrategyArgs& a) : GossipCore(a, /*default_topology=*/"") {
    start_ = x_;
    delta_.assign(x_.size(), 0.0f);
    std::vector<Param> views;
    for (std::size_t p = 0; p < layout_.params().size(); ++p) {
      const ParamSlot& s = layout_.params()[p];
      const std::size_t at = layout_.padded_offset(p);
      views.push_back({s.name, {start_.data() + at, DType::f32, s.shape}, {delta_.data() + at, DType::f32, s.shape}, true});
    }
    const OptimizerSpec outer = outer_spec(options_);
    try {
      std::vector<ParamGroupSpec> groups = optimizer_groups(outer, std::move(views));
      // The companion's group (muon's 1-D parameters) takes the outer lr too.
      for (std::size_t g = 1; g < groups.size(); ++g) groups[g].options["lr"] = options_.outer_lr;
      outer_ = std::make_unique<Optimizer>(outer.name, std::move(groups), outer.options);
    } catch (const InvalidInput& e) {
      throw InvalidInput(str("--outer-optimizer ", outer.name, ": ", e.what()));
    }
  }

  // The outer optimizer: `outer_optimizer` with lr outer_lr; sgd with the
  // paper's Nesterov momentum; a rule that would choose its own step size
  // (Adafactor's relative_step) is told to take the lr.
  static OptimizerSpec outer_spec(const GossipOptions& g) {
    const RuleInfo* rule = find_rule(g.outer_optimizer);
    if (rule == nullptr)
      throw InvalidInput(str("--outer-optimizer: '", g.outer_optimizer, "' is not an optimizer of the library"));
    OptimizerSpec outer{std::string(rule->name), {{"lr", g.outer_lr}}, std::string(rule->companion)};
    auto has = [&](std::string_view option) {
      return std::any_of(rule->options.begin(), rule->options.end(), [&](const OptionSpec& o) { return o.name == option; });
    };
    if (rule->name == "sgd") {
      outer.options["momentum"] = g.outer_momentum;
      outer.options["nesterov"] = g.outer_momentum > 0;
    }
    if (has("relative_step")) outer.options["relative_step"] = false;
    return outer;
  }

  // Before anything is built: the outer optimizer and its options.
  static void check_policy_options(const GossipOptions& g) {
    const OptimizerSpec outer = outer_spec(g);
    const RuleInfo& rule = rule_or_throw(outer.name);
    try {
      rule.validate(resolve_options(rule, outer.options));
    } catch (const InvalidInput& e) {
      throw InvalidInput(str("--outer-optimizer ", outer.name, ": ", e.what()));
    }
  }

 private:
  void mix() override {
    if (steps_ % static_cast<std::uint64_t>(options_.sync_every) != 0) return;
    for (std::size_t i = 0; i < x_.size(); ++i) delta_[i] = start_[i] - x_[i];  // padding: 0 - 0
    blocked([&] {
      const std::vector<float> mean = average(delta_);
      std::copy(mean.begin(), mean.end(), delta_.begin());
    });
    outer_->step();
    set_x(start_);
  }

  // In place: the outer optimizer's views point into start_.
  void start_fresh() override { std::copy(x_.begin(), x_.end(), start_.begin()); }

  // theta_sync, then the outer optimizer's state tensors ("outer.<i>.<key>").
  void save_tensors(LocalState& st) override {
    st.tensors.emplace_back("diloco_start", start_);
    for (std::size_t i = 0; i < outer_->num_params(); ++i)
      for (const auto& v : outer_->state_views(i))
        st.tensors.emplace_back(str(kOuterPrefix, i, ".", v.key), std::vector<float>(v.data, v.data + elements(v)));
  }
  void load_tensors(const LocalState& st) override {
    const std::vector<float>& start = saved_tensor(st, "diloco_start");
    std::copy(start.begin(), start.end(), start_.begin());
    for (std::size_t i = 0; i < outer_->num_params(); ++i) {
      const std::string prefix = str(kOuterPrefix, i, ".");
      bool any = false;
      for (const auto& [name, values] : st.tensors) any = any || name.starts_with(prefix);
      if (!any) continue;  // saved before its first outer step
      outer_->init_state(i);
      for (const auto& v : outer_->state_views(i)) {
        const std::vector<float>* saved = nullptr;
        for (const auto& [name, values] : st.tensors)
          if (name == prefix + v.key) saved = &values;
        if (saved == nullptr || saved->size() != elements(v))
          throw InvalidInput(str("diloco: the checkpoint's outer optimizer state '", prefix, v.key,
                                 saved ? "' has another size" : "' is missing", " (rank ", comm_.rank(), ")"));
        std::copy(saved->begin(), saved->end(), v.data);
      }
    }
    // The optimizer's own step counts (LAMB's bias corrections) follow the
    // loaded "step".
    outer_->state_written();
  }
  void add_memory(MemoryUse& m) const override {
    m.params += start_.size() * sizeof(float);
    m.grads += delta_.size() * sizeof(float);
    m.optimizer_state += outer_->state_bytes();
  }

  std::vector<float> start_, delta_;
  std::unique_ptr<Optimizer> outer_;
};

std::string misfit(const StrategyInfo& self, std::string_view flag, const GossipOptions& options) {
  if (flag == "topology" || flag == "peers-per-iteration")
    return str("--", flag, " applies to the strategies that gossip on a graph, not diloco (it averages exactly)");
  if (flag == "outer-momentum" && options.outer_optimizer != "sgd")
    return str("--outer-momentum applies to --outer-optimizer sgd (", options.outer_optimizer,
               " keeps its own defaults)");
  return gossip_misfit(self.name, flag, /*synch_freq=*/false, /*slowmo=*/false, /*outer=*/true);
}

}  // namespace

constexpr const char* kHelp =
    "a whole model per rank trained sync-every steps alone; then the averaged change steps an outer optimizer";
extern const StrategyInfo kDiloco{.name = "diloco", .help = kHelp, .per_rank_models = true, .option_misfit = misfit,
                                  .make = make_gossip<Diloco>};

}  // namespace distopt::parallel::detail
