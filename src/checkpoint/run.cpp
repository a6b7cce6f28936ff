// A training run's checkpoints: the collective save, and resuming from the
// latest complete one (include/distopt/checkpoint/run.hpp).
#include "distopt/checkpoint/run.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "distopt/checkpoint/run_state.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/checkpoint/survival.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fault.hpp"
#include "json_read.hpp"
#include "run_internal.hpp"

namespace distopt::checkpoint {

namespace {

// Whether a gossip checkpoint's ranks go on one by one in this run.
bool same_gossip_run(const RunState::Gossip& saved, const RunInfo& run, int world) {
  return saved.strategy == run.strategy && saved.world == world && saved.options == run.gossip;
}

}  // namespace

namespace detail {

// Every rank's LocalState numbers, gathered (collective): [steps, numbers...] per rank.
std::vector<RunState::Gossip::Rank> gather_local_numbers(Communicator& comm, const parallel::LocalState& local) {
  std::vector<double> mine{static_cast<double>(local.steps)};
  mine.insert(mine.end(), local.scalars.begin(), local.scalars.end());
  const auto n = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&n, counts.data(), 1, ElemType::i64);
  std::vector<std::size_t> sizes(counts.begin(), counts.end());
  std::size_t total = 0;
  for (std::size_t c : sizes) total += c;
  std::vector<double> all(total);
  comm.all_gather_v(mine.data(), all.data(), sizes, ElemType::f64);
  std::vector<RunState::Gossip::Rank> out;
  std::size_t at = 0;
  for (std::size_t c : sizes) {
    out.push_back({static_cast<std::uint64_t>(all.at(at)),
                   std::vector<double>(all.begin() + static_cast<std::ptrdiff_t>(at + 1),
                                       all.begin() + static_cast<std::ptrdiff_t>(at + c))});
    at += c;
  }
  return out;
}

// The state the manifest keeps besides the tensors.
RunState state_of(const RunParts& parts) {
  RunState s;
  if (parts.optimizer != nullptr) s.groups = groups_of(*parts.optimizer);
  if (parts.scheduler != nullptr) s.scheduler = parts.scheduler->state_dict();
  if (parts.scaler != nullptr) s.scaler = parts.scaler->state_dict();
  if (parts.averaged != nullptr && parts.averaged->n_averaged() > 0) s.n_averaged = parts.averaged->n_averaged();
  if (parts.swa_scheduler != nullptr) s.swa_scheduler = parts.swa_scheduler->state_dict();
  return s;
}

// Rank `rank`'s pieces of the strategy's state and of the averages (cut
// like the parameters): a rank file's tensors, less a gossip rank's own.
PieceSet rank_pieces(parallel::Strategy& strategy, int rank, const RunParts& parts) {
  PieceSet pieces = strategy_pieces(strategy, rank);
  if (parts.averaged != nullptr && parts.averaged->n_averaged() > 0)
    pieces.append(own_pieces(strategy, rank, parts.averaged->params(), "avg."));
  return pieces;
}

}  // namespace detail

using detail::gather_local_numbers;
using detail::rank_pieces;
using detail::state_of;

std::uint64_t save(Communicator& comm, parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                   const SaveOptions& options, std::uint64_t step, int epoch) {
  namespace fs = std::filesystem;
  const fs::path dir = checkpoint_dir(options.root, step);
  std::int64_t ok = 1;
  std::string failure;
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir, ec);  // an interrupted write of this very step
    fs::create_directories(dir, ec);
    if (ec) {
      ok = 0;
      failure = str(dir.string(), ": cannot create the checkpoint directory: ", ec.message());
    }
  }
  comm.broadcast(&ok, 1, ElemType::i64, 0);
  if (ok == 0) throw IoError(failure.empty() ? str(dir.string(), ": rank 0 could not create it") : failure);
  // Each rank's file; a failure on any rank fails the checkpoint on all.
  FileEntry mine;
  const std::string name = str("rank", comm.rank(), ".safetensors");
  // The collective parts first (gossip: the consensus, the rounds in flight).
  // The pieces are views of the live parameters and optimizer state: the
  // file is streamed from them, never assembled in memory.
  PieceSet pieces = rank_pieces(strategy, comm.rank(), parts);
  pieces.append(feedback_pieces(strategy, comm.rank()));  // this rank's own (not in a survivor's capture)
  const std::optional<parallel::LocalState> local = strategy.local_state();
  std::vector<RunState::Gossip::Rank> ranks;
  if (local) {
    pieces.append(local_pieces(*local, comm.rank()));
    ranks = gather_local_numbers(comm, *local);
  }
  try {
    // DISTOPT_FAULT exit:RANK:STEP:POINT (core/fault.hpp): this rank ends
    // the process while writing, with half of its file written under the
    // temporary name, or with its file in place and no manifest.
    const Fault fault = fault_from_env();
    const bool dies = fault.exits_in_checkpoint(comm.rank(), step);
    if (dies && fault.in_file) {
      // Half the file under its temporary name, as a write cut short leaves it.
      const std::vector<std::byte> bytes = pieces_bytes(pieces);
      std::FILE* f = std::fopen((dir / (name + ".tmp." + std::to_string(::getpid()))).c_str(), "wb");
      if (f != nullptr) std::fwrite(bytes.data(), 1, bytes.size() / 2, f), std::fclose(f);
      std::_Exit(137);
    }
    FileWriter file(dir, name);
    write_pieces(pieces, [&](std::span<const std::byte> b) { file.write(b); });
    mine = file.commit();
    if (dies && !fault.in_file) std::_Exit(137);  // the file in place, no manifest
  } catch (const Error& e) {
    ok = 0;
    failure = e.what();
  }
  const std::int64_t written[3] = {ok, static_cast<std::int64_t>(mine.bytes), static_cast<std::int64_t>(mine.xxh64)};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(written, all.data(), 3, ElemType::i64);
  for (int r = 0; r < comm.size(); ++r)
    if (all[3 * static_cast<std::size_t>(r)] == 0)
      throw IoError(r == comm.rank() ? failure : str("checkpoint of step ", step, ": rank ", r, " could not write its file"));
  if (comm.rank() == 0) {
    Manifest m;
    m.step = step;
    RunState state = state_of(parts);
    if (local) state.gossip = RunState::Gossip{run.strategy, comm.size(), run.gossip, std::move(ranks)};
    nlohmann::ordered_json body;
    body["step"] = step;
    body["epoch"] = epoch;
    body["world"] = comm.size();
    body["strategy"] = run.strategy;
    body["model"] = run.model;
    body["optimizer"] = run.optimizer;
    body["param_order"] = nlohmann::ordered_json::array();  // the model's order (param_hash's)
    for (const ParamSlot& p : strategy.layout().params()) body["param_order"].push_back(p.name);
    body["config"] = nlohmann::ordered_json::parse(run.config);
    body["state"] = nlohmann::ordered_json::parse(run_state_json(state));
    m.body = body.dump();
    for (int r = 0; r < comm.size(); ++r) {
      const auto* v = all.data() + 3 * static_cast<std::size_t>(r);
      m.files.push_back({str("rank", r, ".safetensors"), static_cast<std::uint64_t>(v[1]), static_cast<std::uint64_t>(v[2])});
    }
    write_manifest(dir, m);
    (void)prune(options.root, options.keep, step);
  }
  comm.barrier();
  std::uint64_t bytes = 0;
  for (int r = 0; r < comm.size(); ++r) bytes += static_cast<std::uint64_t>(all[3 * static_cast<std::size_t>(r) + 1]);
  return bytes;
}

Loaded load_latest(const std::filesystem::path& root) {
  const auto latest = latest_complete(root);
  if (!latest) throw InvalidInput(str("--resume: no complete checkpoint in ", root.string()));
  const Manifest m = verify(*latest);
  const nlohmann::json body = nlohmann::json::parse(m.body, nullptr, false);
  const nlohmann::json& config = detail::member(body, "config");
  if (!config.is_object())
    throw InvalidInput(str("checkpoint ", latest->string(), ": manifest.json carries no run configuration"));
  Loaded l;
  l.dir = *latest;
  l.step = m.step;
  l.config = config.dump();
  if (body.contains("state")) l.state = detail::member(body, "state").dump();
  if (is_survivors_state(l))  // (kept in memory only)
    throw InvalidInput(str("checkpoint ", latest->string(), ": its manifest holds a survivor's state in memory"));
  l.files = std::make_shared<const PieceFiles>(*latest, m);
  return l;
}

std::string resume(Communicator& comm, parallel::Strategy& strategy, const Loaded& from, const RunInfo& run,
                   const RunParts& parts, const std::function<Scheduler&()>& start_swa) {
  const RunState st = parse_run_state(from.state);
  std::string warning;
  // A gossip checkpoint goes on rank by rank in a run of the same strategy,
  // world size and gossip options; anything else starts from its consensus.
  std::string prefix;
  if (st.gossip) {
    if (same_gossip_run(*st.gossip, run, comm.size()))
      prefix = local_prefix(comm.rank());
    else
      warning = str("resuming the ", st.gossip->strategy, " checkpoint of ", st.gossip->world, " ranks as ", run.strategy,
                    " at ", comm.size(),
                    " (or with other gossip options): every rank starts from the ranks' mean model and optimizer state");
  }
  const LoadedTensors tensors(from);
  load_optimizer_state(strategy, tensors, prefix);
  if (std::string w = load_feedback(strategy, tensors, comm.rank(), comm.size()); !w.empty())
    warning = warning.empty() ? w : warning + "; " + w;
  if (!prefix.empty()) {
    const auto me = static_cast<std::size_t>(comm.rank());
    if (me >= st.gossip->ranks.size()) throw InvalidInput(str("checkpoint manifest: no gossip state for rank ", comm.rank()));
    const RunState::Gossip::Rank& r = st.gossip->ranks[me];
    parallel::LocalState local = local_state(tensors, comm.rank(), r.steps, r.numbers);
    local.survivor = st.gossip->survivors;
    strategy.resume(local.steps, &local);
  } else {
    strategy.resume(from.step, nullptr);
  }
  // The scheduler's and the scaler's state, then the groups' options as
  // they were (the lr the scheduler had set).
  if ((parts.scheduler != nullptr) != st.scheduler.has_value())
    throw InvalidInput(parts.scheduler != nullptr
                           ? "--resume: the checkpoint's run had no scheduler; one cannot be added on resume"
                           : "--resume: the checkpoint's run had a scheduler; resume it with its --scheduler");
  if (parts.scheduler != nullptr) parts.scheduler->load_state_dict(*st.scheduler);
  if ((parts.scaler != nullptr) != st.scaler.has_value())
    throw InvalidInput(parts.scaler != nullptr
                           ? "--resume: the checkpoint's run had no loss scaling; it cannot be added on resume"
                           : "--resume: the checkpoint's run had loss scaling; resume it with --loss-scale dynamic");
  if (parts.scaler != nullptr) parts.scaler->load_state_dict(*st.scaler);
  // SWA/EMA: the averages (cut like the parameters) and SWALR once SWA has
  // started.
  if (st.n_averaged) {
    if (parts.averaged == nullptr)
      throw InvalidInput("--resume: the checkpoint's run averaged its parameters; resume it with its --swa-start or "
                         "--ema-decay");
    parts.averaged->load_state_dict({*st.n_averaged, own_values(strategy, comm.rank(), tensors, prefix + "avg.")});
  }
  if (st.swa_scheduler) start_swa().load_state_dict(*st.swa_scheduler);
  if (st.groups && parts.optimizer != nullptr) load_groups(*parts.optimizer, *st.groups);
  return warning;
}

}  // namespace distopt::checkpoint
