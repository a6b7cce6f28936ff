// diloco, DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed
// Low-Communication Training of Language Models") and Streaming DiLoCo
// (Douillard et al. 2025; docs/gossip.md, "DiLoCo"): every rank trains its
// own replica with its own inner optimizer; every sync_every (H) steps the
// pseudo-gradient
//   delta_r = theta_sync - theta_r
// is averaged over the ranks (rank-ordered sum, then / n), the outer
// optimizer steps theta_sync with it as its gradient, and every rank goes
// on from the result. The inner optimizer's state stays local, as in the
// paper.
//
// Streaming: the units are cut into P fragments (unit u in fragment u mod
// P), each with its own outer optimizer, synced every H steps, fragment p
// first after ((p + 1) H) / P steps, so the bytes of one sync fall by P. A
// fragment's average starts at its sync step and is applied sync_delay (tau)
// steps later, training going on meanwhile; once applied, the fragment's
// parameters are (1 - alpha) global + alpha local. With fragment_carry,
// global there is the new global plus the rank's own change since the sync
// step, so the steps taken in flight are kept (and counted by the next
// pseudo-gradient). P = 1, tau = 0 and alpha = 0 is plain DiLoCo, the same
// operations in the same order.
//
// On the wire: an f32 all-reduce, or (outer_dtype bf16, fp8, int4) every
// rank's encoded pseudo-gradient all-gathered and summed in f32 in rank
// order (gossip/compress.hpp), with optional error feedback.
//
// start_ is theta_sync (what the outer optimizers step), delta_ the averaged
// pseudo-gradient (their gradient), both in the padded layout.
#include <algorithm>

#include "core.hpp"
#include "distopt/core/error.hpp"
#include "distopt/gossip/compress.hpp"
#include "distopt/optim/rule.hpp"

namespace distopt::parallel::detail {

namespace {

constexpr const char* kOuterPrefix = "outer.";

std::size_t elements(const Optimizer::StateView& v) { return static_cast<std::size_t>(numel(v.shape)); }

class Diloco final : public GossipCore {
 public:
  explicit Diloco(const StrategyArgs& a) : GossipCore(a) {
    gossip::parse_wire_dtype(options_.outer_dtype, &wire_);  // checked in check_policy_options
    start_ = x_;
    delta_.assign(x_.size(), 0.0f);
    if (options_.outer_error_feedback && wire_ != gossip::WireDType::f32) error_.assign(x_.size(), 0.0f);
    // Averages that run behind training go on a communicator of their own:
    // on the main one, the trainer's next blocking collective (the step's
    // loss) would wait for them.
    if (options_.sync_delay > 0 && comm_.size() > 1) sync_comm_ = comm_.split(0, comm_.rank());
    carry_ = options_.fragment_carry && options_.sync_delay > 0;
    const auto& units = layout_.units();
    const auto P = static_cast<std::size_t>(options_.fragments);
    if (P > units.size())
      throw InvalidInput(str("--fragments ", P, ": the model has ", units.size(), units.size() == 1 ? " unit" : " units",
                             " (a fragment is at least one; at most --fragments ", units.size(), ")"));
    const auto H = static_cast<std::uint64_t>(options_.sync_every);
    fragments_.resize(P);
    for (std::size_t f = 0; f < P; ++f) fragments_[f].first_sync = ((f + 1) * H) / P;
    for (std::size_t u = 0; u < units.size(); ++u) {
      Fragment& f = fragments_[u % P];
      f.ranges.emplace_back(units[u].padded_offset, units[u].padded_offset + units[u].size());
      f.elements += units[u].size();
    }
    // Each parameter lies in one unit, hence in one fragment.
    std::vector<std::vector<Param>> views(P);
    for (std::size_t p = 0; p < layout_.params().size(); ++p) {
      const ParamSlot& s = layout_.params()[p];
      const std::size_t at = layout_.padded_offset(p);
      views[layout_.unit_of(p) % P].push_back(
          {s.name, {start_.data() + at, DType::f32, s.shape}, {delta_.data() + at, DType::f32, s.shape}, true});
    }
    const OptimizerSpec outer = outer_spec(options_);
    for (std::size_t f = 0; f < P; ++f) {
      Fragment& frag = fragments_[f];
      frag.values.assign(frag.elements, 0.0f);
      if (carry_) frag.at_sync.assign(frag.elements, 0.0f);
      if (wire_ != gossip::WireDType::f32) frag.wire.assign(gossip::wire_bytes(wire_, frag.elements), 0);
      if (views[f].empty()) continue;  // units without parameters: nothing to step
      try {
        frag.outer = make_outer(outer, std::move(views[f]));
      } catch (const InvalidInput& e) {
        throw InvalidInput(str("--outer-optimizer ", outer.name, ": ", e.what()));
      }
    }
  }

  ~Diloco() override {
    // Averages in flight: every rank started the same ones, so they complete.
    for (Fragment& f : fragments_) try {
        if (f.request) f.request->wait();
      } catch (...) {
      }
  }

  bool admits_new_ranks() override { return steps_ % static_cast<std::uint64_t>(options_.sync_every) == 0; }

  std::uint64_t bytes_sent() const override {
    return GossipCore::bytes_sent() + (sync_comm_ ? sync_comm_->bytes_sent() : 0);
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
  struct Fragment {
    std::vector<std::pair<std::size_t, std::size_t>> ranges;  // its units in the padded layout
    std::size_t elements = 0;
    std::uint64_t first_sync = 0;  // syncs at steps first_sync + k H (k >= 0)
    std::unique_ptr<Optimizer> outer;  // none for a fragment without parameters
    // The packed pseudo-gradient: the rank's own, then (once the average
    // has landed) the average; wire and gathered hold the encoded ones.
    std::vector<float> values;
    std::vector<std::uint8_t> wire, gathered;  // gathered: while in flight
    std::vector<float> at_sync;                // carry_: the rank's values at the sync step, while in flight
    std::unique_ptr<Request> request;
    bool in_flight = false;  // started, not applied
    std::uint64_t apply_at = 0;  // while in flight: the step that applies it
    bool landed = false;     // values holds the average
    std::uint64_t applied = 0;  // outer steps since the strategy was made (survivors compare them)
  };

  // A fragment's outer optimizer over its parameters (muon's companion
  // group takes the outer lr too; a fragment of 1-D parameters only is the
  // companion's alone).
  static std::unique_ptr<Optimizer> make_outer(const OptimizerSpec& outer, std::vector<Param> views) {
    std::vector<ParamGroupSpec> groups = optimizer_groups(outer, std::move(views), /*fallback_only=*/true);
    const OptionMap lr{{"lr", outer.options.at("lr")}};
    if (groups[0].params.empty()) {
      groups.erase(groups.begin());
      groups[0].rule.clear();
      return std::make_unique<Optimizer>(outer.fallback, std::move(groups), lr);
    }
    for (std::size_t g = 1; g < groups.size(); ++g) groups[g].options["lr"] = lr.at("lr");
    return std::make_unique<Optimizer>(outer.name, std::move(groups), outer.options);
  }

  // The last step, up to `step`, at which `f` synced (0: none yet).
  std::uint64_t last_sync(const Fragment& f, std::uint64_t step) const {
    if (step == 0 || step < f.first_sync) return 0;
    return step - (step - f.first_sync) % static_cast<std::uint64_t>(options_.sync_every);
  }
  // Calls fn(i, k) for each element of `f`: i in the padded layout, k in
  // the fragment's packed values.
  template <class Fn>
  static void each(const Fragment& f, Fn fn) {
    std::size_t k = 0;
    for (auto [b, e] : f.ranges)
      for (std::size_t i = b; i < e; ++i) fn(i, k++);
  }

  void mix() override {
    for (Fragment& f : fragments_)
      if (f.in_flight && f.apply_at == steps_) apply(f);
    for (Fragment& f : fragments_)
      if (steps_ > 0 && last_sync(f, steps_) == steps_) {
        start(f);
        if (f.apply_at == steps_) apply(f);  // sync_delay 0
      }
  }

  // The rank's pseudo-gradient of `f` goes on the wire.
  void start(Fragment& f) {
    each(f, [&](std::size_t i, std::size_t k) { f.values[k] = start_[i] - x_[i]; });
    if (carry_) each(f, [&](std::size_t i, std::size_t k) { f.at_sync[k] = x_[i]; });
    if (wire_ == gossip::WireDType::f32) {
      f.request = wire().iall_reduce(f.values.data(), f.values.data(), f.elements, ElemType::f32, ReduceOp::avg);
    } else {
      if (!error_.empty()) each(f, [&](std::size_t i, std::size_t k) { f.values[k] += error_[i]; });
      gossip::encode(wire_, f.values, f.wire.data());
      if (!error_.empty()) {
        // What the others will see of this rank; the rest is carried.
        gossip::decode(wire_, f.wire.data(), f.values);
        each(f, [&](std::size_t i, std::size_t k) { error_[i] = (start_[i] - x_[i] + error_[i]) - f.values[k]; });
      }
      // n encoded copies, held only while the fragment is in flight.
      f.gathered.resize(f.wire.size() * static_cast<std::size_t>(comm_.size()));
      f.request = wire().iall_gather(f.wire.data(), f.gathered.data(), f.wire.size(), ElemType::u8);
    }
    f.in_flight = true;
    f.landed = false;
    f.apply_at = steps_ + static_cast<std::uint64_t>(options_.sync_delay);
  }

  Communicator& wire() { return sync_comm_ ? *sync_comm_ : comm_; }

  // Waits for `f`'s average; values holds it after.
  void land(Fragment& f) {
    if (f.landed) return;
    blocked([&] { f.request->wait(); });
    f.request.reset();
    if (wire_ != gossip::WireDType::f32) {
      // The f32 sum in rank order, then / n (as the all-reduce's avg).
      std::vector<float> one(f.elements);
      for (int r = 0; r < comm_.size(); ++r) {
        gossip::decode(wire_, f.gathered.data() + static_cast<std::size_t>(r) * f.wire.size(),
                       r == 0 ? std::span<float>(f.values) : std::span<float>(one));
        if (r > 0)
          for (std::size_t i = 0; i < f.elements; ++i) f.values[i] += one[i];
      }
      const auto n = static_cast<float>(comm_.size());
      for (float& v : f.values) v = v / n;
      f.gathered = {};
    }
    f.landed = true;
  }

  // The outer step of `f` with its average; the fragment restarts from it
  // (with carry_, from it plus the rank's steps since the sync step).
  void apply(Fragment& f) {
    land(f);
    each(f, [&](std::size_t i, std::size_t k) { delta_[i] = f.values[k]; });
    if (f.outer) f.outer->step();
    restart(f, carry_);
    f.in_flight = false;
    f.landed = false;
    ++f.applied;
  }

  // The rank's values of `f` from theta_sync: (1 - alpha) from + alpha local,
  // from being theta_sync, or with `carry` theta_sync plus the rank's change
  // since the sync step.
  void restart(Fragment& f, bool carry) {
    const auto alpha = static_cast<float>(options_.fragment_alpha);
    each(f, [&](std::size_t i, std::size_t k) {
      const float from = carry ? start_[i] + (x_[i] - f.at_sync[k]) : start_[i];
      x_[i] = alpha == 0.0f ? from : (1.0f - alpha) * from + alpha * x_[i];
    });
  }

  // In place: the outer optimizers' views point into start_.
  void start_fresh() override {
    std::copy(x_.begin(), x_.end(), start_.begin());
    std::fill(error_.begin(), error_.end(), 0.0f);
  }

  // theta_sync, the carried quantisation error, the outer optimizers' state
  // tensors ("outer.<i>.<key>", i counting their parameters over the
  // fragments in order) and the average of each fragment in flight
  // ("diloco_flight.<p>", waited for here; with carry_, the rank's values at
  // its sync step too, "diloco_flight_at_sync.<p>").
  void save_tensors(LocalState& st) override {
    save_synced(st);
    for (std::size_t p = 0; p < fragments_.size(); ++p)
      if (fragments_[p].in_flight) {
        land(fragments_[p]);
        save_flight(st, p);
      }
  }
  void save_flight(LocalState& st, std::size_t p) const {
    st.tensors.emplace_back(str("diloco_flight.", p), fragments_[p].values);
    if (carry_) st.tensors.emplace_back(str("diloco_flight_at_sync.", p), fragments_[p].at_sync);
  }
  // Fragment p's average in flight (and with carry_ its values at the sync
  // step, checked against its size).
  void load_flight(const LocalState& st, std::size_t p, const std::vector<float>& flight) {
    Fragment& f = fragments_[p];
    std::copy(flight.begin(), flight.end(), f.values.begin());
    if (!carry_) return;
    const std::vector<float>& at_sync = saved_tensor(st, str("diloco_flight_at_sync.", p), f.elements);
    std::copy(at_sync.begin(), at_sync.end(), f.at_sync.begin());
  }
  // A survivor drops the averages in flight (the ranks that started them
  // are not all there): the fragment's next sync measures its
  // pseudo-gradient from the theta_sync it still has, so the lost average's
  // change is carried into it.
  void survivor_tensors(LocalState& st) override {
    save_synced(st);
    for (std::size_t p = 0; p < fragments_.size(); ++p)  // landed by complete_in_flight()
      if (fragments_[p].in_flight && fragments_[p].landed) save_flight(st, p);
    std::vector<float> applied;
    for (const Fragment& f : fragments_) applied.push_back(static_cast<float>(f.applied));
    st.tensors.emplace_back("diloco_applied", std::move(applied));
  }
  // A sync that failed may have completed on some survivors only: for each
  // fragment, those behind take theta_sync and the outer state of the
  // first that applied the most outer steps, and restart from it as apply()
  // does without carry_ (the steps since the failed sync go with it).
  void agree_survivors() override {
    const std::size_t P = fragments_.size(), n = static_cast<std::size_t>(comm_.size());
    std::vector<std::int64_t> mine(P), all(P * n);
    for (std::size_t f = 0; f < P; ++f) mine[f] = static_cast<std::int64_t>(fragments_[f].applied);
    comm_.all_gather(mine.data(), all.data(), P, ElemType::i64);
    for (std::size_t p = 0; p < P; ++p) {
      Fragment& f = fragments_[p];
      std::int64_t most = 0;
      int src = 0;
      bool same = true;
      for (std::size_t r = 0; r < n; ++r) {
        same = same && all[r * P + p] == all[p];
        if (all[r * P + p] > most) most = all[r * P + p], src = static_cast<int>(r);
      }
      if (same) continue;
      const bool behind = mine[p] != most;
      std::vector<float> packed(f.elements);
      each(f, [&](std::size_t i, std::size_t k) { packed[k] = start_[i]; });
      for (std::size_t j = 0; f.outer && j < f.outer->num_params(); ++j) {
        if (behind && !f.outer->has_state(j)) f.outer->init_state(j);
        for (const auto& v : f.outer->state_views(j)) packed.insert(packed.end(), v.data, v.data + elements(v));
      }
      comm_.broadcast(packed.data(), packed.size(), ElemType::f32, src);
      if (!behind) continue;
      each(f, [&](std::size_t i, std::size_t k) { start_[i] = packed[k]; });
      std::size_t at = f.elements;
      for (std::size_t j = 0; f.outer && j < f.outer->num_params(); ++j)
        for (const auto& v : f.outer->state_views(j)) {
          std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(at), elements(v), v.data);
          at += elements(v);
        }
      if (f.outer) f.outer->state_written();
      restart(f, /*carry=*/false);
      f.applied = static_cast<std::uint64_t>(most);
    }
  }
  void complete_in_flight() override {
    for (Fragment& f : fragments_)
      if (f.in_flight) land(f);
  }
  // theta_sync, the carried error and the outer optimizers' state.
  void save_synced(LocalState& st) {
    st.tensors.emplace_back("diloco_start", start_);
    if (!error_.empty()) st.tensors.emplace_back("diloco_error", error_);
    std::size_t i = 0;
    for (Fragment& f : fragments_)
      for (std::size_t j = 0; f.outer && j < f.outer->num_params(); ++j, ++i)
        for (const auto& v : f.outer->state_views(j))
          st.tensors.emplace_back(str(kOuterPrefix, i, ".", v.key), std::vector<float>(v.data, v.data + elements(v)));
  }
  void load_tensors(const LocalState& st) override {
    const std::vector<float>& start = saved_tensor(st, "diloco_start");
    std::copy(start.begin(), start.end(), start_.begin());
    if (!error_.empty()) {
      const std::vector<float>& error = saved_tensor(st, "diloco_error");
      std::copy(error.begin(), error.end(), error_.begin());
    }
    auto find = [&](const std::string& name) -> const std::vector<float>* {
      for (const auto& [n, values] : st.tensors)
        if (n == name) return &values;
      return nullptr;
    };
    std::size_t i = 0;
    for (Fragment& f : fragments_) {
      if (!f.outer) continue;
      for (std::size_t j = 0; j < f.outer->num_params(); ++j, ++i) {
        const std::string prefix = str(kOuterPrefix, i, ".");
        bool any = false;
        for (const auto& [name, values] : st.tensors) any = any || name.starts_with(prefix);
        if (!any) continue;  // saved before its first outer step
        f.outer->init_state(j);
        for (const auto& v : f.outer->state_views(j)) {
          const std::vector<float>* saved = find(prefix + v.key);
          if (saved == nullptr || saved->size() != elements(v))
            throw InvalidInput(str("diloco: the checkpoint's outer optimizer state '", prefix, v.key,
                                   saved ? "' has another size" : "' is missing", " (rank ", comm_.rank(), ")"));
          std::copy(saved->begin(), saved->end(), v.data);
        }
      }
      // The optimizer's own step counts (LAMB's bias corrections) follow
      // the loaded "step".
      f.outer->state_written();
    }
    if (st.survivor) {
      const std::vector<float>& applied = saved_tensor(st, "diloco_applied", fragments_.size());
      for (std::size_t p = 0; p < fragments_.size(); ++p) {
        if (!(applied[p] >= 0 && applied[p] < 1.6e7f))
          throw InvalidInput(str("diloco: a survivor's state counts ", applied[p], " outer steps of fragment ", p));
        Fragment& f = fragments_[p];
        f.applied = static_cast<std::uint64_t>(applied[p]);
        // An average that landed before a join (complete_in_flight) is
        // applied at its step; a survivor of a loss has none.
        const std::vector<float>* flight = find(str("diloco_flight.", p));
        f.apply_at = last_sync(f, steps_) + static_cast<std::uint64_t>(options_.sync_delay);
        f.in_flight = f.landed = flight != nullptr && f.apply_at > steps_;
        if (flight != nullptr && (!f.in_flight || flight->size() != f.elements))
          throw InvalidInput(str("diloco: a survivor's state has an average in flight of fragment ", p,
                                 " that does not fit step ", steps_));
        if (flight) load_flight(st, p, *flight);
      }
      return;
    }
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      Fragment& f = fragments_[p];
      // In flight after steps_ steps: started at its last sync up to then,
      // to be applied at a later step.
      const std::uint64_t last = last_sync(f, steps_);
      f.apply_at = last + static_cast<std::uint64_t>(options_.sync_delay);
      f.in_flight = f.landed = last > 0 && f.apply_at > steps_;
      const std::vector<float>* flight = find(str("diloco_flight.", p));
      if (f.in_flight != (flight != nullptr) || (flight && flight->size() != f.elements))
        throw InvalidInput(str("diloco: the checkpoint of rank ", comm_.rank(), " at step ", steps_,
                               f.in_flight ? " lacks the average in flight of fragment " : " has an average in flight of fragment ",
                               p, flight && f.in_flight ? " of another size" : ""));
      if (flight) load_flight(st, p, *flight);
    }
  }
  void add_memory(MemoryUse& m) const override {
    m.params += start_.size() * sizeof(float);
    m.grads += (delta_.size() + error_.size()) * sizeof(float);
    std::size_t gathered = 0;  // the largest fragment's n encoded copies, while in flight
    for (const Fragment& f : fragments_) {
      if (f.outer) m.optimizer_state += f.outer->state_bytes();
      m.grads += (f.values.size() + f.at_sync.size()) * sizeof(float) + f.wire.size();
      gathered = std::max(gathered, f.wire.size() * static_cast<std::size_t>(comm_.size()));
    }
    m.grads += gathered;
  }

  gossip::WireDType wire_ = gossip::WireDType::f32;
  bool carry_ = false;  // fragment_carry with a sync_delay
  std::vector<float> start_, delta_, error_;
  std::unique_ptr<Communicator> sync_comm_;  // with sync_delay > 0; outlives the requests in fragments_
  std::vector<Fragment> fragments_;
};

std::string misfit(const StrategyInfo& self, std::string_view flag, const GossipOptions& options) {
  if (flag == "topology" || flag == "peers-per-iteration")
    return str("--", flag, " applies to the strategies that gossip on a graph, not diloco (it averages exactly)");
  if (flag == "outer-momentum" && options.outer_optimizer != "sgd")
    return str("--outer-momentum applies to --outer-optimizer sgd (", options.outer_optimizer,
               " keeps its own defaults)");
  if (flag == "fragment-carry" && options.sync_delay == 0)
    return "--fragment-carry applies to --sync-delay 1 or more (with 0 no step runs while an average is in flight)";
  if (flag == "outer-error-feedback" && options.outer_dtype == "f32")
    return "--outer-error-feedback applies to a compressed --outer-dtype (bf16, fp8, int4): f32 loses nothing";
  return gossip_misfit(self.name, flag, /*synch_freq=*/false, /*slowmo=*/false, /*outer=*/true);
}

}  // namespace

constexpr const char* kHelp =
    "a whole model per rank trained sync-every steps alone; then the averaged change steps an outer optimizer";
extern const StrategyInfo kDiloco{.name = "diloco", .help = kHelp, .per_rank_models = true, .option_misfit = misfit,
                                  .make = make_gossip<Diloco>,
                                  // and the synced model and the outer optimizer's state
                                  .memory = {.whole = 8}};

}  // namespace distopt::parallel::detail
