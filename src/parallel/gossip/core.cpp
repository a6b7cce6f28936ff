// The gossip core (core.hpp; docs/gossip.md, "Training"): the numerator x,
// the weight w, the rank's own gradient and optimizer, the step skeleton,
// evaluation on the ranks' average, the consensus distance and the
// LocalState of a checkpoint (docs/formats.md, "Gossip runs"). Invariant:
// the LocalState's numbers and tensors come in one fixed order, which
// load_local() reads back exactly.
#include "core.hpp"

#include <algorithm>
#include <cmath>

#include "distopt/core/error.hpp"
#include "distopt/gossip/compress.hpp"

namespace distopt::parallel::detail {

void check_gossip_options(std::string_view strategy, const StrategyOptions& o) {
  if (o.param_dtype != DType::f32)
    throw InvalidInput(str("--param-dtype ", name_of(o.param_dtype), ": strategy ", strategy,
                           " keeps fp32 parameters (mixed precision is for ddp and zero1-3)"));
  if (o.grad_compression != GradCompression::none)
    throw InvalidInput(str("--grad-compression ", name_of(o.grad_compression), ": strategy ", strategy,
                           " sends no gradients (compression is for ddp and zero1-3; diloco has --outer-dtype)"));
  if (o.int8_gather)
    throw InvalidInput(
        str("--gather-compression int8: strategy ", strategy, " gathers no parameters (it is for zero3)"));
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
  if (g.sync_every < 1) throw InvalidInput(str("--sync-every must be at least 1 (got ", g.sync_every, ")"));
  if (!(g.outer_lr > 0 && std::isfinite(g.outer_lr)))
    throw InvalidInput(str("--outer-lr must be a positive number (got ", g.outer_lr, ")"));
  if (!(g.outer_momentum >= 0 && g.outer_momentum < 1))
    throw InvalidInput(str("--outer-momentum must be in [0, 1) (got ", g.outer_momentum, ")"));
  if (g.fragments < 1) throw InvalidInput(str("--fragments must be at least 1 (got ", g.fragments, ")"));
  if (g.fragments > g.sync_every)
    throw InvalidInput(str("--fragments ", g.fragments, " is more than --sync-every ", g.sync_every,
                           ": each fragment syncs at a step of its own in the cycle"));
  if (g.sync_delay < 0 || g.sync_delay >= g.sync_every)
    throw InvalidInput(str("--sync-delay must be in [0, --sync-every) = [0, ", g.sync_every, ") (got ", g.sync_delay,
                           "): a fragment's average must land before its next sync"));
  if (!(g.fragment_alpha >= 0 && g.fragment_alpha <= 1))
    throw InvalidInput(str("--fragment-alpha must be in [0, 1] (got ", g.fragment_alpha, ")"));
  if (gossip::WireDType wire; !gossip::parse_wire_dtype(g.outer_dtype, &wire))
    throw InvalidInput(str("--outer-dtype: '", g.outer_dtype, "' is not f32, bf16, fp8 or int4"));
  if (g.slowmo_base != "localsgd" && g.slowmo_base != "sgp")
    throw InvalidInput(str("--slowmo-base: '", g.slowmo_base, "' is not localsgd or sgp"));
}

std::string gossip_misfit(std::string_view strategy, std::string_view flag, bool synch_freq, bool slowmo, bool outer) {
  if ((flag == "sync-every" || flag.starts_with("outer-") || flag.starts_with("fragment") || flag == "sync-delay") &&
      !outer)
    return str("--", flag, " applies to --strategy diloco, not ", strategy);
  if (flag == "synch-freq" && !synch_freq)
    return str("--synch-freq applies to --strategy osgp and adpsgd, not ", strategy);
  if ((flag.starts_with("slowmo") || flag == "localsgd-frequency") && !slowmo)
    return str("--", flag, " applies to --strategy slowmo, not ", strategy);
  return {};
}

GossipCore::GossipCore(const StrategyArgs& a) : StrategyCore(a), options_(a.options.gossip) {
  const std::string_view default_topology = a.info.topology;
  Communicator& comm = a.comm;
  const FlatLayout& flat = a.layout;
  const InitialParams& initial = a.initial;
  const OptimizerSpec& spec = a.optimizer;
  const StrategyOptions& options = a.options;
  if (!default_topology.empty())
    topology_.emplace(options_.topology.empty() ? default_topology : std::string_view(options_.topology),
                      comm.size(), options_.peers_per_iteration);
  DISTOPT_CHECK(initial.size() == flat.elements, initial.size(), " vs ", flat.elements);
  check_agreement(comm, info_.name, layout_, spec, options);
  const std::size_t padded = layout_.padded_elements();
  x_.assign(padded, 0.0f);
  grads_.assign(padded, 0.0f);
  for (const auto& u : layout_.units())
    initial.read(u.begin, std::span<float>(x_.data() + u.padded_offset, u.size()));
  std::vector<Param> views;
  for (std::size_t p = 0; p < layout_.params().size(); ++p) {
    const ParamSlot& s = layout_.params()[p];
    const std::size_t at = layout_.padded_offset(p);
    views.push_back({s.name, {x_.data() + at, DType::f32, s.shape}, {grads_.data() + at, DType::f32, s.shape}, true});
    owned_.push_back({grads_.data() + at, DType::f32, {std::int64_t(s.numel())}});
  }
  optimizer_ = std::make_unique<Optimizer>(spec.name, optimizer_groups(spec, std::move(views)), spec.options);
}

GossipCore::~GossipCore() {
  // Rounds in flight: every rank started the same ones (the schedule does
  // not depend on timing), so finishing them completes and nothing stays
  // behind in the transport. (dpsgd finishes its exchange itself.)
  try {
    for (auto& p : pipeline_)
      if (p->in_flight()) p->finish(x_, w_);
    if (push_sum_ && push_sum_->in_flight()) {
      double unused = w_;
      push_sum_->finish(x_, unused);
    }
  } catch (...) {
  }
}

MemoryUse GossipCore::memory() const {
  MemoryUse m;
  m.params = (x_.size() + z_.size()) * sizeof(float);
  m.grads = grads_.size() * sizeof(float);
  m.master_params = optimizer_->master_bytes();
  m.optimizer_state = optimizer_->state_bytes() - m.master_params;
  add_memory(m);
  return m;
}

std::span<const float> GossipCore::acquire(std::size_t u, models::Pass) {
  const auto& unit = layout_.units().at(u);
  return model_values().subspan(unit.padded_offset, unit.size());
}

std::span<float> GossipCore::grads(std::size_t u) {
  const auto& unit = layout_.units().at(u);
  return std::span<float>(grads_).subspan(unit.padded_offset, unit.size());
}

void GossipCore::step(const UpdateFn& update) {
  // The rank's own mean gradient.
  if (comm_.size() > 1) {
    const auto n = static_cast<float>(comm_.size());
    for (float& g : grads_) g *= n;
  }
  for (std::size_t i = 0; i < optimizer_->num_params(); ++i) optimizer_->param(i).has_grad = true;
  before_update();
  // Statistics (clipping, the scaler's inf check) are the rank's own.
  const GradShard shard{owned_, [](double&, bool) {}};
  {
    std::lock_guard lock(x_mutex_);
    if (update)
      update(*optimizer_, shard);
    else
      optimizer_->step();
  }
  ++steps_;
  z_valid_ = false;  // (also if mix() fails: a survivor's model is x / w)
  mix();
  z_valid_ = false;
}

std::span<const float> GossipCore::own_params() {
  settle();
  return model_values();
}

std::unique_ptr<models::UnitAccess> GossipCore::access_to(std::span<const float> own) {
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

models::UnitAccess& GossipCore::eval_access() {
  settle();
  eval_values_ = average(model_values());
  eval_ = std::make_unique<ValuesAccess>(comm_, layout_, eval_values_, /*replicated=*/true);
  return *eval_;
}

double GossipCore::consensus_distance() {
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

// Scalars: w, then for each push-sum gossiper (the main one, then the
// pipeline) its iteration, whether a round is in flight and, if one is, the
// weight it sent and the in-peers' weight shares (count first). Tensors: x;
// the policy's (dpsgd's "send", slowmo's "slow_x" and "slow_u", diloco's
// "diloco_start", "diloco_error", "outer.<i>.<key>" and "diloco_flight.<p>"); the
// in-peers' shares of each round in flight ("pushsum<p>.in<i>").
std::optional<LocalState> GossipCore::local_state() {
  settle();
  LocalState st;
  st.steps = steps_;
  st.scalars.push_back(w_);
  st.tensors.emplace_back("x", x_);
  save_tensors(st);
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

// The layout of local_state() with weight 1 and no round in flight: x is
// the de-biased model. A push-sum round that failed halfway scaled x and w
// alike (PushSum::start) and added nothing, so x / w is this rank's model
// with or without the round (step() drops the cached z before mixing).
std::optional<LocalState> GossipCore::survivor_state() {
  LocalState st;
  st.survivor = true;
  st.steps = steps_;
  st.scalars.push_back(1.0);
  const std::span<const float> z = model_values();
  st.tensors.emplace_back("x", std::vector<float>(z.begin(), z.end()));
  survivor_tensors(st);
  // The padded layout depends on the world size, which changes: model-sized
  // tensors go in the model's flat layout.
  for (auto& [name, values] : st.tensors)
    if (values.size() == x_.size()) values = to_flat(values);
  for (std::size_t p = 0; p < gossipers().size(); ++p) {
    st.scalars.push_back(static_cast<double>(steps_));
    st.scalars.push_back(0.0);
  }
  return st;
}

bool GossipCore::can_run_at(int world) {
  if (!topology_) return true;
  try {
    gossip::Topology(topology_->name(), world, topology_->peers_per_iteration());
    return true;
  } catch (const InvalidInput&) {
    return false;
  }
}

void GossipCore::complete_in_flight() {
  for (gossip::PushSum* g : gossipers())
    if (g->in_flight()) blocked([&] { g->finish(x_, w_); });
  z_valid_ = false;
}

void GossipCore::resume(std::uint64_t steps, const LocalState* saved) {
  steps_ = steps;
  if (saved == nullptr) {
    for (gossip::PushSum* g : gossipers()) g->set_iteration(steps);
    start_fresh();
  } else if (saved->survivor) {
    LocalState padded = *saved;  // (model-sized tensors flat: survivor_state)
    for (auto& [name, values] : padded.tensors)
      if (values.size() == layout_.model_elements() && !name.starts_with("outer.")) values = to_padded(values);
    load_local(padded);
  } else {
    load_local(*saved);
  }
  if (saved != nullptr && saved->survivor) {
    // The survivors go on in step (`steps` is the count they agreed on;
    // a rank whose last collective failed where another's completed is
    // one behind) and with the same gossip schedule.
    for (gossip::PushSum* g : gossipers()) g->set_iteration(steps);
    agree_survivors();
  }
  z_valid_ = false;
}

std::span<const float> GossipCore::model_values() {
  if (w_ == 1.0) return x_;
  if (!z_valid_) {
    z_.resize(x_.size());
    const auto inv = static_cast<float>(1.0 / w_);
    for (std::size_t i = 0; i < x_.size(); ++i) z_[i] = x_[i] * inv;
    z_valid_ = true;
  }
  return z_;
}

std::vector<float> GossipCore::to_flat(std::span<const float> padded) const {
  std::vector<float> out(layout_.model_elements());
  for (const auto& u : layout_.units())
    std::copy_n(padded.begin() + static_cast<std::ptrdiff_t>(u.padded_offset), u.size(),
                out.begin() + static_cast<std::ptrdiff_t>(u.begin));
  return out;
}

std::vector<float> GossipCore::to_padded(std::span<const float> flat) const {
  std::vector<float> out(x_.size(), 0.0f);
  for (const auto& u : layout_.units())
    std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(u.begin), u.size(),
                out.begin() + static_cast<std::ptrdiff_t>(u.padded_offset));
  return out;
}

gossip::PushSum& GossipCore::add_push_sum(int tag) {
  if (!push_sum_) return push_sum_.emplace(comm_, *topology_, x_.size(), tag);
  return *pipeline_.emplace_back(std::make_unique<gossip::PushSum>(comm_, *topology_, x_.size(), tag));
}

void GossipCore::mix_push_sum() {
  blocked([&] { push_sum_->mix(x_, w_); });
}

void GossipCore::set_x(std::span<const float> values) {
  DISTOPT_CHECK(values.size() == x_.size(), values.size(), " vs ", x_.size());
  std::copy(values.begin(), values.end(), x_.begin());
}

std::vector<float> GossipCore::average(std::span<const float> values) {
  std::vector<float> out(values.begin(), values.end());
  if (comm_.size() > 1) comm_.all_reduce(out.data(), out.data(), out.size(), ElemType::f32, ReduceOp::avg);
  return out;
}

const std::vector<float>& GossipCore::saved_tensor(const LocalState& st, const std::string& name,
                                                  std::size_t size) const {
  for (const auto& [n, v] : st.tensors)
    if (n == name) {
      if (size != 0 && v.size() != size)
        throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), ": ", name, " has ",
                               v.size(), " elements, not ", size));
      if (size == 0 && name.rfind("pushsum", 0) != 0 && v.size() != x_.size())
        throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), ": ", name, " has ",
                               v.size(), " elements, this run's model ", x_.size()));
      return v;
    }
  throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), " has no ", name));
}

std::vector<gossip::PushSum*> GossipCore::gossipers() {
  std::vector<gossip::PushSum*> all;
  if (push_sum_) all.push_back(&*push_sum_);
  for (auto& p : pipeline_) all.push_back(p.get());
  return all;
}

void GossipCore::load_local(const LocalState& st) {
  std::size_t next = 0;
  auto scalar = [&](const char* what) {
    if (next >= st.scalars.size())
      throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), " ends before its ", what));
    return st.scalars[next++];
  };
  const double w = scalar("weight");
  if (!(w > 0 && std::isfinite(w)))
    throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), " has a push-sum weight of ", w));
  w_ = w;
  set_x(saved_tensor(st, "x"));
  load_tensors(st);
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
      throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), " has ", count, " in-peers"));
    for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
      round.weights.push_back(scalar("in-peer weight"));
      round.shares.push_back(saved_tensor(st, str("pushsum", p, ".in", i)));
    }
    all[p]->restore(round);
  }
  if (next != st.scalars.size())
    throw InvalidInput(str("the saved ", info_.name, " state of rank ", comm_.rank(), " has ", st.scalars.size(),
                           " numbers, this run's ", next));
}

}  // namespace distopt::parallel::detail
