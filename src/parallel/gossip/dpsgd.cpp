// dpsgd, D-PSGD in its consensus form (Lian et al. 2017; docs/gossip.md,
// "Training"): x <- W x - lr g(x), the exchange of x (a push-sum round of a
// copy, W doubly stochastic, default bipartite-exponential) started after
// each step and finished by the next, so it runs during forward and
// backward. Invariant between steps: send_ holds, or an exchange in flight
// will land in it, the W x that the next step takes.
#include "core.hpp"

namespace distopt::parallel::detail {

namespace {

class Dpsgd final : public GossipCore {
 public:
  explicit Dpsgd(const StrategyArgs& a) : GossipCore(a) {
    add_push_sum();
    start_exchange();  // of x^0, during the first forward and backward
  }

  ~Dpsgd() override {
    // The core finishes rounds into x; this one lands in send_.
    try {
      if (push_sum_->in_flight()) finish_exchange();
    } catch (...) {
    }
  }

  void resume(std::uint64_t steps, const LocalState* saved) override {
    // The constructor's exchange of the initial x is finished and replaced:
    // by the saved one, or by an exchange at step `steps` (start_fresh).
    if (push_sum_->in_flight()) finish_exchange();
    GossipCore::resume(steps, saved);
  }

 private:
  void start_exchange() {
    send_ = x_;
    double unused = 1.0;
    push_sum_->start(send_, unused);
  }
  void finish_exchange() {
    double unused = 1.0;
    push_sum_->finish(send_, unused);
  }

  // x <- W x (the exchange started after the last step, unless a
  // checkpoint finished it already), then the step with the gradient taken
  // at the old x.
  void before_update() override {
    if (push_sum_->in_flight()) blocked([&] { finish_exchange(); });
    set_x(send_);
  }
  void mix() override { start_exchange(); }
  void start_fresh() override { start_exchange(); }

  void save_tensors(LocalState& st) override {
    // The exchange of x started after the last step, finished now into
    // what the next step takes: the same bits as finishing it then.
    if (push_sum_->in_flight()) blocked([&] { finish_exchange(); });
    st.tensors.emplace_back("send", send_);
  }
  void load_tensors(const LocalState& st) override { send_ = saved_tensor(st, "send"); }
  // A survivor drops the exchange in flight: the next step takes its own
  // x (before a join, the exchange completes: its W x).
  void survivor_tensors(LocalState& st) override { st.tensors.emplace_back("send", exchanged_ ? send_ : x_); }
  void complete_in_flight() override {
    if (push_sum_->in_flight()) blocked([&] { finish_exchange(); });
    exchanged_ = true;
  }
  void add_memory(MemoryUse& m) const override { m.params += send_.size() * sizeof(float); }

  std::vector<float> send_;
  bool exchanged_ = false;  // complete_in_flight() finished the exchange into send_
};

}  // namespace

constexpr const char* kHelp =
    "a whole model per rank; x <- W x - lr g(x), the exchange of x overlapping forward and backward";
extern const StrategyInfo kDpsgd{.name = "dpsgd", .help = kHelp, .per_rank_models = true,
                                 .topology = "bipartite-exponential", .option_misfit = topology_flags<false>, .make = make_gossip<Dpsgd>};

}  // namespace distopt::parallel::detail
