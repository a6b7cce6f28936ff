// Re-forming a run's world: see membership.hpp.
#include "membership.hpp"

#include <algorithm>

#include "distopt/checkpoint/store.hpp"
#include "distopt/core/error.hpp"

namespace distopt::train::membership {

Interruption joining() {
  Interruption lost{std::nullopt, "joined a running run", Clock::now(), 0, {}};
  lost.joins = -1;
  return lost;
}

Interruption lost_in_setup(const RankLost& e, const TrainConfig& config, const parallel::StrategyInfo& info) {
  const std::size_t at = config.resume ? static_cast<std::size_t>(config.resume->step) : 0;
  Interruption lost{config.resume ? std::optional<checkpoint::Loaded>(*config.resume) : std::nullopt, e.what(),
                    Clock::now(), at, {}};
  if (!config.resume) lost.state.emplace();  // a fresh start: nothing to load
  // A sharded run's ranks look for the last checkpoint together, as
  // the ranks that trained do.
  if (!info.replicated_params) lost.state.reset();
  return lost;
}

Resumption reform(World& world, Interruption lost, const TrainConfig& config, const parallel::StrategyInfo& info) {
  const bool replicated = info.replicated_params && !info.per_rank_models;
  const int before = world.comm->size(), rank_before = lost.joins < 0 ? -1 : world.comm->rank();
  std::int64_t from = 0;
  std::vector<std::int64_t> all, ranks_before;  // each rank's step to go on from, and its rank before (-1: new)
  bool from_memory = false;  // lost.state is the survivors' checkpoint kept in memory
  for (;;) {  // re-form (grow, or shrink); shrink again if ranks are lost meanwhile
    try {
      if (lost.joins >= 0) {
        std::unique_ptr<Communicator> next =
            lost.joins > 0 ? world.comm->grow(lost.joins) : world.comm->shrink();
        world.owned = std::move(next);
        world.comm = world.owned.get();
      }
      // A replica's state, from rank `src` to every rank that has none or
      // an older one (`take`).
      const auto share = [&](int src, bool take) {
        std::vector<char> bytes = world.comm->rank() == src ? checkpoint::to_bytes(*lost.state) : std::vector<char>();
        world.comm->broadcast_bytes(bytes, src);
        if (take) lost.state = checkpoint::from_bytes(bytes);
      };
      // Whether the group admitted new ranks (a re-forming admits none
      // where a rank was lost, though some ranks asked it to grow).
      const std::int64_t was = rank_before;
      ranks_before.assign(static_cast<std::size_t>(world.comm->size()), 0);
      world.comm->all_gather(&was, ranks_before.data(), 1, ElemType::i64);
      const bool admitted = std::find(ranks_before.begin(), ranks_before.end(), -1) != ranks_before.end();
      if (lost.joins > 0 && !admitted && world.comm->size() < before)
        lost.what = str("a rank was lost in the step that was to admit ", lost.joins,
                        " new rank(s); they wait for the next that can");
      if (admitted && (replicated || info.per_rank_models)) {
        share(0, !lost.state);  // the new ranks take rank 0's state; the others have their own
      } else if (!lost.state) {
        // Back to the last checkpoint kept in memory (--memory-checkpoint),
        if (config.memory_checkpoint) {
          if (auto m = checkpoint::restore_from_memory(*world.comm, lost.memory, rank_before < 0)) {
            lost.state = std::move(*m);
            from_memory = true;
          }
        }
      }
      if (!lost.state) {
        // or to the last complete one on disk, read once every survivor
        // has left the collective it was in (rank 0 may have been writing
        // or pruning one).
        world.comm->barrier();
        if (checkpoint::latest_complete(config.checkpoint_dir))
          lost.state = checkpoint::load_latest(config.checkpoint_dir);
        else if (rank_before < 0)
          throw CommError(str("a rank of the run was lost while this process joined it, and the checkpoint it was ",
                              "to take went with it: start it again"));
        else if (config.resume)
          lost.state = *config.resume;  // none written since the run resumed: from where it resumed
        else
          lost.state.emplace();  // none written yet: the run starts again
      }
      // The ranks' states are of one kind: a rank lost while some ranks
      // were still setting a segment up and others training leaves the
      // first with the segment's starting state and the others with
      // their own (gossip). Then all go on from where the segment started.
      {
        const std::int64_t kind = checkpoint::is_survivors_state(*lost.state) ? 1 : 0;
        std::vector<std::int64_t> kinds(static_cast<std::size_t>(world.comm->size()));
        world.comm->all_gather(&kind, kinds.data(), 1, ElemType::i64);
        if (std::any_of(kinds.begin(), kinds.end(), [&](std::int64_t k) { return k != kinds[0]; })) {
          if (rank_before < 0)
            throw CommError("a rank of the run was lost while this process joined it, and the others go back to "
                            "where they started: start it again");
          if (config.resume)
            lost.state = *config.resume;
          else
            lost.state.emplace();
        }
      }
      // The ranks agree on the step they go on from (a commit vote). A
      // lost process may have delivered a step's last messages to some
      // ranks and not to others: those completed the step, these did not.
      // The step counts as done by all: under ddp the first rank that
      // completed it sends its replica to the others (replicas of one
      // step are identical). Sharded runs read one checkpoint (on disk or
      // kept in memory); gossip and diloco ones take the greater step.
      from = static_cast<std::int64_t>(lost.state->step);
      all.assign(static_cast<std::size_t>(world.comm->size()), 0);
      world.comm->all_gather(&from, all.data(), 1, ElemType::i64);
      std::int64_t most = from;
      int src = world.comm->rank();
      for (int r = world.comm->size() - 1; r >= 0; --r)
        if (all[static_cast<std::size_t>(r)] >= most) {
          most = all[static_cast<std::size_t>(r)];
          src = r;
        }
      bool behind = false;
      for (int r = 0; r < world.comm->size(); ++r) behind = behind || all[static_cast<std::size_t>(r)] != most;
      if (behind && replicated) {
        share(src, from != most);
      } else if (checkpoint::is_survivors_state(*lost.state)) {
        // Gossip survivors: each goes on from its own model, in step
        // with the one ahead, whose run state (schedulers, scaler) all take.
        std::string run_state = lost.state->state;
        if (behind) world.comm->broadcast_bytes(run_state, src);
        checkpoint::rebase_survivor(*lost.state, world.comm->rank(), world.comm->size(), static_cast<std::uint64_t>(most), run_state);
      }
      if (behind) {
        from = most;
        std::fill(all.begin(), all.end(), most);
      }
      break;
    } catch (const RankLost&) {
      if (rank_before < 0 && !lost.state)
        throw CommError("a rank of the run was lost while this process joined it, before it had the run's state: "
                        "start it again");
      lost.joins = 0;  // the ones still there re-form without the lost
      if (lost.state && (!lost.state->dir.empty() || from_memory)) lost.state.reset();  // again in the new group
      from_memory = false;
    }
  }
  MembershipChange change;
  change.step = static_cast<std::size_t>(from);
  change.steps_redone = lost.done > change.step ? lost.done - change.step : 0;
  change.world = world.comm->size();
  std::vector<char> alive(static_cast<std::size_t>(std::max(before, 0)), 0);
  for (int r = 0; r < world.comm->size(); ++r) {
    if (all[static_cast<std::size_t>(r)] != from)
      throw CommError(str("the ranks of a changed world disagree on the step to go on from: ", from, " here, ",
                          all[static_cast<std::size_t>(r)], " on rank ", r));
    const std::int64_t old = ranks_before[static_cast<std::size_t>(r)];
    if (old < 0)
      change.joined.push_back(r);
    else if (old < before)
      alive[static_cast<std::size_t>(old)] = 1;
  }
  if (rank_before < 0) {
    change.world_before = world.comm->size() - static_cast<int>(change.joined.size());
  } else {
    change.world_before = before;
    for (int r = 0; r < before; ++r)
      if (!alive[static_cast<std::size_t>(r)]) change.lost.push_back(r);
  }
  change.reason = lost.what;
  // A fresh start (a loss before any step of a new run) has nothing to load.
  Resumption out;
  if (!(from == 0 && !lost.state->has_tensors()))
    out.resume = std::make_shared<const checkpoint::Loaded>(std::move(*lost.state));
  change.seconds = seconds_since(lost.since);
  out.change = std::move(change);
  return out;
}

}  // namespace distopt::train::membership
