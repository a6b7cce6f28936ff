// Checkpoints of the gossip strategies (checkpoint/state.hpp,
// checkpoint/survival.hpp): every rank's own model and rounds in flight
// saved and resumed to the uninterrupted run's bits, another strategy or
// world starting from the ranks' mean, and survivors going on from their
// own state in memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/checkpoint/survival.hpp"
#include "distopt/comm/threads.hpp"
#include "distopt/data/dataset.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"
#include "resume_support.hpp"

using namespace distopt;
using namespace distopt::checkpoint;
using namespace distopt::resume_support;

// ---- gossip strategies: every rank's own model and rounds in flight ----

namespace {

// A gossip checkpoint as the trainer keeps it: the tensors, and each rank's
// LocalState numbers (the manifest's).
struct GossipSaved {
  std::map<std::string, Whole> wholes;
  std::vector<std::vector<double>> numbers;  // by rank
  std::uint64_t steps = 0;
};

struct GossipRun {
  std::vector<float> params;                 // the ranks' mean model
  std::vector<parallel::LocalState> locals;  // by rank, at the end
  GossipSaved saved;                         // the checkpoint at the end
};

// `steps` steps from `from` under a gossip strategy, from a checkpoint (rank
// by rank when `exact`, else from its consensus) or from the model's
// initialization; then a checkpoint.
GossipRun gossip_run(int world, const std::string& strategy, const parallel::GossipOptions& g, std::size_t from,
                     std::size_t steps, const GossipSaved* resume, bool exact = true,
                     const parallel::OptimizerSpec& spec = spec_of("adam")) {
  const data::Split& d = data_set();
  GossipRun out;
  out.locals.resize(static_cast<std::size_t>(world));
  out.saved.numbers.resize(static_cast<std::size_t>(world));
  std::vector<checkpoint::Piece> pieces;
  std::mutex m;
  spawn(world, [&](Communicator& comm) {
    auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 40, 8});
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    std::vector<float> initial(flat.elements);
    if (resume != nullptr) initial = initial_of(flat, WholeTensors(resume->wholes));
    else model->init(initial, 5);
    parallel::StrategyOptions options;
    options.gossip = g;
    auto s = parallel::make_strategy(strategy, comm, flat, initial, spec, options);
    if (resume != nullptr) {
      const std::string prefix = exact ? local_prefix(comm.rank()) : "";
      load_optimizer_state(*s, WholeTensors(resume->wholes), prefix);
      if (exact) {
        const parallel::LocalState local = checkpoint::local_state(WholeTensors(resume->wholes), comm.rank(),
                                                                   resume->steps, resume->numbers.at(comm.rank()));
        s->resume(local.steps, &local);
      } else {
        s->resume(from, nullptr);
      }
    }
    train_steps(comm, *model, *s, from, steps);
    std::vector<float> params = s->gather_params();
    std::vector<checkpoint::Piece> mine = strategy_pieces(*s, comm.rank()).copies();
    const std::optional<parallel::LocalState> local = s->local_state();
    if (local) {
      std::vector<checkpoint::Piece> extra = local_pieces(*local, comm.rank()).copies();
      mine.insert(mine.end(), extra.begin(), extra.end());
    }
    std::lock_guard lock(m);
    if (comm.rank() == 0) out.params = std::move(params);
    pieces.insert(pieces.end(), mine.begin(), mine.end());
    if (local) {
      out.locals[static_cast<std::size_t>(comm.rank())] = *local;
      out.saved.numbers[static_cast<std::size_t>(comm.rank())] = local->scalars;
    }
  });
  out.saved.wholes = assemble(pieces);
  out.saved.steps = from + steps;
  return out;
}

bool same_locals(const std::vector<parallel::LocalState>& a, const std::vector<parallel::LocalState>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t r = 0; r < a.size(); ++r) {
    if (a[r].steps != b[r].steps || a[r].scalars != b[r].scalars || a[r].tensors.size() != b[r].tensors.size())
      return false;
    for (std::size_t t = 0; t < a[r].tensors.size(); ++t)
      if (a[r].tensors[t].first != b[r].tensors[t].first || !same_bits(a[r].tensors[t].second, b[r].tensors[t].second))
        return false;
  }
  return true;
}

struct GossipCase {
  std::string name, strategy;
  parallel::GossipOptions options;
};

std::vector<GossipCase> gossip_cases() {
  std::vector<GossipCase> cases;
  cases.push_back({"sgp", "sgp", {}});
  parallel::GossipOptions g;
  g.topology = "static-exponential";  // two peers at world 3: weights of 1/3
  cases.push_back({"sgp-static-exponential", "sgp", g});
  g = {};
  g.synch_freq = 2;  // three rounds in flight between steps
  cases.push_back({"osgp-synch2", "osgp", g});
  cases.push_back({"osgp", "osgp", {}});
  cases.push_back({"dpsgd", "dpsgd", {}});
  g = {};
  g.localsgd_frequency = 3;  // steps 8 and 14 end without an average
  g.slowmo_frequency = 5;
  cases.push_back({"slowmo-localsgd", "slowmo", g});
  g.slowmo_base = "sgp";
  cases.push_back({"slowmo-sgp", "slowmo", g});
  g = {};
  g.sync_every = 5;  // saved at 8, mid-cycle, after the outer step of 5 (momentum)
  cases.push_back({"diloco", "diloco", g});
  g.outer_optimizer = "adam";
  g.outer_lr = 0.01;
  cases.push_back({"diloco-outer-adam", "diloco", g});
  g.outer_optimizer = "lamb";  // its bias corrections count the outer steps
  cases.push_back({"diloco-outer-lamb", "diloco", g});
  g = {};
  // Streaming, 2 fragments of the 4 layers, H = 4, tau = 2: fragment 0
  // syncs at 2, 6, 10 (applied at 4, 8, 12), fragment 1 at 4, 8, 12
  // (applied at 6, 10, 14): saved at 8 with fragment 1's average in flight.
  g.sync_every = 4;
  g.fragments = 2;
  g.sync_delay = 2;
  g.fragment_alpha = 0.5;
  cases.push_back({"diloco-streaming", "diloco", g});
  // The rank's values at the sync step travel with the average in flight.
  g.fragment_carry = true;
  cases.push_back({"diloco-streaming-carry", "diloco", g});
  g.fragment_carry = false;
  // int4 pseudo-gradients with error feedback (the carried error is state).
  g.outer_dtype = "int4";
  g.outer_error_feedback = true;
  cases.push_back({"diloco-streaming-int4", "diloco", g});
  return cases;
}

}  // namespace

TEST(GossipResume, SavedAndResumedAtTheSameWorldIsTheUninterruptedRun) {
  // Every rank's model, weight, optimizer state and rounds in flight: the
  // resumed run ends with the uninterrupted one's bits on every rank.
  for (const GossipCase& c : gossip_cases()) {
    for (const int world : {3, 4}) {
      if (c.strategy == "dpsgd" && world % 2 == 1) continue;  // bipartite graphs need even worlds
      SCOPED_TRACE(c.name + " at " + std::to_string(world));
      const GossipRun straight = gossip_run(world, c.strategy, c.options, 0, 14, nullptr);
      const GossipRun first = gossip_run(world, c.strategy, c.options, 0, 8, nullptr);
      const GossipRun resumed = gossip_run(world, c.strategy, c.options, 8, 6, &first.saved);
      EXPECT_TRUE(same_bits(resumed.params, straight.params));
      EXPECT_TRUE(same_locals(resumed.locals, straight.locals));
      EXPECT_FALSE(same_bits(first.params, straight.params)) << "the last 6 steps must change something";
      if (c.name.starts_with("diloco-streaming")) {  // saved with fragment 1's average in flight
        bool in_flight = false;
        bool at_sync = false;
        for (const auto& [name, values] : first.locals[0].tensors) {
          in_flight = in_flight || name == "diloco_flight.1";
          at_sync = at_sync || name == "diloco_flight_at_sync.1";
        }
        EXPECT_TRUE(in_flight);
        EXPECT_EQ(at_sync, c.options.fragment_carry);
      }
      // The ranks' models differ (it is gossip, not an all-reduce).
      EXPECT_FALSE(same_bits(straight.locals[0].tensors[0].second, straight.locals[1].tensors[0].second));
      // Saving right after loading gives back every tensor.
      const GossipRun again = gossip_run(world, c.strategy, c.options, 8, 0, &first.saved);
      EXPECT_TRUE(same_locals(again.locals, first.locals));
      for (const auto& [name, whole] : first.saved.wholes)
        EXPECT_TRUE(same_bits(again.saved.wholes.at(name).values, whole.values)) << name;
    }
  }
}

TEST(GossipResume, AnotherStrategyOrWorldStartsFromTheRanksMeanModelAndOptimizerState) {
  const GossipRun saved = gossip_run(4, "sgp", {}, 0, 8, nullptr);
  // The consensus tensors are the mean of the ranks' own ones.
  const auto& w0 = saved.saved.wholes.at("gossip.0.state.0.exp_avg").values;
  const auto& mean = saved.saved.wholes.at("state.0.exp_avg").values;
  double sum0 = 0;
  for (int r = 0; r < 4; ++r) sum0 += saved.saved.wholes.at(str("gossip.", r, ".state.0.exp_avg")).values[0];
  EXPECT_FLOAT_EQ(mean[0], static_cast<float>(sum0 / 4));
  EXPECT_FALSE(same_bits(w0, mean));
  // ddp@3 and zero3@3 from it: the same bits, and saving right after the
  // load gives back the consensus.
  GossipSaved as_ddp = saved.saved;
  const RunResult dd = run(3, "ddp", spec_of("adam"), 8, 6, &as_ddp.wholes);
  const RunResult z3 = run(3, "zero3", spec_of("adam"), 8, 6, &as_ddp.wholes);
  EXPECT_TRUE(same_bits(dd.params, z3.params));
  const auto reloaded = assemble(run(3, "zero3", spec_of("adam"), 8, 0, &as_ddp.wholes).pieces);
  for (const auto& [name, whole] : reloaded)
    EXPECT_TRUE(same_bits(whole.values, saved.saved.wholes.at(name).values)) << name;
  // Another gossip strategy or world size: every rank starts from the
  // consensus, and the ranks' models then drift apart again.
  const GossipRun other = gossip_run(2, "dpsgd", {}, 8, 0, &saved.saved, /*exact=*/false);
  EXPECT_TRUE(same_bits(other.locals[0].tensors[0].second, other.locals[1].tensors[0].second));
  EXPECT_TRUE(same_bits(other.params, gossip_run(4, "osgp", {}, 8, 0, &saved.saved, false).params));
  const GossipRun on = gossip_run(2, "dpsgd", {}, 8, 4, &saved.saved, false);
  EXPECT_FALSE(same_bits(on.locals[0].tensors[0].second, on.locals[1].tensors[0].second));
}

TEST(GossipResume, AdpsgdResumesItsRanksAfterEveryAllowedRound) {
  // adpsgd's bits depend on timing: the checkpoint waits for every round
  // allowed, and a resumed run picks the partners' schedule up at its step.
  const GossipRun first = gossip_run(4, "adpsgd", {}, 0, 6, nullptr);
  const GossipRun again = gossip_run(4, "adpsgd", {}, 6, 0, &first.saved);
  EXPECT_TRUE(same_locals(again.locals, first.locals));
  const GossipRun on = gossip_run(4, "adpsgd", {}, 6, 6, &first.saved);
  for (float v : on.params) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(on.locals[0].steps, 12u);
}

TEST(GossipResume, ASavedStateThatDoesNotFitIsOneLine) {
  const GossipRun first = gossip_run(4, "osgp", {}, 0, 3, nullptr);
  auto error_of = [&](const GossipSaved& saved) -> std::string {
    try {
      (void)gossip_run(4, "osgp", {}, 3, 1, &saved);
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      return m;
    }
    return "";
  };
  GossipSaved fewer = first.saved;
  fewer.numbers[2].pop_back();
  EXPECT_NE(error_of(fewer).find("the saved osgp state of rank 2 ends before"), std::string::npos) << error_of(fewer);
  GossipSaved short_x = first.saved;
  short_x.wholes["gossip.1.x"].values.pop_back();
  short_x.wholes["gossip.1.x"].shape = {std::int64_t(short_x.wholes["gossip.1.x"].values.size())};
  EXPECT_NE(error_of(short_x).find("the saved osgp state of rank 1: x has"), std::string::npos) << error_of(short_x);
  GossipSaved weightless = first.saved;
  weightless.numbers[0][0] = -1;
  EXPECT_NE(error_of(weightless).find("has a push-sum weight of -1"), std::string::npos) << error_of(weightless);
  GossipSaved no_rank = first.saved;
  for (auto it = no_rank.wholes.begin(); it != no_rank.wholes.end();)
    it = it->first.rfind("gossip.3.", 0) == 0 ? no_rank.wholes.erase(it) : std::next(it);
  EXPECT_NE(error_of(no_rank).find("the checkpoint has no"), std::string::npos) << error_of(no_rank);
}

// ---- gossip survivors: each rank goes on from its own state in memory ----

namespace {

// `at` steps under a gossip strategy, each rank's survivor_state() (which
// takes no communication, so no rank need fail) passed to `tamper`, kept
// as the trainer keeps it (survivor_pieces, one rank's tensors) and
// resumed by the ranks `keep` (all when empty) at a world of their number;
// then `steps` more. `captured`, when given, receives the states taken.
GossipRun survivors_run(int world, const std::string& strategy, const parallel::GossipOptions& g, std::size_t at,
                        std::size_t steps, const std::function<void(int, parallel::LocalState&)>& tamper,
                        std::vector<int> keep = {}, std::vector<parallel::LocalState>* captured = nullptr,
                        bool complete_in_flight = false) {
  const data::Split& d = data_set();
  if (keep.empty())
    for (int r = 0; r < world; ++r) keep.push_back(r);
  const int after = static_cast<int>(keep.size());
  std::vector<std::map<std::string, Whole>> wholes(static_cast<std::size_t>(after));
  std::vector<std::vector<double>> numbers(static_cast<std::size_t>(after));
  if (captured != nullptr) captured->assign(static_cast<std::size_t>(after), {});
  parallel::StrategyOptions options;
  options.gossip = g;
  spawn(world, [&](Communicator& comm) {
    auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 40, 8});
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    std::vector<float> initial(flat.elements);
    model->init(initial, 5);
    auto s = parallel::make_strategy(strategy, comm, flat, initial, spec_of("adam"), options);
    train_steps(comm, *model, *s, 0, at);
    if (complete_in_flight) s->complete_in_flight();  // (as before a join)
    std::optional<parallel::LocalState> local = s->survivor_state();
    ASSERT_TRUE(local.has_value());
    EXPECT_TRUE(local->survivor);
    tamper(comm.rank(), *local);
    const auto it = std::find(keep.begin(), keep.end(), comm.rank());
    if (it != keep.end()) {
      const auto r = static_cast<std::size_t>(it - keep.begin());  // its rank among the survivors
      wholes[r] = assemble(survivor_pieces(*s, static_cast<int>(r), *local, {}).copies());
      numbers[r] = local->scalars;
      if (captured != nullptr) (*captured)[r] = *local;
    }
    comm.barrier();  // (no rank's rounds in flight end before every rank took its state)
  });
  GossipRun out;
  out.locals.resize(static_cast<std::size_t>(after));
  out.saved.numbers.resize(static_cast<std::size_t>(after));  // (the survivor_state() at the end)
  std::vector<parallel::LocalState> ends(static_cast<std::size_t>(after));
  std::mutex m;
  spawn(after, [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 40, 8});
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    const WholeTensors saved(wholes[r]);
    auto s = parallel::make_strategy(strategy, comm, flat, initial_params(flat, saved), spec_of("adam"), options);
    load_optimizer_state(*s, saved, local_prefix(comm.rank()));
    parallel::LocalState local = checkpoint::local_state(saved, comm.rank(), at, numbers[r]);
    local.survivor = true;
    s->resume(at, &local);
    train_steps(comm, *model, *s, at, steps);
    std::vector<float> params = s->gather_params();
    const std::optional<parallel::LocalState> end = s->local_state();
    const std::optional<parallel::LocalState> survivor = s->survivor_state();
    std::lock_guard lock(m);
    if (comm.rank() == 0) out.params = std::move(params);
    out.locals[r] = *end;
    if (captured != nullptr) ends[r] = *survivor;
  });
  if (captured != nullptr) captured->insert(captured->end(), ends.begin(), ends.end());
  return out;
}

std::vector<float>& tensor(parallel::LocalState& st, const std::string& name) {
  for (auto& [n, values] : st.tensors)
    if (n == name) return values;
  throw InvalidInput("no tensor " + name);
}

}  // namespace

TEST(GossipSurvivors, TheirStatesResumedAtTheSameWorldAreTheUninterruptedRun) {
  // Where no round is in flight and the weights are 1 (local SGD between
  // averages, DiLoCo mid-cycle), a survivor's state is all of it: model,
  // optimizer state, the outer state and the carried error, in the model's
  // flat layout.
  for (const GossipCase& c : gossip_cases()) {
    if (c.name != "slowmo-localsgd" && !c.name.starts_with("diloco")) continue;
    // Streaming: an average in flight at 8, which a survivor of a loss
    // drops; before a join it lands first and is kept (complete_in_flight).
    const bool in_flight = c.name.starts_with("diloco-streaming");
    for (const int world : {3, 4}) {
      SCOPED_TRACE(c.name + " at " + std::to_string(world));
      const GossipRun straight = gossip_run(world, c.strategy, c.options, 0, 14, nullptr);
      const GossipRun survivors = survivors_run(
          world, c.strategy, c.options, 8, 6, [](int, parallel::LocalState&) {}, {}, nullptr, in_flight);
      EXPECT_TRUE(same_bits(survivors.params, straight.params));
      EXPECT_TRUE(same_locals(survivors.locals, straight.locals));
    }
  }
}

TEST(GossipSurvivors, OneBehindAnOuterStepTakesTheSharedStateOfTheOneAhead) {
  // After the outer step of step 5 every replica is the synced model. Rank
  // 1's state is made that of a rank whose sync failed (one outer step
  // fewer, another synced model, outer state and model): the survivors'
  // agreement gives it rank 0's, and the run goes on as the uninterrupted one.
  parallel::GossipOptions diloco;
  diloco.sync_every = 5;
  parallel::GossipOptions slowmo;
  slowmo.localsgd_frequency = 3;
  slowmo.slowmo_frequency = 5;
  for (const auto& [strategy, g, counter, shared] :
       {std::tuple{"diloco", diloco, "diloco_applied",
                   std::vector<std::string>{"diloco_start", "outer.0.momentum_buffer"}},
        std::tuple{"slowmo", slowmo, "slowmo_outer", std::vector<std::string>{"slow_x", "slow_u"}}}) {
    SCOPED_TRACE(strategy);
    const GossipRun straight = gossip_run(3, strategy, g, 0, 11, nullptr);
    const auto behind = [&](int rank, parallel::LocalState& st) {
      if (rank != 1) return;
      tensor(st, counter)[0] -= 1;
      for (const std::string& name : shared)
        for (float& v : tensor(st, name)) v += 0.25f;
      for (float& v : tensor(st, "x")) v -= 0.5f;
    };
    const GossipRun survivors = survivors_run(3, strategy, g, 5, 6, behind);
    EXPECT_TRUE(same_bits(survivors.params, straight.params));
    EXPECT_TRUE(same_locals(survivors.locals, straight.locals));
    // Without the agreement (every rank tampered alike: no one is ahead), the run differs.
    const GossipRun all = survivors_run(3, strategy, g, 5, 6, [&](int, parallel::LocalState& st) { behind(1, st); });
    EXPECT_FALSE(same_bits(all.params, straight.params));
  }
}

// ---- --memory-checkpoint: each rank's file and its neighbour's, in memory ----

TEST(MemoryCheckpoint, SurvivorsRestoreTheWholeCheckpointUnlessTwoNeighboursWereLost) {
  // zero2 at 4 ranks after 5 steps: every rank keeps its file and rank
  // r - 1's. (The CLI tests compare zero1-3 with one reference: a resumed
  // run's bits do not depend on the strategy, Resume.OneCheckpointAt...) The survivors {0, 2} (and, in a group of their
  // own, {1, 3}) restore every tensor of the checkpoint save() would write, bit for bit; {0, 3} lost 1 and 2,
  // neighbours, so rank 1's file is gone.
  const data::Split& d = data_set();
  std::vector<checkpoint::Piece> pieces;
  std::map<std::string, Whole> restored[2], restored_older;
  int restored_none = 0;
  std::mutex m;
  spawn(4, [&](Communicator& comm) {
    auto model = models::make_model("mlp", d.train.features, d.train.classes, {24, 40, 8});
    const parallel::FlatLayout flat = parallel::flat_layout(*model);
    std::vector<float> initial(flat.elements);
    model->init(initial, 5);
    parallel::StrategyOptions options;
    options.bucket_elements = 300;
    auto s = parallel::make_strategy("zero2", comm, flat, initial, spec_of("adam"), options);
    train_steps(comm, *model, *s, 0, 5);
    const RunInfo info{"zero2", "mlp", "adam", {}, R"({"k": 1})"};
    const RunParts parts{&s->optimizer(), nullptr, nullptr, nullptr, nullptr};
    const InMemory kept = keep_in_memory(comm, *s, info, parts, 5);
    EXPECT_EQ(kept.step, 5u);
    EXPECT_FALSE(kept.buddy.empty());
    {
      std::vector<checkpoint::Piece> mine = strategy_pieces(*s, comm.rank()).copies();
      std::lock_guard lock(m);
      pieces.insert(pieces.end(), mine.begin(), mine.end());
    }
    // Two groups of survivors: even ranks and odd ones.
    std::unique_ptr<Communicator> alternate = comm.split(comm.rank() % 2, comm.rank());
    std::optional<Loaded> back = restore_from_memory(*alternate, std::span(&kept, 1));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(back->step, 5u);
    EXPECT_EQ(back->config, R"({"k": 1})");
    // Neighbours lost: survivors {0, 3} (and {1, 2}).
    std::unique_ptr<Communicator> ends = comm.split(comm.rank() == 0 || comm.rank() == 3 ? 0 : 1, comm.rank());
    std::optional<Loaded> none = restore_from_memory(*ends, std::span(&kept, 1));
    // A survivor that keeps nothing (rank 2): no step all keep.
    std::optional<Loaded> empty =
        restore_from_memory(*alternate, comm.rank() == 2 ? std::span<const InMemory>() : std::span(&kept, 1));
    // One more step and checkpoint, which rank 2 did not finish keeping
    // (its exchange cut short): the even ranks take step 5, kept by both.
    train_steps(comm, *model, *s, 5, 1);
    const InMemory newer = keep_in_memory(comm, *s, info, parts, 6);
    const InMemory both[2] = {newer, kept};
    std::optional<Loaded> older =
        restore_from_memory(*alternate, comm.rank() == 2 ? std::span(both + 1, 1) : std::span(both, 2));
    ASSERT_TRUE(older.has_value());
    EXPECT_EQ(older->step, comm.rank() % 2 == 0 ? 5u : 6u);
    std::lock_guard lock(m);
    if (comm.rank() < 2) restored[comm.rank()] = std::move(back->wholes);
    if (comm.rank() == 0) restored_older = std::move(older->wholes);
    restored_none += none.has_value() ? 0 : 1;
    EXPECT_EQ(empty.has_value(), comm.rank() % 2 == 1);  // (only the even ranks' group lacks a rank's)
  });
  const std::map<std::string, Whole> whole = assemble(pieces);
  for (const auto* r_ : {&restored[0], &restored[1], &restored_older}) {
    const auto& r = *r_;
    ASSERT_EQ(r.size(), whole.size());
    for (const auto& [name, w] : whole) {
      ASSERT_TRUE(r.count(name)) << name;
      EXPECT_TRUE(same_bits(r.at(name).values, w.values)) << name;
      EXPECT_EQ(r.at(name).shape, w.shape) << name;
    }
  }
  EXPECT_EQ(restored_none, 4);
}

TEST(GossipSurvivors, TheirStatesGoOnAtASmallerWorldAsTheyWere) {
  // Survivors 0, 1 and 3 of 4 resume at 3 ranks, where the model is padded
  // differently (units of 504 elements: 512 at 4 ranks, 528 at 3): each
  // one's state, taken again right after, is the one it kept, bit for bit
  // (its model, dpsgd's next x, slowmo's and diloco's shared state, the
  // carried error, the optimizer and outer state).
  std::vector<GossipCase> cases = gossip_cases();
  parallel::GossipOptions ring;
  ring.topology = "ring";
  cases.push_back({"dpsgd-ring", "dpsgd", ring});
  for (const GossipCase& c : cases) {
    if (c.name == "dpsgd") continue;  // (bipartite: no graph at 3 ranks)
    SCOPED_TRACE(c.name);
    std::vector<parallel::LocalState> states;
    (void)survivors_run(
        4, c.strategy, c.options, 8, 0, [](int, parallel::LocalState&) {}, {0, 1, 3}, &states);
    ASSERT_EQ(states.size(), 6u);
    for (std::size_t r = 0; r < 3; ++r) {
      const parallel::LocalState &kept = states[r], &again = states[3 + r];
      EXPECT_EQ(again.steps, kept.steps);
      EXPECT_EQ(again.scalars, kept.scalars);
      ASSERT_EQ(again.tensors.size(), kept.tensors.size());
      for (std::size_t t = 0; t < kept.tensors.size(); ++t) {
        EXPECT_EQ(again.tensors[t].first, kept.tensors[t].first);
        EXPECT_TRUE(same_bits(again.tensors[t].second, kept.tensors[t].second)) << kept.tensors[t].first;
      }
    }
  }
}
